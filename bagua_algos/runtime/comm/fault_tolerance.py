"""Fault tolerance at the step, on torchft (opt-in).

Each worker is a torchft *replica* (a replica group of one process) with its own
``torchft.Manager``. At the start of every training step the manager asks the
lighthouse for a quorum; when the quorum changed (a worker died, hung, joined or came
back), the manager calls :meth:`_QuorumGroup.configure`, which re-forms torch's default
process group over the quorum's members (rank = replica rank, world = replica count)
in a namespace of the quorum's store. Every collective of ``comm`` therefore runs over
the quorum of the step, unchanged. A collective that fails (a peer died or went
silent past the timeout) does not raise: the error is reported to the manager, every
later collective of the step is skipped, and the step is discarded on every replica
alike by ``manager.should_commit()`` (runtime/fault_tolerant_step.py does the
training-step side: quorum, commit or roll back, rebuild, healing state).

What a replica trusts (docs/elastic.md, "Trust and the network"): its servers (the
replica's store, its torchft manager, its healing server) listen on ``$BAGUA_ALGOS_BIND_HOST``
(the launcher sets loopback for a job on one node); a quorum that holds a replica id that
is not one of the job's (``$BAGUA_ALGOS_JOB_REPLICAS``) is refused; the healing state
travels as ``torch.save`` bytes, signed with ``$BAGUA_ALGOS_JOB_SECRET`` when the job has
one, loaded with ``weights_only=True`` (tensors and plain values, never a peer's code) and
checked against this replica's own state before it is applied. A refusal ends the
replica with one line (``SystemExit``): it cannot train with peers it does not trust.

From ``init_process_group()`` on, :func:`job_rank` and :func:`job_world_size` (the
package's ``get_rank()``/``get_world_size()`` for a script) are the replica's slot among
the job's replicas and their number, as torchft's own DistributedSampler takes
replica_rank and num_replica_groups; the collectives run over the live quorum. Until the
first quorum the default group is torch's "fake" group of that rank and size (no
communication: the step's quorum forms the real one), so a sampler built from
``torch.distributed`` right after init takes this replica's share too.

This module is the only one that imports torchft; it is imported only when fault
tolerance is asked for (``init_process_group(fault_tolerance="torchft")`` or
``$BAGUA_ALGOS_FAULT_TOLERANCE=torchft``, which the launcher's ``--torchft`` sets).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import ipaddress
import os
import socket
import threading
import time
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

import torch
import torch.distributed as dist

FT_ENV = "BAGUA_ALGOS_FAULT_TOLERANCE"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address
MIN_REPLICAS_ENV = "BAGUA_ALGOS_MIN_REPLICAS"
REPLICA_ID_ENV = "BAGUA_ALGOS_REPLICA_ID"
JOB_REPLICAS_ENV = "BAGUA_ALGOS_JOB_REPLICAS"  # the job's replica ids, comma-separated, in slot order
BIND_ENV = "BAGUA_ALGOS_BIND_HOST"  # where this replica's servers listen (unset: every interface)
SECRET_ENV = "BAGUA_ALGOS_JOB_SECRET"  # signs the healing state (the same on every node of the job)
SIGNATURE_HEADER = "X-Bagua-Signature"
# Seconds (at most the job's timeout) a replica that serves its state to healing peers
# waits at its commit for their requests: a live healing peer asks right after its quorum,
# the same round as the serving one's, so seconds suffice even on a loaded host.
HEAL_REQUEST_WAIT = 20.0
INSTALL_HINT = "pip install 'bagua-algos[torchft]'"
CHOICES = (None, "torchft")

# The manager of this process (None: fault tolerance is off) and whether a collective
# of the current step failed. Read by handle.py and checks.py on every collective.
_ft = {"manager": None, "errored": None, "quorum_id": -1, "timeout": None}


def active() -> bool:
    return _ft["manager"] is not None


def step_errored() -> bool:
    return _ft["errored"] is not None


def last_error() -> Optional[str]:
    """The first failed collective of the latest step that failed, as one line (its type
    and message, at most 300 characters); None until a step fails."""
    return _ft.get("last_error")


def report_error(exc: BaseException) -> None:
    """A collective of this step failed: remember it (later collectives of the step are
    skipped) and tell the manager, so that ``should_commit`` discards the step."""
    if _ft["errored"] is None:
        _ft["errored"] = exc
        _ft["last_error"] = f"{type(exc).__name__}: {exc}"[:300]
    manager = _ft["manager"]
    if manager is not None:
        manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))


def requested(fault_tolerance) -> Optional[str]:
    """``"torchft"`` or None, from the argument, else ``$BAGUA_ALGOS_FAULT_TOLERANCE``."""
    where = "fault_tolerance"
    if fault_tolerance is None:
        fault_tolerance = os.environ.get(FT_ENV) or None
        where = f"${FT_ENV}"
    if fault_tolerance in ("", "0", "none", "off"):
        fault_tolerance = None
    if fault_tolerance not in CHOICES:
        raise ValueError(f"{where} must be 'torchft' or unset, got {fault_tolerance!r}")
    return fault_tolerance


def import_torchft():
    """torchft, or one clear line naming the install."""
    try:
        import torchft  # noqa: F401
        from torchft import manager, process_group  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"fault tolerance on torchft was asked for (--torchft, fault_tolerance='torchft' or ${FT_ENV}) "
            f"but the torchft package cannot be imported ({exc}); install it: {INSTALL_HINT}"
        ) from None
    return torchft


def _quorum_group_class():
    from torchft.process_group import ProcessGroup, create_store_client

    class _QuorumGroup(ProcessGroup):
        """The process group torchft's manager reconfigures at every quorum change: here
        it is torch's default group itself, formed again over the quorum's members."""

        def __init__(self, timeout: timedelta):
            super().__init__(0, 1)
            self._timeout = timeout
            self._world = 1

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None) -> None:
            from .groups import _joined

            if dist.is_initialized():
                dist.destroy_process_group()
            store = create_store_client(store_addr, timeout=self._timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=self._timeout)
            _joined(self._timeout)
            self._world = world_size
            _ft["quorum_id"] = quorum_id if quorum_id is not None else _ft["quorum_id"] + 1
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
            os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world_size)

        def size(self) -> int:
            return self._world

        def getBackendName(self) -> str:
            return "bagua-torchft-gloo"

        def errored(self):
            return _ft["errored"]

    return _QuorumGroup


def _local_world(timeout: timedelta, slot=None) -> None:
    """A default group before the first quorum, so that ``with_bagua`` can build the
    algorithm (the first step re-forms it over the quorum): with the replica's slot
    (rank, size) among the job's, torch's "fake" group of that rank and size, which
    communicates with no one, so that ``torch.distributed``'s rank and size read right
    after init are the slot's; else (the slot unknown, or a replica that lost its group
    and works alone until the next quorum) a gloo group of this process alone."""
    from .groups import _joined

    rank, world = slot if slot is not None else (0, 1)
    if world > 1:
        # importing it registers torch's "fake" backend (torch.testing's, no collectives run)
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _joined(timeout)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = str(rank), str(world)


def job_replicas() -> Optional[List[str]]:
    """The job's replica ids in slot order (``$BAGUA_ALGOS_JOB_REPLICAS``, which the
    launcher sets), or None when the replicas were started otherwise."""
    text = os.environ.get(JOB_REPLICAS_ENV, "").strip()
    return [r.strip() for r in text.split(",") if r.strip()] or None


def job_rank(group=None) -> int:
    """``get_rank()`` for a script: under torchft the replica's slot among the job's
    replicas (fixed for the job, whichever replicas are live), else ``comm.get_rank``."""
    from .transport import transport_for

    if group is None and active() and _ft.get("slot") is not None:
        return _ft["slot"][0]
    return transport_for(None, group).get_rank(group)


def job_world_size(group=None) -> int:
    """``get_world_size()`` for a script: under torchft the number of the job's replicas
    (the collectives run over the live quorum, ``comm.get_world_size()``)."""
    from .transport import transport_for

    if group is None and active() and _ft.get("slot") is not None:
        return _ft["slot"][1]
    return transport_for(None, group).get_world_size(group)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bind_host(lighthouse: str) -> Optional[str]:
    """Where this replica's servers listen: ``$BAGUA_ALGOS_BIND_HOST``, else loopback
    when the lighthouse is on loopback (every replica is on this machine), else None
    (every interface, as torch and torchft do by default)."""
    host = os.environ.get(BIND_ENV, "").strip()
    if host:
        return "127.0.0.1" if host.lower() == "localhost" else host
    hostport = lighthouse.split("://", 1)[-1].rstrip("/")
    return "127.0.0.1" if is_loopback(hostport.rpartition(":")[0] or hostport) else None


def _any_interface() -> str:
    """Every interface: IPv6's wildcard (dual-stack on Linux) where there is IPv6."""
    return "::" if socket.has_ipv6 else "0.0.0.0"


def _listener(host: Optional[str]) -> socket.socket:
    """A listening TCP socket on ``host`` (None: every interface), port chosen by the kernel."""
    host = _any_interface() if host is None else host
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


@contextlib.contextmanager
def _manager_bind(host: Optional[str]):
    """torchft's Manager starts its server on ``[::]:PORT`` (torchft/manager.py, ``bind =
    f"[::]:{port}"``) with no argument to change it: while the Manager is built, its
    ``ManagerServer`` is given ``host`` instead (the port is kept)."""
    import torchft.manager as tm

    real = tm.ManagerServer
    if host is None:
        yield
        return

    def server(**kwargs):
        kwargs["bind"] = f"{_url_host(host)}:{kwargs['bind'].rpartition(':')[2]}"
        return real(**kwargs)

    tm.ManagerServer = server
    try:
        yield
    finally:
        tm.ManagerServer = real


def _refuse(message: str) -> RuntimeError:
    """Remember a refusal (start_step ends the replica with it) and return the error."""
    _ft["refused"] = f"bagua-algos torchft replica {_ft.get('replica_id')!r}: {message}"
    return RuntimeError(_ft["refused"])


def _exit_refused() -> None:
    """End this replica with its refusal as one line, written in one ``write`` (replicas
    share the launcher's stderr: Python's own exit message writes the text and its
    newline apart, so two replicas' lines could run together)."""
    os.write(2, (_ft["refused"].rstrip("\n") + "\n").encode())
    raise SystemExit(1) from None


class _CheckedClient:
    """The manager's client to its own server, with every quorum checked before torchft
    forms a group over it or heals from it: a member whose replica id is not one of the
    job's is refused (anyone who reaches the lighthouse could otherwise join, be healed
    from, and read or write the job's weights)."""

    def __init__(self, client, replicas: List[str]):
        self._client, self._replicas = client, set(replicas)

    def _quorum(self, **kwargs):
        quorum = self._client._quorum(**kwargs)
        foreign = sorted(r.split(":")[0] for r in quorum.replica_ids if r.split(":")[0] not in self._replicas)
        if foreign:
            raise _refuse(f"the quorum holds replica(s) {foreign} that are not this job's "
                          f"(${JOB_REPLICAS_ENV}: {', '.join(sorted(self._replicas))}); refused: keep the "
                          "lighthouse and the replicas' ports on a private network (docs/elastic.md, "
                          "\"Trust and the network\")")
        return quorum

    def __getattr__(self, name):
        return getattr(self._client, name)


def _sign(secret: str, step: int, body: bytes) -> str:
    """HMAC-SHA256 of the step and the serialized state under the job's secret."""
    return hmac.new(secret.encode(), f"{step}\n".encode() + body, hashlib.sha256).hexdigest()


def check_received(state, step: int) -> Optional[str]:
    """What is wrong with a healing state as torchft's manager will read it (its
    ``"torchft"`` counters, the ``"user"`` states by key), checked by the registered
    checks (``_ft["checks"]``: the training step checks its own state), or None."""
    if not isinstance(state, dict) or set(state) != {"user", "torchft"}:
        return f"the state is not {{'user', 'torchft'}}: {type(state).__name__}"
    counters, user = state["torchft"], state["user"]
    if not isinstance(counters, dict) or not all(isinstance(v, int) for v in counters.values()) \
            or counters.get("step") != step:
        return f"its torchft counters are not the step {step}'s: {counters!r}"[:300]
    checks = _ft.get("checks") or {}
    if not isinstance(user, dict) or set(user) != set(checks):
        got = sorted(map(repr, user)) if isinstance(user, dict) else type(user).__name__
        return f"its states are {got}, expected {sorted(checks)}"
    for key, check in checks.items():
        problem = check(user[key])
        if problem:
            return f"state {key!r}: {problem}"
    return None


def _healing_handler(transport, seconds: float):
    """The HTTP handler of a replica's healing server: ``GET /checkpoint/<step>`` answers
    the bytes ``transport`` serves for that step (signed when the job has a secret), or 404."""

    class Handler(BaseHTTPRequestHandler):
        timeout = seconds  # a socket timeout: no request holds a thread forever

        def do_GET(self):
            parts = self.path.strip("/").split("/")
            step = int(parts[1]) if len(parts) == 2 and parts[0] == "checkpoint" and parts[1].isdigit() else -1
            body = transport._wait_for(step) if step >= 0 else None
            if body is None:
                self.send_error(404, f"no checkpoint of step {step} is served here")
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(body)))
            if transport._secret:
                self.send_header(SIGNATURE_HEADER, _sign(transport._secret, step, body))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # one line per request on stderr otherwise
            pass

    return Handler


def _tensor_transport_class():
    from torchft.checkpointing.transport import CheckpointTransport

    class _TensorTransport(CheckpointTransport):
        """Healing carries tensors and plain values only. torchft's HTTPTransport loads
        what a peer sends with ``weights_only=False`` (torchft/checkpointing/
        http_transport.py, ``_streaming_load(f, weights_only=False)``: a pickle, code of the
        peer's choosing) and its PGTransport unpickles the peer's metadata
        (pg_transport.py, ``pickle.loads``); here the state is ``torch.save``'d bytes,
        signed with the job's secret, served on ``host`` and loaded with
        ``weights_only=True`` after the signature is checked, then checked by
        :func:`check_received`."""

        def __init__(self, host: Optional[str], advertise: str, timeout: timedelta, secret: Optional[str]):
            self._timeout, self._secret, self._advertise = timeout, secret, advertise
            self._ready = threading.Condition()
            self._step, self._body = -1, None
            # the healing peers of the step served, the requests that got its state (the bytes
            # are then theirs whatever follows) and until when a commit waits for them
            self._expected, self._fetched, self._deadline = 0, 0, 0.0
            where = _any_interface() if host is None else host

            class Server(ThreadingHTTPServer):
                address_family = socket.AF_INET6 if ":" in where else socket.AF_INET
                daemon_threads = True

            self._server = Server((where, 0), _healing_handler(self, timeout.total_seconds()))
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                            name="bagua-healing-server")
            self._thread.start()

        def _wait_for(self, step: int) -> Optional[bytes]:
            with self._ready:
                self._ready.wait_for(lambda: self._step == step and self._body is not None,
                                     timeout=self._timeout.total_seconds())
                if self._step != step:
                    return None
                self._fetched += 1
                self._ready.notify_all()
                return self._body

        def metadata(self) -> str:
            return f"http://{_url_host(self._advertise)}:{self._server.server_address[1]}/checkpoint/"

        def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
            buffer = io.BytesIO()
            torch.save(state_dict, buffer)
            with self._ready:
                self._step, self._body = step, buffer.getvalue()
                self._expected, self._fetched = len(dst_ranks), 0
                self._deadline = time.monotonic() + min(self._timeout.total_seconds(), HEAL_REQUEST_WAIT)
                self._ready.notify_all()

        def disallow_checkpoint(self) -> None:
            """Called by the manager's ``should_commit``: the step's state is served no
            more. It waits (up to the timeout) until every healing peer of the step has
            fetched it: the state is serialized at this replica's quorum, so it is the
            committed one whenever it is fetched, but a replica that exchanges nothing with
            its healing peer in the step (a local step, a sparse topology) can reach its
            commit before the peer has asked; the peer's heal would then fail and its step
            be discarded, and, the quorum unchanged, nothing else holds this replica back.
            A request that came holds the bytes, so the wait is for the requests only, and
            at most ``HEAL_REQUEST_WAIT`` from the serving (a healing peer that died never asks)."""
            with self._ready:
                self._ready.wait_for(lambda: self._body is None or self._fetched >= self._expected,
                                     timeout=max(0.0, self._deadline - time.monotonic()))
                self._step, self._body = -1, None

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
            url = f"{metadata}{step}"
            if not url.startswith("http://"):
                raise _refuse(f"the healing peer (replica rank {src_rank}) gave no http address: {url[:200]!r}")
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as response:
                body, signature = response.read(), response.headers.get(SIGNATURE_HEADER) or ""
            if self._secret and not hmac.compare_digest(signature, _sign(self._secret, step, body)):
                raise _refuse(f"the healing state from {url} is not signed with the job's secret "
                              f"(${SECRET_ENV}); refused unread")
            try:
                state = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - what a peer sent is not tensors and plain values
                raise _refuse(f"the healing state from {url} holds more than tensors and plain values; "
                              f"refused ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
            problem = check_received(state, step)
            if problem:
                raise _refuse(f"the healing state from {url} does not fit this replica: {problem}")
            return state

        def shutdown(self, wait: bool = True) -> None:
            self._server.shutdown()
            self._server.server_close()

    return _TensorTransport


def check_lighthouse(address: str, timeout: float) -> None:
    """One clear line when the lighthouse cannot be reached (torchft would otherwise
    fail deep inside its Rust client, or retry for its connect timeout)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"the torchft lighthouse at {address} (--lighthouse or ${LIGHTHOUSE_ENV}) cannot be reached "
            f"({exc}); start one (the launcher's --torchft without --lighthouse starts one, or "
            f"`torchft_lighthouse --min_replicas N`) or fix the address"
        ) from None


def init(timeout: timedelta, lighthouse: Optional[str] = None, min_replicas: Optional[int] = None,
         replica_id: Optional[str] = None, connect_timeout: Optional[timedelta] = None):
    """Make this process a torchft replica: its own store, a manager, a local default
    group until the first quorum. Returns the manager."""
    import_torchft()
    from torchft.manager import Manager

    lighthouse = lighthouse or os.environ.get(LIGHTHOUSE_ENV)
    if not lighthouse:
        raise RuntimeError(
            f"fault tolerance on torchft needs a lighthouse: the launcher's --torchft starts one, "
            f"or pass --lighthouse ADDR / set ${LIGHTHOUSE_ENV}"
        )
    connect_timeout = connect_timeout or min(timeout, timedelta(seconds=10))
    check_lighthouse(lighthouse, connect_timeout.total_seconds())
    if min_replicas is None:
        min_replicas = int(os.environ.get(MIN_REPLICAS_ENV, "1"))
    replica_id = replica_id or os.environ.get(REPLICA_ID_ENV) or f"replica_{os.getpid()}"
    replicas, slot = job_replicas(), None
    if replicas is not None:
        if replica_id not in replicas:
            raise RuntimeError(f"this replica's id {replica_id!r} (${REPLICA_ID_ENV}) is not one of the job's "
                               f"(${JOB_REPLICAS_ENV}: {', '.join(replicas)})")
        slot = (replicas.index(replica_id), len(replicas))
    bind = bind_host(lighthouse)
    host = bind or socket.gethostname()  # the address peers reach this replica at
    # torch's TCPStore server listens on every interface whatever its host_name; given a
    # socket already bound (master_listen_fd), it listens there
    listener = _listener(bind)
    store = dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timeout,
                          master_listen_fd=listener.detach())
    _ft.update(slot=slot, replica_id=replica_id, refused=None, checks={})
    _local_world(timeout, slot)
    pg = _quorum_group_class()(timeout)
    transport = _tensor_transport_class()(bind, host, timeout, os.environ.get(SECRET_ENV) or None)
    with _manager_bind(bind):
        manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=connect_timeout,
            rank=0, world_size=1, store_addr=host, store_port=store.port, lighthouse_addr=lighthouse,
            replica_id=replica_id, hostname=host, checkpoint_transport=transport,
        )
    if replicas is not None:
        manager._client = _CheckedClient(manager._client, replicas)
    manager._bagua_store = store  # keep the replica's store alive as long as the manager
    _ft.update(manager=manager, errored=None, quorum_id=-1, timeout=timeout)
    return manager


def start_step() -> bool:
    """The step's quorum (re-forms the group if it changed, heals if behind). Returns
    whether the quorum changed since the previous step.

    When no quorum came within the timeout the step is errored (its collectives are
    skipped and it is discarded). When the manager failed to form the group (torchft
    reports a failed ``configure`` and keeps the quorum's id), the step is errored too;
    until the group exists again this process works in a group of its own, and the next
    quorum forms the group again even if its id is unchanged."""
    manager = _ft["manager"]
    before = _ft["quorum_id"]
    torn = False
    if _ft["errored"] is not None and peer_lost(_ft["errored"]) and dist.is_initialized():
        # The last step lost a peer: tear the group down now, before the quorum. A replica
        # still blocked in that step's collective on a live peer (gloo: one not next to
        # the dead one in the ring) is then released at once by the closed connections,
        # instead of when the next quorum re-forms the group (after the lighthouse's
        # heartbeat timeout), so every survivor asks for the next quorum together.
        dist.destroy_process_group()
        torn = True
    _ft["errored"] = None
    if _ft.get("unformed"):
        manager._quorum_id = -1  # torchft calls configure only for a new id: ask again
        _ft["unformed"] = False
    try:
        manager.start_quorum()
    except TimeoutError as exc:
        # No quorum within the timeout (the lighthouse's members changed under it): the
        # step is discarded like a failed collective and the next step asks again (a new
        # quorum forms its group anew). torchft keeps the failed future and would raise
        # it again at the next start_quorum: dropped.
        manager._quorum_future = None
        manager.report_error(exc)
    except Exception:
        if _ft.get("refused"):
            _exit_refused()
        raise
    if _ft.get("refused"):  # a healing state refused (torchft reports it as the step's error)
        _exit_refused()
    failed = manager.errored()
    if failed is not None:
        _ft["errored"] = getattr(failed, "original_exception", failed)
    elif torn and _ft["quorum_id"] == before:  # the same quorum: the group was not formed again
        _ft["errored"] = RuntimeError("the group was torn down after a lost peer and the quorum did not change")
    if _ft["errored"] is not None and not dist.is_initialized():  # no group: work alone, form it next step
        _local_world(_ft["timeout"])
        _ft["unformed"] = True
        _ft["quorum_id"] = -2
    return _ft["quorum_id"] != before


# What gloo (and the TCP under it) says when a peer's process is gone or has closed the
# group: the step's group is broken for good, unlike a timeout on a slow peer.
_PEER_LOST = ("connection closed by peer", "connection reset", "broken pipe", "econnreset", "econnrefused",
              "connection refused", "epipe")


def peer_lost(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(marker in text for marker in _PEER_LOST)


def before_first_quorum() -> bool:
    """Whether this replica has no group of its quorum yet (before its first quorum, or
    after a group it failed to form): the default group is then one without peers (a
    collective over it exchanges nothing), so a collective agreement cannot be made."""
    return active() and (_ft["quorum_id"] < 0 or bool(_ft.get("unformed")))


def counters() -> dict:
    """The manager's counters (committed steps, batches), for a checkpoint."""
    return dict(_ft["manager"].state_dict())


def restore_counters(saved) -> None:
    """Set the manager's counters from a checkpoint's: the committed steps go on from the
    checkpoint's (without it they would start again from 0). Every replica resumes from
    its own newest valid file; one that loaded an older step is behind at the quorum and
    heals from a replica at the newest (torchft's rule)."""
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k), int) and saved[k] >= 0
                                               for k in ("step", "batches_committed")):
        raise ValueError(f"the checkpoint's torchft counters must be {{'step', 'batches_committed'}} "
                         f"of integers >= 0, got {saved!r}"[:300])
    _ft["manager"].load_state_dict({"step": saved["step"], "batches_committed": saved["batches_committed"]})


def should_commit() -> bool:
    return bool(_ft["manager"].should_commit())


def shutdown() -> None:
    manager = _ft["manager"]
    _ft.update(manager=None, errored=None, quorum_id=-1, slot=None, checks={})
    if manager is not None:
        manager.shutdown(wait=False)
