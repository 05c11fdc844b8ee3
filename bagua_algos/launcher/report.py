"""The launcher's report of a job that ended badly, one line on stderr: which worker
failed first and how (:func:`failure_summary`, with its exit status), or why the
rendezvous failed and which flag configures what ran out (:func:`rendezvous_failure`).
"""

from __future__ import annotations

import argparse
import os
import signal

from bagua_algos.launcher.flags import (C10D_DEFAULTS, LATE_JOIN_ISSUE, PROG, SHARE_STORE_ENV,
                                        STATIC_DEFAULT_TIMEOUT, nnodes_text, rdzv_conf, rendezvous_backend)


def first_failure(failures) -> int:
    """The global rank whose failure started the job's end, from ChildFailedError.failures.

    torchrun's agent stops the other workers with SIGTERM as soon as it sees one fail
    (and with SIGKILL 30 s later if they ignore it), then records every worker that
    ended non-zero, each with the time in whole seconds at which it was recorded (or,
    for a worker with an error file, the time the error was written). So the stopped
    workers usually carry the same second as the worker that failed. The failure
    chosen is

    1. the earliest by timestamp;
    2. on a tie, one not ended by SIGTERM (the agent's own stop signal) over one
       that was;
    3. then a worker killed by another signal (SIGKILL from the OOM killer, SIGSEGV,
       SIGABRT: a cause) over one that exited with a code (often a consequence:
       a collective failing because a peer died);
    4. then the order in which the agent recorded them (the order of ``failures``).
    """
    if not failures:
        raise ValueError("no failures to choose from")
    sigterm = -int(signal.SIGTERM)
    position = {rank: index for index, rank in enumerate(failures)}

    def key(rank):
        f = failures[rank]
        return (f.timestamp, f.exitcode == sigterm, f.exitcode >= 0, position[rank])

    return min(failures, key=key)


def _how(f) -> str:
    return f"was killed by signal {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"


def failure_summary(err, prog: str = PROG) -> tuple[str, int]:
    """A one-line description of a ChildFailedError and the exit status to use."""
    failures = err.failures
    rank = first_failure(failures)
    f = failures[rank]
    status = 1 if f.exitcode < 0 else (f.exitcode if 0 < f.exitcode < 256 else 1)
    others = []
    for r in sorted(failures):
        if r != rank:
            code = failures[r].exitcode
            others.append(f"{r} ({failures[r].signal_name() if code < 0 else f'code {code}'})")
    tail = f"; other local ranks ended: {', '.join(others)}" if others else ""
    line = (f"{prog}: job failed: worker rank {rank} (local_rank {f.local_rank}, "
            f"pid {f.pid}) {_how(f)}; the node's workers were stopped{tail}")
    return line, status



def rendezvous_failure(error: BaseException, args: argparse.Namespace, prog: str = PROG) -> str:
    """One line for a rendezvous that failed, naming the flag that configures what ran out.

    ``error`` is what torchrun's agent raised outside its workers: a
    ``RendezvousError`` (connection, timeout, closed) or a store error
    (``torch.distributed.DistError``: a wait on a key that timed out)."""
    from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError, RendezvousConnectionError,
                                                          RendezvousTimeoutError)

    backend = rendezvous_backend(args)
    conf = rdzv_conf(args)
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if backend == "static":
        where = (f"--rdzv_endpoint {args.rdzv_endpoint}" if args.rdzv_endpoint
                 else f"--master_addr {args.master_addr} --master_port {args.master_port}")
        timeout = int(conf.get("timeout", STATIC_DEFAULT_TIMEOUT))
        return (f"{prog}: rendezvous failed: the {args.nnodes[1]} nodes did not all meet at node 0's store "
                f"({where}) within {timeout} s (--rdzv_timeout): is node 0's launcher running there, "
                f"and the port open? ({type(error).__name__}: {cause})")
    endpoint = "localhost (--standalone)" if args.standalone else (args.rdzv_endpoint or "localhost")
    read_timeout = int(conf.get("read_timeout", C10D_DEFAULTS["read_timeout"]))
    if isinstance(error, RendezvousConnectionError):
        return (f"{prog}: rendezvous failed: cannot reach the c10d store at --rdzv_endpoint {endpoint} "
                f"within read_timeout={read_timeout} s (--rdzv_conf): the agent that hosts it (the first "
                "launcher on that host) is not running or not reachable, or the port is closed")
    if isinstance(error, RendezvousTimeoutError):
        join = int(conf.get("join_timeout", C10D_DEFAULTS["join_timeout"]))
        return (f"{prog}: rendezvous failed: fewer than the {args.nnodes[0]} node(s) that --nnodes "
                f"{nnodes_text(args.nnodes)} asks for joined --rdzv_endpoint {endpoint} (--rdzv_id "
                f"{args.rdzv_id}) within join_timeout={join} s (--rdzv_conf or --rdzv_timeout)")
    if isinstance(error, RendezvousClosedError):
        return (f"{prog}: rendezvous failed: the rendezvous --rdzv_id {args.rdzv_id} at {endpoint} is closed "
                "(its job has ended or another agent gave up); start a new job with a new --rdzv_id")
    text = f"{type(error).__name__}: {cause}"
    if os.environ.get(SHARE_STORE_ENV) != "1" and ("role_info" in cause or "MASTER_ADDR" in cause):
        text += (f"; a node joining a running c10d job waits for keys that the running agent never "
                 f"writes unless {SHARE_STORE_ENV}=1 ({LATE_JOIN_ISSUE})")
    return (f"{prog}: rendezvous failed: a wait on the c10d store at --rdzv_endpoint {endpoint} timed out "
            f"after read_timeout={read_timeout} s (--rdzv_conf): {text}")

