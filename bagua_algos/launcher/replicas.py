"""``--torchft``: start the workers as torchft replicas (docs/elastic.md).

torchrun's agent stops every worker when one fails, which is what fault tolerance at
the step must avoid; so under ``--torchft`` the launcher starts the workers itself, one
process each, every one a replica of its own (``$BAGUA_ALGOS_REPLICA_ID``), all joining
one lighthouse: the one given by ``--lighthouse``, or one this launcher starts (torchft's
``LighthouseServer``, as torchft's own tests start it). A worker that dies is not
restarted here (torchft leaves that to the scheduler; a replica started again, by hand
or by a scheduler, heals from a live peer and joins). The launcher ends when every
worker has ended: status 0 when at least ``--min_replicas`` of them finished with 0,
1 otherwise, with one line for each worker that did not finish.

Each replica is told the job's replicas (``$BAGUA_ALGOS_JOB_REPLICAS``: ``node{K}_replica{I}``
for every node K and worker I, its slot is its place there) and where to listen: on one
node (no ``--lighthouse``) the lighthouse and every replica's servers listen on loopback
only, and the healing state is signed with a secret made here; with ``--lighthouse`` they
listen on ``--local_addr`` when given (else on every interface, as torch and torchft do),
and the secret is ``$BAGUA_ALGOS_JOB_SECRET``, the same on every node (docs/elastic.md,
"Trust and the network").
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import List


def _import_torchft(prog: str):
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as exc:
        print(f"{prog}: --torchft needs the torchft package ({exc}); install it: pip install "
              "'bagua-algos[torchft]'", file=sys.stderr, flush=True)
        sys.exit(2)
    return LighthouseServer


def _worker_argv(args: argparse.Namespace) -> List[str]:
    if args.no_python:
        head = [args.training_script]
    elif args.module:
        head = [sys.executable, "-u", "-m", args.training_script]
    else:
        head = [sys.executable, "-u", args.training_script]
    return head + list(args.training_script_args)


def _trust_environment(args: argparse.Namespace, prog: str, lighthouse: str) -> dict:
    """What every replica of this node is told about the job: its replicas in slot order,
    where to listen, the secret that signs the healing state."""
    from bagua_algos.runtime.comm import fault_tolerance as ft

    nodes, nproc = args.nnodes[1], int(args.nproc_per_node)
    env = {ft.JOB_REPLICAS_ENV: ",".join(f"node{k}_replica{i}" for k in range(nodes) for i in range(nproc))}
    if args.local_addr:
        env[ft.BIND_ENV] = args.local_addr
    elif ft.is_loopback(lighthouse.split("://", 1)[-1].rpartition(":")[0]):
        env[ft.BIND_ENV] = "127.0.0.1"
    if os.environ.get(ft.SECRET_ENV):
        return env
    if nodes == 1:
        env[ft.SECRET_ENV] = secrets.token_hex(32)  # every replica is started here: a secret of this job
    else:
        print(f"{prog}: warning: ${ft.SECRET_ENV} is not set: the healing state is not signed (it is still "
              "loaded as tensors only); set it to the same secret on every node", file=sys.stderr, flush=True)
    return env


def run_replicas(args: argparse.Namespace, prog: str, set_worker_environment) -> int:
    """Start ``args.nproc_per_node`` replicas (and a lighthouse on loopback, unless
    ``--lighthouse`` names one) and wait for them; ``set_worker_environment(args, prog)``
    is the launcher's, what every worker inherits (passed in: the launcher imports this
    module, not the other way round)."""
    from bagua_algos.runtime.comm import fault_tolerance as ft

    LighthouseServer = _import_torchft(prog)
    nproc = int(args.nproc_per_node)
    lighthouse = None
    address = args.lighthouse
    if address:
        try:
            ft.check_lighthouse(address, 5.0)
        except RuntimeError as exc:
            print(f"{prog}: {exc}", file=sys.stderr, flush=True)
            return 1
    else:  # one node: the lighthouse on loopback (its address() names the host name, whatever the bind)
        lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas,
                                      join_timeout_ms=int(args.join_timeout * 1000),
                                      heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))
        address = f"http://127.0.0.1:{lighthouse.address().rstrip('/').rpartition(':')[2]}"
        print(f"{prog}: torchft lighthouse at {address} (min_replicas={args.min_replicas})",
              file=sys.stderr, flush=True)
    set_worker_environment(args, prog)
    os.environ.pop("MASTER_PORT", None)  # each replica has its own store
    common = _trust_environment(args, prog, address)
    procs = []
    for i in range(nproc):
        env = dict(os.environ, **common)
        env.update({ft.FT_ENV: "torchft", ft.LIGHTHOUSE_ENV: address, ft.MIN_REPLICAS_ENV: str(args.min_replicas),
                    ft.REPLICA_ID_ENV: f"node{args.node_rank}_replica{i}", "LOCAL_RANK": "0"})
        procs.append(subprocess.Popen(_worker_argv(args), env=env))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if lighthouse is not None:
            lighthouse.shutdown()
    finished = sum(p.returncode == 0 for p in procs)
    for i, p in enumerate(procs):
        if p.returncode != 0:
            how = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                   else f"exit status {p.returncode}")
            print(f"{prog}: replica {i} (pid {p.pid}) did not finish: {how}", file=sys.stderr, flush=True)
    return 0 if finished >= max(1, args.min_replicas) else 1
