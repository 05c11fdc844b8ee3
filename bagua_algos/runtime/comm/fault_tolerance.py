"""Fault tolerance at the step, on torchft (opt-in; issue 44).

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

This module is the only one that imports torchft; it is imported only when fault
tolerance is asked for (``init_process_group(fault_tolerance="torchft")`` or
``$BAGUA_ALGOS_FAULT_TOLERANCE=torchft``, which the launcher's ``--torchft`` sets).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

FT_ENV = "BAGUA_ALGOS_FAULT_TOLERANCE"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address
MIN_REPLICAS_ENV = "BAGUA_ALGOS_MIN_REPLICAS"
REPLICA_ID_ENV = "BAGUA_ALGOS_REPLICA_ID"
INSTALL_HINT = "pip install 'bagua-algos[torchft]'"
CHOICES = (None, "torchft")

# The manager of this process (None: fault tolerance is off) and whether a collective
# of the current step failed. Read by handle.py and checks.py on every collective.
_ft = {"manager": None, "errored": None, "quorum_id": -1, "timeout": None}


def active() -> bool:
    return _ft["manager"] is not None


def step_errored() -> bool:
    return _ft["errored"] is not None


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


def _local_world(timeout: timedelta) -> None:
    """A default group of this process alone, so that ``with_bagua`` can build the
    algorithm before the first quorum (the first step re-forms it over the quorum)."""
    from .groups import _joined

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    _joined(timeout)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "0", "1"
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"


def _check_lighthouse(address: str, timeout: float) -> None:
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
    _check_lighthouse(lighthouse, connect_timeout.total_seconds())
    if min_replicas is None:
        min_replicas = int(os.environ.get(MIN_REPLICAS_ENV, "1"))
    replica_id = replica_id or os.environ.get(REPLICA_ID_ENV) or f"replica_{os.getpid()}"
    host = "127.0.0.1" if lighthouse.split("://", 1)[-1].startswith(("localhost", "127.")) else socket.gethostname()
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    _local_world(timeout)
    pg = _quorum_group_class()(timeout)
    manager = Manager(
        pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
        use_async_quorum=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=connect_timeout,
        rank=0, world_size=1, store_addr=host, store_port=store.port, lighthouse_addr=lighthouse,
        replica_id=replica_id, hostname=host,
    )
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


def should_commit() -> bool:
    return bool(_ft["manager"].should_commit())


def shutdown() -> None:
    manager = _ft["manager"]
    _ft.update(manager=None, errored=None, quorum_id=-1)
    if manager is not None:
        manager.shutdown(wait=False)
