"""Process groups and collectives with Bagua 0.9's names, on torch.distributed.

This module is the only code in the project that calls ``torch.distributed``. It
follows ``bagua.torch_api.communication`` and ``bagua.torch_api.env``: the same
function names, positional order and argument names (``init_process_group``,
``new_group``, ``allreduce``, ``alltoall_v``, ``ReduceOp``, ...), on gloo (CPU) or
NCCL (GPU).

Where the work happens: ``comm=``, ``group=``
---------------------------------------------
Every collective takes Bagua's ``comm`` argument: a communicator (from a
:class:`BaguaProcessGroup`'s ``get_global_communicator()``,
``get_intra_node_communicator()`` or ``get_inter_node_communicator()``), a
:class:`BaguaProcessGroup` (its global communicator), a ``torch.distributed``
process group, or ``None`` for the global communicator of the default group.

``group=`` is a keyword-only extra kept for the project's own callers; it takes the
same kinds of objects. The two differ only in what a rank argument means:

* with ``comm=`` (Bagua's API), ``src``, ``dst`` are ranks **inside the
  communicator**, 0 ... ``comm.nranks() - 1``. Bagua hands them unchanged to its
  NCCL communicator, which numbers its members by their position in the
  communicator's sorted global ranks (``BaguaSingleCommunicatorPy(rank=ranks.index(
  get_rank()), nranks=len(ranks))``), so NCCL's root is a communicator rank. With
  ``comm=None`` the communicator is the whole job and the two numberings agree.
* with ``group=``, ``src``, ``dst`` (and the peers of :func:`start_neighbor_exchange`)
  are **global** ranks, as in ``torch.distributed`` and as this project's internal
  callers have always passed them.

A process that is not a member of the communicator returns at once and does
nothing, as in Bagua (``None``, or a completed :class:`CommHandle` under
``async_op=True``).

Asynchronous use
----------------
``async_op=True`` (keyword only) makes a collective return a :class:`CommHandle` at
once; its ``wait()`` blocks until the communication is done and then finishes what
the backend cannot do itself (gloo has no AVG here: the sum is divided on
completion; unpacking the receive buffer of ``alltoall_v`` with displacements; ...).
The tensors must not be touched before ``wait()``.

Groups are created collectively
-------------------------------
As in torch, :func:`new_group` must be called by every process of the job, in the
same order. The intra-/inter-node subgroups of a group are created lazily, all of
them at once in a fixed order, the first time any node communicator of that group
is asked for (or :func:`intra_node_group` / :func:`inter_node_group` /
:func:`hierarchical_allreduce_inplace` for the default group): that first call must
also be made by every process of the job. Every group created here carries the
timeout given to :func:`init_process_group`, so a silent peer becomes an error
after that timeout instead of a hang.

Bytes on the wire
-----------------
:func:`bytes_sent` is a per-process counter of the bytes this worker hands to
collectives and point-to-point sends (``reset_bytes_sent()`` sets it to 0). It is
thread-safe (ops run on the communication thread) and counts, when a call is posted
by a member of its communicator, the bytes of

* ``allreduce`` / ``allreduce_inplace``: the tensor (what a worker contributes, the
  same whatever algorithm the backend uses underneath);
* ``hierarchical_allreduce_inplace``: the tensor once per level that has more than
  one member (within the node, then across nodes);
* ``broadcast``: the tensor on the source, 0 elsewhere;
* ``reduce`` / ``reduce_inplace``: the tensor on every member but the destination;
* ``allgather`` / ``allgather_inplace``: this member's own contribution (one chunk);
* ``gather`` / ``gather_inplace``: this member's chunk on every member but the
  destination; ``scatter`` / ``scatter_inplace``: on the source, the chunks for the
  other members;
* ``reduce_scatter`` / ``reduce_scatter_inplace``, ``alltoall`` /
  ``alltoall_inplace``, ``alltoall_v`` / ``alltoall_v_inplace``: the chunks addressed
  to the *other* members (the own chunk never leaves the process);
* ``send``, ``start_neighbor_exchange`` / ``neighbor_exchange``: each tensor sent to
  another rank (a pair with this process's own rank is a local copy: 0);
* ``barrier``, ``all_gather_object``, receives: 0.
"""

from __future__ import annotations

import atexit
import enum
import numbers
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    # Bagua's communication module
    "ReduceOp",
    "BaguaProcessGroup",
    "BaguaCommunicator",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "new_group",
    "from_torch_group",
    "send",
    "recv",
    "broadcast",
    "reduce",
    "reduce_inplace",
    "allreduce",
    "allreduce_inplace",
    "allgather",
    "allgather_inplace",
    "gather",
    "gather_inplace",
    "scatter",
    "scatter_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    # Bagua's env module
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    # this project's extras
    "CommHandle",
    "all_gather_object",
    "get_backend",
    "group_rank",
    "group_ranks",
    "intra_node_group",
    "inter_node_group",
    "hierarchical_allreduce_inplace",
    "neighbor_exchange",
    "start_neighbor_exchange",
    "bytes_sent",
    "reset_bytes_sent",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)


# ------------------------------------------------------------------ bytes on the wire

_sent = {"bytes": 0, "lock": threading.Lock()}


def _count(nbytes: int) -> None:
    """Add ``nbytes`` to this process's counter of bytes handed to the network."""
    with _sent["lock"]:
        _sent["bytes"] += int(nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bytes_sent() -> int:
    """Bytes this process has handed to collectives and sends since the last
    :func:`reset_bytes_sent` (what is counted: see the module's docstring)."""
    with _sent["lock"]:
        return _sent["bytes"]


def reset_bytes_sent() -> int:
    """Set the counter to 0; returns the count it had."""
    with _sent["lock"]:
        value, _sent["bytes"] = _sent["bytes"], 0
        return value


# torch 2.14 renamed the *_tensor collectives to *_single (and warns on the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceOp(enum.IntEnum):
    """Reduction operators, numbered as in Bagua."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_BITWISE_OPS = (ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR)


class CommHandle:
    """A pending communication; ``wait()`` blocks until it is done and runs the finishers.

    Finishers are callables run once, in order, in the thread that calls ``wait()``,
    after every underlying work completed (e.g. dividing a sum by the group size to
    emulate AVG). A failed work raises from ``wait()`` and the finishers do not run.
    """

    def __init__(self, works=(), finishers=()):
        self._works = [w for w in works if w is not None]
        self._finishers = list(finishers)
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        for finish in self._finishers:
            finish()
        self._done = True

    def then(self, finisher) -> "CommHandle":
        """Run ``finisher()`` after the others once the communication is done."""
        if self._done:
            finisher()
        else:
            self._finishers.append(finisher)
        return self

    def is_completed(self) -> bool:
        """Whether the communication itself has finished (without waiting, and
        without running the finishers: only ``wait()`` does that)."""
        return self._done or all(w.is_completed() for w in self._works)

    @property
    def done(self) -> bool:
        """Whether ``wait()`` has returned (finishers run)."""
        return self._done


def _finish(handle: CommHandle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


# --------------------------------------------------------------------- environment


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set; start the workers with "
                "`python -m bagua_algos.launch` or torchrun, or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT yourself"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_init(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs the process group: call bagua_algos.init_process_group() first "
            "(in workers started by `python -m bagua_algos.launch` or torchrun)"
        )


def get_rank(group=None) -> int:
    """This process's rank: in the job (RANK, default 0, also before
    :func:`init_process_group`), or inside ``group`` (a communicator, a
    :class:`BaguaProcessGroup` or a torch group; -1 if not a member)."""
    if group is None:
        return dist.get_rank() if is_initialized() else _env_int("RANK", 0)
    _require_init("get_rank(group)")
    return _as_communicator(group).rank()


def get_world_size(group=None) -> int:
    """Number of processes: in the job (WORLD_SIZE, default 1, also before
    :func:`init_process_group`), or in ``group``."""
    if group is None:
        return dist.get_world_size() if is_initialized() else _env_int("WORLD_SIZE", 1)
    _require_init("get_world_size(group)")
    return _as_communicator(group).nranks()


def get_local_rank() -> int:
    """Rank among the processes of this node (LOCAL_RANK; default 0 before
    :func:`init_process_group`, which sets it to the rank when it is missing)."""
    return _env_int("LOCAL_RANK", get_rank() if is_initialized() else 0)


def get_local_size() -> int:
    """Number of processes on this node (LOCAL_WORLD_SIZE; default 1 before
    :func:`init_process_group`, which sets it to the world size when it is missing)."""
    return _env_int("LOCAL_WORLD_SIZE", get_world_size() if is_initialized() else 1)


def get_node_rank() -> int:
    """Index of this node: ``get_rank() // get_local_size()`` (nodes hold consecutive
    ranks, as under Bagua's launcher and torchrun)."""
    return get_rank() // get_local_size()


# ----------------------------------------------------------------- process groups

_state = {
    "timeout": None,  # timedelta of init_process_group, given to every group created here
    "owner": False,  # this module called dist.init_process_group
    "default": None,  # BaguaProcessGroup of the whole job
    "group_count": 0,
    "atexit": False,
}
_torch_group_comms: dict = {}  # torch ProcessGroup -> BaguaCommunicator
_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


BACKEND_ENV = "BAGUA_ALGOS_BACKEND"
BACKENDS = ("auto", "gloo", "nccl")
# NCCL carries CUDA tensors, gloo CPU tensors: one group serves both (torch's per-device
# backends), so a script's CPU flags and counters work in a GPU job, as under Bagua.
_MIXED = "cpu:gloo,cuda:nccl"


def choose_backend(backend: str | None = None, local_world_size: int | None = None) -> str:
    """The torch backend string for ``backend`` (``None``: $BAGUA_ALGOS_BACKEND, else
    ``"auto"``) on a node running ``local_world_size`` workers (default: LOCAL_WORLD_SIZE).

    - ``"gloo"``: gloo for every tensor; CUDA tensors are staged through host memory.
    - ``"nccl"``: NCCL for CUDA tensors and gloo for CPU tensors, each worker on GPU
      ``LOCAL_RANK``; needs a GPU per worker of the node.
    - ``"auto"``: ``"nccl"`` when CUDA is available, else ``"gloo"``.

    A node with more workers than GPUs is refused here, before any CUDA call, naming
    both counts and the ways out (one process per GPU could never share one NCCL
    device, and ``cuda:LOCAL_RANK`` would not exist)."""
    where = "backend"
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or "auto"
        where = f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "backend"
    if backend == _MIXED:
        backend = "nccl"
    if backend not in BACKENDS:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, BACKENDS))} (or {_MIXED!r}), got {backend!r}")
    if backend == "gloo" or (backend == "auto" and not torch.cuda.is_available()):
        return "gloo"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    workers = local_world_size if local_world_size and local_world_size > 0 else _env_int("LOCAL_WORLD_SIZE", 1)
    if workers > gpus:
        raise RuntimeError(
            f"{where}={backend!r} puts each worker on its own GPU (NCCL, device cuda:LOCAL_RANK), but this node "
            f"runs {workers} worker(s) and has {gpus} visible GPU(s). Start at most {gpus} worker(s) per node "
            f"(--nproc_per_node {max(gpus, 1)}), or run on CPU over gloo: init_process_group(backend='gloo'), "
            f"{BACKEND_ENV}=gloo, or the launcher's --backend gloo"
        )
    return _MIXED


def init_process_group(
    store: dist.Store | None = None,
    rank: int = -1,
    world_size: int = -1,
    local_world_size: int = -1,
    *,
    backend: str | None = None,
    timeout: timedelta | float | None = None,
) -> None:
    """Join the job's process group, like Bagua 0.9's
    ``init_process_group(store=None, rank=-1, world_size=-1, local_world_size=-1)``.

    Without ``store`` it rendezvous through ``env://``: RANK, WORLD_SIZE, MASTER_ADDR
    and MASTER_PORT. With ``store``, ``rank`` and ``world_size`` come from the
    arguments (or RANK / WORLD_SIZE). ``local_world_size`` (or LOCAL_WORLD_SIZE)
    sets how many consecutive ranks share a node; when neither is given all
    processes are taken to be on one node. ``backend`` (``"auto"``, ``"gloo"`` or
    ``"nccl"``; default $BAGUA_ALGOS_BACKEND, else ``"auto"``) is chosen by
    :func:`choose_backend`: with NCCL, CUDA tensors travel over NCCL, CPU tensors over
    gloo, and the current CUDA device becomes ``cuda:LOCAL_RANK``; with gloo, CUDA
    tensors are staged through host memory. ``timeout`` (a timedelta or seconds,
    default 10 minutes) bounds every wait on a peer, in this group and in every group
    created from it, so a dead or silent peer becomes an error instead of a hang.
    """
    if isinstance(store, str):  # the old positional order began with the backend
        backend, store = store, None
    if is_initialized():
        raise RuntimeError("init_process_group() was called twice in this process")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        timeout = timedelta(seconds=float(timeout))
    elif timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    rank = -1 if rank is None else int(rank)
    world_size = -1 if world_size is None else int(world_size)
    local_world_size = -1 if local_world_size is None else int(local_world_size)
    if store is None:
        rank = _env_int("RANK") if rank < 0 else rank
        world_size = _env_int("WORLD_SIZE") if world_size < 0 else world_size
        _env_int("MASTER_PORT")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    else:
        if rank < 0 and "RANK" in os.environ:
            rank = _env_int("RANK")
        if world_size < 0 and "WORLD_SIZE" in os.environ:
            world_size = _env_int("WORLD_SIZE")
        if rank < 0 or world_size < 0:
            raise ValueError("init_process_group(store=...) also needs rank= and world_size= (or RANK and WORLD_SIZE)")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}")
    if local_world_size >= 0 and not 1 <= local_world_size <= world_size:
        raise ValueError(f"local_world_size must be in [1, {world_size}], got {local_world_size}")
    if local_world_size < 0:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        if not 1 <= local_world_size <= world_size:
            raise ValueError(f"LOCAL_WORLD_SIZE must be in [1, {world_size}], got {local_world_size}")
        local_rank = _env_int("LOCAL_RANK", rank % local_world_size)
    else:
        local_rank = rank % local_world_size
    torch_backend = choose_backend(backend, local_world_size)
    if torch_backend != "gloo":
        torch.cuda.set_device(local_rank)
    kwargs = {"backend": torch_backend, "timeout": timeout, "rank": rank, "world_size": world_size}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    _state.update(timeout=timeout, owner=True, default=None, group_count=0)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    os.environ["LOCAL_RANK"] = str(local_rank)
    if not _state["atexit"]:
        atexit.register(_destroy_at_exit)
        _state["atexit"] = True


def destroy_process_group() -> None:
    """Leave the job: stop the helper thread, destroy every group (collective-free)."""
    _stop_helper()
    _torch_group_comms.clear()
    _state.update(timeout=None, owner=False, default=None, group_count=0)
    if is_initialized():
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    # A process group still alive at interpreter exit is torn down while its backend
    # threads run, which can abort the process; destroy it first (only if ours).
    if _state["owner"] and is_initialized():
        try:
            destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing useful to do at exit
            pass


def get_backend(group=None) -> str:
    """``"gloo"`` or ``"nccl"``: the backend of ``group`` (default: the job's). With
    ``"nccl"``, CUDA tensors travel over NCCL and CPU tensors over gloo."""
    _require_init("get_backend()")
    return _as_communicator(group).backend()


def _new_torch_group(ranks: Sequence[int]):
    """A torch group over ``ranks`` with the job's timeout. Collective over the job."""
    kwargs = {} if _state["timeout"] is None else {"timeout": _state["timeout"]}
    return dist.new_group(ranks=sorted(ranks), **kwargs)


class BaguaCommunicator:
    """One communicator: the processes of ``ranks`` (global ranks, sorted) over a
    torch group. ``rank()`` is this process's index in ``ranks`` (-1 for a process that
    is not a member), ``nranks()`` their number; as Bagua's ``BaguaSingleCommunicatorPy``.
    """

    def __init__(self, group, ranks: Sequence[int], name: str = ""):
        self.ranks = list(ranks)
        self.name = name
        me = get_rank()
        self._rank = self.ranks.index(me) if me in self.ranks else -1
        self._group = group if self._rank >= 0 else _NON_MEMBER
        self._backend = None

    def rank(self) -> int:
        return self._rank

    def nranks(self) -> int:
        return len(self.ranks)

    def is_member(self) -> bool:
        return self._rank >= 0

    @property
    def torch_group(self):
        """The torch group (``None`` for the whole job; NON_GROUP_MEMBER for a non-member)."""
        return self._group

    def backend(self) -> str:
        """``"nccl"`` (CUDA tensors over NCCL, CPU tensors over gloo) or ``"gloo"``."""
        if self._backend is None:
            name = str(dist.get_backend(None if self._group is _NON_MEMBER else self._group))
            self._backend = "nccl" if "nccl" in name else name
        return self._backend

    def uses_nccl(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels over NCCL (a CUDA tensor in a group that has it)."""
        return tensor.is_cuda and self.backend() == "nccl"

    def global_rank(self, rank: int, what: str = "rank") -> int:
        """The global rank of communicator rank ``rank``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.ranks):
            raise ValueError(
                f"{what}={rank!r} is not a rank of this communicator: with comm= it is a rank inside "
                f"the communicator, 0..{len(self.ranks) - 1} (its global ranks are {self.ranks})"
            )
        return self.ranks[rank]

    def __repr__(self) -> str:
        return f"BaguaCommunicator({self.name or 'group'}, ranks={self.ranks}, rank={self._rank})"


class BaguaProcessGroup:
    """A process group as Bagua's ``new_group()`` returns it.

    ``ranks`` are its global ranks (sorted). ``get_global_communicator()`` spans them;
    ``get_intra_node_communicator()`` the members on this process's node;
    ``get_inter_node_communicator()`` the members whose local rank equals that of
    ``ranks[0]`` (one per node, the node leaders; other processes are not members),
    as in Bagua. The node communicators are created on first use, collectively (see
    the module's documentation).
    """

    def __init__(self, ranks: Sequence[int], torch_group, group_name: str, stream=None):
        self.ranks = list(ranks)
        self.stream = stream  # accepted for Bagua's signature; torch picks its own streams
        self.group_name = group_name
        local, me = get_local_size(), get_rank()
        self.intra_ranks = [r for r in self.ranks if r // local == me // local]
        self.inter_ranks = [r for r in self.ranks if r % local == self.ranks[0] % local] if self.ranks else []
        self._global = BaguaCommunicator(torch_group, self.ranks, f"{group_name}/global")
        self._node = None  # built by _node_groups()

    @property
    def torch_group(self):
        return self._global.torch_group

    def rank(self) -> int:
        """This process's rank in the group (-1 if not a member)."""
        return self._global.rank()

    def size(self) -> int:
        return len(self.ranks)

    def get_global_communicator(self) -> BaguaCommunicator:
        return self._global

    def get_intra_node_communicator(self) -> BaguaCommunicator:
        return self._node_groups()["intra"]

    def get_inter_node_communicator(self) -> BaguaCommunicator:
        return self._node_groups()["inter"]

    def _node_groups(self) -> dict:
        """Create every node subgroup of this group: each node's members, then the
        members of each local rank, in that order, on every process of the job."""
        if self._node is not None:
            return self._node
        _require_init("node communicators")
        world, local, me = get_world_size(), get_local_size(), get_rank()
        if world % local:
            raise RuntimeError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")

        def group_of(members):
            # Same choice on every process: the members are the same everywhere.
            return self._global.torch_group if members == self.ranks else _new_torch_group(members)

        node = {"intra": BaguaCommunicator(_NON_MEMBER, self.intra_ranks, f"{self.group_name}/intra"),
                "by_local_rank": {}}
        for n in range(world // local):
            members = [r for r in self.ranks if r // local == n]
            if members:
                g = group_of(members)
                if me in members:
                    node["intra"] = BaguaCommunicator(g, members, f"{self.group_name}/intra{n}")
        for lr in range(local):
            members = [r for r in self.ranks if r % local == lr]
            if members:
                node["by_local_rank"][lr] = BaguaCommunicator(group_of(members), members, f"{self.group_name}/inter{lr}")
        leader_local = self.ranks[0] % local if self.ranks else 0
        node["inter"] = node["by_local_rank"].get(
            leader_local, BaguaCommunicator(_NON_MEMBER, [], f"{self.group_name}/inter"))
        self._node = node
        return node

    def __repr__(self) -> str:
        return f"BaguaProcessGroup({self.group_name}, ranks={self.ranks})"


def _get_default_group() -> BaguaProcessGroup:
    """The :class:`BaguaProcessGroup` of the whole job."""
    if not is_initialized():
        raise RuntimeError("Default process group has not been initialized, please make sure to call init_process_group.")
    if _state["default"] is None:
        _state["default"] = BaguaProcessGroup(list(range(dist.get_world_size())), None, "default")
    return _state["default"]


def new_group(ranks: Sequence[int] | None = None, stream=None, *, timeout: timedelta | None = None) -> BaguaProcessGroup:
    """A :class:`BaguaProcessGroup` over ``ranks`` (global ranks; all by default).

    Every process of the job must call it, in the same order, also those that are not
    members. ``stream`` is accepted for Bagua's signature and ignored. The group's
    torch group carries the timeout of :func:`init_process_group` (or ``timeout``).
    """
    _require_init("new_group()")
    world = get_world_size()
    if ranks is None:
        ranks = list(range(world))
    else:
        ranks = list(ranks)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world:
                raise ValueError(f"new_group(ranks=...): invalid rank {r!r}, ranks must be in [0, {world})")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group(ranks=...): duplicate ranks in {ranks}")
        if not ranks:
            raise ValueError("new_group(ranks=...): ranks is empty")
        ranks = sorted(ranks)
    kwargs = {}
    if timeout is not None or _state["timeout"] is not None:
        kwargs["timeout"] = timeout if timeout is not None else _state["timeout"]
    torch_group = dist.new_group(ranks=ranks, **kwargs)
    _state["group_count"] += 1
    return BaguaProcessGroup(ranks, torch_group, str(_state["group_count"]), stream)


def from_torch_group(group, stream=None) -> BaguaProcessGroup:
    """The :class:`BaguaProcessGroup` of a torch process group (of which this process
    is a member); it communicates over ``group`` itself."""
    _require_init("from_torch_group()")
    if group is None:
        return _get_default_group()
    if group is _NON_MEMBER or not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"from_torch_group() needs a torch ProcessGroup this process is a member of, got {group!r}")
    _state["group_count"] += 1
    return BaguaProcessGroup(dist.get_process_group_ranks(group), group, f"torch{_state['group_count']}", stream)


def _as_communicator(x) -> BaguaCommunicator:
    if x is None:
        return _get_default_group().get_global_communicator()
    if isinstance(x, BaguaCommunicator):
        return x
    if isinstance(x, BaguaProcessGroup):
        return x.get_global_communicator()
    if isinstance(x, int) and x == _NON_MEMBER:
        return BaguaCommunicator(_NON_MEMBER, [], "non-member")
    if isinstance(x, dist.ProcessGroup):
        c = _torch_group_comms.get(x)
        if c is None:
            c = _torch_group_comms[x] = BaguaCommunicator(x, dist.get_process_group_ranks(x), "torch")
        return c
    raise TypeError(
        "comm/group must be a communicator, a BaguaProcessGroup, a torch.distributed ProcessGroup "
        f"or None, got {type(x).__name__}"
    )


def group_rank(group) -> int:
    """This process's rank inside ``group``, or -1 if it is not a member."""
    _require_init("group_rank()")
    return _as_communicator(group).rank()


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    _require_init("group_ranks()")
    return list(_as_communicator(group).ranks)


def intra_node_group() -> BaguaCommunicator:
    """The processes on this node (consecutive global ranks, LOCAL_WORLD_SIZE of them)."""
    _require_init("intra_node_group()")
    return _get_default_group()._node_groups()["intra"]


def inter_node_group() -> BaguaCommunicator:
    """The processes with this process's local rank, one on each node."""
    _require_init("inter_node_group()")
    return _get_default_group()._node_groups()["by_local_rank"][get_rank() % get_local_size()]


# ------------------------------------------------------------------------- checks


def _target(comm, group, what: str) -> tuple[BaguaCommunicator, bool]:
    """(communicator, whether rank arguments are ranks inside it)."""
    _require_init(f"{what}()")
    if comm is not None and group is not None:
        raise ValueError(f"{what}(): pass comm= or group=, not both")
    if group is not None:
        return _as_communicator(group), False
    return _as_communicator(comm), True


def _peer(c: BaguaCommunicator, local: bool, rank, what: str) -> int:
    """The global rank meant by rank argument ``what``."""
    if local:
        return c.global_rank(rank, what)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank not in c.ranks:
        raise ValueError(
            f"{what}={rank!r} is not a member of the group: with group= it is a global rank, one of {c.ranks}"
        )
    return rank


def _check_tensor(name: str, t, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it), got strides {t.stride()}")


def _check_same_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{b_name} has dtype {b.dtype} but {a_name} has dtype {a.dtype}; they must match")


def _reduce_op(op, tensor: torch.Tensor) -> ReduceOp:
    names = ", ".join(f"ReduceOp.{o.name}" for o in ReduceOp)
    if isinstance(op, ReduceOp):
        pass
    elif isinstance(op, int) and not isinstance(op, bool):
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(f"op must be one of {names}, got {op!r}") from None
    elif getattr(op, "name", None) in ReduceOp.__members__:  # torch.distributed.ReduceOp.X
        op = ReduceOp[op.name]
    else:
        raise ValueError(f"op must be one of {names}, got {op!r}")
    if op in _BITWISE_OPS and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op=ReduceOp.{op.name} needs an integer or bool tensor, got dtype {tensor.dtype}")
    return op


def _op_and_finish(op: ReduceOp, c: BaguaCommunicator, out: torch.Tensor):
    """The torch op to run and the finishers that complete ``op`` on ``out``."""
    if op != ReduceOp.AVG:
        return _TORCH_OPS[op], []
    if c.uses_nccl(out) and (out.is_floating_point() or out.is_complex()):
        return dist.ReduceOp.AVG, []  # NCCL's own; its integer AVG truncates, Bagua's floors
    return dist.ReduceOp.SUM, [_divider(out, c.nranks())]


def _divider(t: torch.Tensor, size: int):
    if t.is_floating_point() or t.is_complex():
        return lambda: t.div_(size)
    return lambda: t.div_(size, rounding_mode="floor")


def _counts(name: str, value, n: int, total: int | None = None) -> list[int]:
    """``value`` (a sequence, tensor or NumPy array of non-negative integers, one per
    rank) as a list. Displacements pass ``total`` = the sum of their counts: like Bagua,
    they may then also have n + 1 entries, the last being that total (the offsets of an
    MPI-style prefix sum); it is dropped."""
    if hasattr(value, "tolist"):  # torch.Tensor, numpy.ndarray
        value = value.tolist()
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of {n} non-negative integers (one per rank), got {value!r}") from None
    out = []
    for i, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer, got {v!r}")
        out.append(int(v))
    if total is not None and len(out) == n + 1:
        if out[n] != total:
            raise ValueError(
                f"{name} has {n + 1} entries, so its last must be the total of the counts ({total}) as in "
                f"Bagua's prefix-sum form, got {out[n]}; or give {n} entries, one per rank"
            )
        out = out[:n]
    if len(out) != n:
        extra = f" (or {n + 1}, the last being the total of the counts)" if total is not None else ""
        raise ValueError(f"{name} must have one entry per rank of the communicator ({n}){extra}, got {len(out)}")
    return out


def _regions(counts_name: str, counts: list[int], displs_name: str, displs: list[int], tensor_name: str, numel: int,
             disjoint: bool) -> bool:
    """Check that the regions fit in the tensor; True if they are packed in rank order from 0."""
    for i, (c, d) in enumerate(zip(counts, displs)):
        if d + c > numel:
            raise ValueError(
                f"{displs_name}[{i}] + {counts_name}[{i}] = {d} + {c} = {d + c} exceeds {tensor_name}.numel() = {numel}"
            )
    if disjoint:
        spans = sorted((d, d + c, i) for i, (c, d) in enumerate(zip(counts, displs)) if c)
        for (s0, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ValueError(
                    f"{tensor_name} regions of ranks {i0} and {i1} overlap ({displs_name}, {counts_name}); "
                    "every rank's region must be distinct"
                )
    offset = 0
    for c, d in zip(counts, displs):
        if c and d != offset:
            return False
        offset += c
    return True


# -------------------------------------------------------------------- collectives


def _skip(async_op: bool):
    return CommHandle() if async_op else None


class _Staging:
    """Host copies of the CUDA tensors of one gloo call.

    gloo's point-to-point and most of its collectives cannot read device memory (handed
    a CUDA pointer, its socket writes abort the process), so a CUDA tensor that does not
    travel over NCCL is copied to host memory before the call and, if the call writes
    it, copied back when the handle completes, before any other finisher runs. Tensors
    on NCCL or on the CPU are used as they are (no copy). ``force`` stages every CUDA
    tensor (a call that mixes devices is posted on gloo alone)."""

    def __init__(self, c: BaguaCommunicator, force: bool = False):
        self._c = c
        self._force = force
        self._copy_back = []

    def needs_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` must go through host memory for this call."""
        return t.is_cuda and (self._force or not self._c.uses_nccl(t))

    def __call__(self, t: torch.Tensor, *, read: bool = True, write: bool = False) -> torch.Tensor:
        """``t`` itself, or its host copy (holding ``t``'s values if ``read``; copied
        back into ``t`` on completion if ``write``)."""
        if not self.needs_host(t):
            return t
        host = t.detach().to("cpu", copy=True) if read else torch.empty(t.shape, dtype=t.dtype)
        if write:
            self._copy_back.append(lambda: t.copy_(host))
        return host

    def handle(self, works, finishers=()) -> CommHandle:
        return CommHandle(works, self._copy_back + list(finishers))


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                      async_op: bool = False):
    """``tensor`` ← reduction over the communicator of every member's ``tensor``."""
    c, _ = _target(comm, group, "allreduce_inplace")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    op = _reduce_op(op, tensor)
    torch_op, finishers = _op_and_finish(op, c, tensor)
    _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.all_reduce(st(tensor, write=True), op=torch_op, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *,
              group=None, async_op: bool = False):
    """``recv_tensor`` ← reduction of every member's ``send_tensor``; ``send_tensor`` is kept."""
    c, _ = _target(comm, group, "allreduce")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    if recv_tensor.shape != send_tensor.shape:
        raise ValueError(
            f"recv_tensor shape {tuple(recv_tensor.shape)} differs from send_tensor shape {tuple(send_tensor.shape)}"
        )
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    op = _reduce_op(op, send_tensor)
    if recv_tensor.data_ptr() != send_tensor.data_ptr():
        recv_tensor.copy_(send_tensor)
    return allreduce_inplace(recv_tensor, op, group=c, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, comm=None, *, group=None, async_op: bool = False):
    """Every member's ``tensor`` ← ``tensor`` of rank ``src`` (see the module's note on ranks)."""
    c, local = _target(comm, group, "broadcast")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    src = _peer(c, local, src, "src")
    if get_rank() == src:
        _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.broadcast(st(tensor, write=get_rank() != src), src=src, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def reduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm=None,
           *, group=None, async_op: bool = False):
    """``recv_tensor`` of rank ``dst`` ← reduction of every member's ``send_tensor``.
    ``send_tensor`` is kept everywhere; other members' ``recv_tensor`` is untouched."""
    c, local = _target(comm, group, "reduce")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    if recv_tensor.numel() != send_tensor.numel():
        raise ValueError(
            f"recv_tensor must have as many elements as send_tensor ({send_tensor.numel()}), got {recv_tensor.numel()}"
        )
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    op = _reduce_op(op, send_tensor)
    dst = _peer(c, local, dst, "dst")
    if get_rank() == dst:
        buffer = recv_tensor
        if recv_tensor.data_ptr() != send_tensor.data_ptr():
            recv_tensor.view(-1).copy_(send_tensor.reshape(-1))
    else:
        buffer = send_tensor.detach().clone(memory_format=torch.contiguous_format)
    return _reduce_into(buffer, dst, op, c, async_op)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                   async_op: bool = False):
    """``tensor`` of rank ``dst`` ← reduction of every member's ``tensor``; the other
    members' ``tensor`` is left unchanged."""
    c, local = _target(comm, group, "reduce_inplace")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    op = _reduce_op(op, tensor)
    dst = _peer(c, local, dst, "dst")
    # gloo writes partial sums into the buffers of other members: they reduce a copy.
    buffer = tensor if get_rank() == dst or c.uses_nccl(tensor) else tensor.clone()
    return _reduce_into(buffer, dst, op, c, async_op)


def _reduce_into(buffer: torch.Tensor, dst: int, op: ReduceOp, c: BaguaCommunicator, async_op: bool):
    torch_op, finishers = _op_and_finish(op, c, buffer)
    if get_rank() != dst:
        finishers = []
        _count(_nbytes(buffer))
    st = _Staging(c)
    work = dist.reduce(st(buffer, write=get_rank() == dst), dst=dst, op=torch_op, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """``recv_tensor`` (nranks × ``send_tensor.numel()`` elements) ← every member's
    ``send_tensor``, in communicator-rank order."""
    c, _ = _target(comm, group, "allgather")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    n = c.nranks()
    if recv_tensor.numel() != n * send_tensor.numel():
        raise ValueError(
            f"recv_tensor must have nranks x send_tensor.numel() = {n} x {send_tensor.numel()} = "
            f"{n * send_tensor.numel()} elements for allgather, got {recv_tensor.numel()}"
        )
    _count(_nbytes(send_tensor))
    st = _Staging(c)
    work = _all_gather_single(st(recv_tensor.view(-1), read=False, write=True),
                              st(send_tensor.reshape(-1).contiguous()), group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def allgather_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`allgather`: ``tensor`` holds nranks equal chunks; each member's
    chunk at its rank is its input, and all chunks are the output."""
    c, _ = _target(comm, group, "allgather_inplace")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    n = c.nranks()
    if n and tensor.numel() % n:
        raise ValueError(f"tensor.numel() = {tensor.numel()} must be divisible by the number of ranks ({n})")
    flat = tensor.view(-1)
    count = flat.numel() // n
    mine = flat[c.rank() * count:(c.rank() + 1) * count].clone()
    _count(_nbytes(mine))
    st = _Staging(c)
    work = _all_gather_single(st(flat, read=False, write=True), st(mine), group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm=None, *, group=None,
           async_op: bool = False):
    """``recv_tensor`` of rank ``dst`` (nranks × ``send_tensor.numel()`` elements) ←
    every member's ``send_tensor``, in communicator-rank order; ``recv_tensor`` of the
    other members is not used."""
    c, local = _target(comm, group, "gather")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    dst = _peer(c, local, dst, "dst")
    n = c.nranks()
    at_dst = get_rank() == dst
    if at_dst:
        _check_tensor("recv_tensor", recv_tensor)
        _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
        if recv_tensor.numel() != n * send_tensor.numel():
            raise ValueError(
                f"recv_tensor must have nranks x send_tensor.numel() = {n} x {send_tensor.numel()} = "
                f"{n * send_tensor.numel()} elements on the dst rank, got {recv_tensor.numel()}"
            )
    st = _Staging(c)
    chunks = list(st(recv_tensor.view(n, -1), read=False, write=True).unbind(0)) if at_dst else None
    if not at_dst:
        _count(_nbytes(send_tensor))
    work = dist.gather(st(send_tensor.reshape(-1).contiguous()), chunks, dst=dst, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def _rooted_inplace(c: BaguaCommunicator, local: bool, tensor: torch.Tensor, count, root, root_name: str):
    """Checks of an in-place gather/scatter: ``tensor`` holds nranks × ``count``
    elements on the root and ``count`` elsewhere. Returns (global root, nranks,
    whether this is the root, ``tensor`` as 1-D)."""
    _check_tensor("tensor", tensor)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got {count!r}")
    root = _peer(c, local, root, root_name)
    n = c.nranks()
    at_root = get_rank() == root
    need = n * count if at_root else count
    if tensor.numel() != need:
        where = f"nranks x count = {n} x {count}" if at_root else "count"
        raise ValueError(f"tensor must have {where} = {need} elements on this rank, got {tensor.numel()}")
    return root, n, at_root, tensor.view(-1)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`gather`: on rank ``dst`` ``tensor`` has nranks × ``count``
    elements, its own input being chunk ``dst``; elsewhere it has ``count`` elements."""
    c, local = _target(comm, group, "gather_inplace")
    if not c.is_member():
        return _skip(async_op)
    dst, n, at_dst, flat = _rooted_inplace(c, local, tensor, count, dst, "dst")
    st = _Staging(c)
    if at_dst:
        me = c.rank()
        send = flat[me * count:(me + 1) * count].clone()
        chunks = list(st(flat.view(n, count), read=False, write=True).unbind(0))
    else:
        send, chunks = flat, None
        _count(_nbytes(send))
    work = dist.gather(st(send), chunks, dst=dst, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm=None, *, group=None,
            async_op: bool = False):
    """Each member's ``recv_tensor`` ← its chunk (by communicator rank) of rank
    ``src``'s ``send_tensor`` (nranks × ``recv_tensor.numel()`` elements; not used on
    the other members)."""
    c, local = _target(comm, group, "scatter")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("recv_tensor", recv_tensor)
    src = _peer(c, local, src, "src")
    n = c.nranks()
    at_src = get_rank() == src
    if at_src:
        _check_tensor("send_tensor", send_tensor, contiguous=False)
        _check_same_dtype("recv_tensor", recv_tensor, "send_tensor", send_tensor)
        if send_tensor.numel() != n * recv_tensor.numel():
            raise ValueError(
                f"send_tensor must have nranks x recv_tensor.numel() = {n} x {recv_tensor.numel()} = "
                f"{n * recv_tensor.numel()} elements on the src rank, got {send_tensor.numel()}"
            )
    st = _Staging(c)
    chunks = list(st(send_tensor.reshape(n, -1).contiguous()).unbind(0)) if at_src else None
    if at_src:
        _count(_nbytes(recv_tensor) * (n - 1))
    work = dist.scatter(st(recv_tensor.view(-1), read=False, write=True), chunks, src=src, group=c.torch_group,
                        async_op=True)
    return _finish(st.handle([work]), async_op)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`scatter`: on rank ``src`` ``tensor`` has nranks × ``count``
    elements (its own share, chunk ``src``, stays in place); elsewhere it has ``count``
    elements and receives this member's chunk."""
    c, local = _target(comm, group, "scatter_inplace")
    if not c.is_member():
        return _skip(async_op)
    src, n, at_src, flat = _rooted_inplace(c, local, tensor, count, src, "src")
    st = _Staging(c)
    if at_src:  # its own chunk comes back into a scratch buffer: the share stays in place
        out, chunks = st(torch.empty_like(flat[:count]), read=False), list(st(flat.view(n, count)).unbind(0))
        _count(_nbytes(out) * (n - 1))
    else:
        out, chunks = st(flat, read=False, write=True), None
    work = dist.scatter(out, chunks, src=src, group=c.torch_group, async_op=True)
    return _finish(st.handle([work]), async_op)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *,
                   group=None, async_op: bool = False):
    """Member k's ``recv_tensor`` ← reduction of chunk k of every member's
    ``send_tensor`` (nranks × ``recv_tensor.numel()`` elements)."""
    c, _ = _target(comm, group, "reduce_scatter")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    n = c.nranks()
    if send_tensor.numel() != n * recv_tensor.numel():
        raise ValueError(
            f"send_tensor must have nranks x recv_tensor.numel() = {n} x {recv_tensor.numel()} = "
            f"{n * recv_tensor.numel()} elements for reduce_scatter, got {send_tensor.numel()}"
        )
    op = _reduce_op(op, send_tensor)
    torch_op, finishers = _op_and_finish(op, c, recv_tensor)
    _count(_nbytes(recv_tensor) * (n - 1))
    st = _Staging(c)
    work = _reduce_scatter_single(st(recv_tensor.view(-1), read=False, write=True),
                                  st(send_tensor.reshape(-1).contiguous()), op=torch_op, group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm=None, *, group=None,
                           async_op: bool = False):
    """In-place :func:`reduce_scatter`: ``tensor`` holds nranks equal chunks; afterwards
    member k's chunk k holds the reduction of every member's chunk k (the other chunks
    are left unchanged)."""
    c, _ = _target(comm, group, "reduce_scatter_inplace")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    n = c.nranks()
    if n and tensor.numel() % n:
        raise ValueError(f"tensor.numel() = {tensor.numel()} must be divisible by the number of ranks ({n})")
    op = _reduce_op(op, tensor)
    flat = tensor.view(-1)
    count = flat.numel() // n
    out = torch.empty_like(flat[:count])
    torch_op, finishers = _op_and_finish(op, c, out)
    mine = flat[c.rank() * count:(c.rank() + 1) * count]
    _count(_nbytes(out) * (n - 1))
    st = _Staging(c)
    work = _reduce_scatter_single(st(out, read=False, write=True), st(flat), op=torch_op, group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work], finishers + [lambda: mine.copy_(out)]), async_op)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """Chunk j of member i's ``send_tensor`` → chunk i of member j's ``recv_tensor``
    (both of nranks equal chunks)."""
    c, _ = _target(comm, group, "alltoall")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    n = c.nranks()
    if n and send_tensor.numel() % n:
        raise ValueError(f"send_tensor.numel() = {send_tensor.numel()} must be divisible by the number of ranks ({n})")
    if recv_tensor.numel() != send_tensor.numel():
        raise ValueError(
            f"recv_tensor must have as many elements as send_tensor ({send_tensor.numel()}), got {recv_tensor.numel()}"
        )
    send = send_tensor.reshape(-1)
    if send.data_ptr() == recv_tensor.data_ptr() or not send.is_contiguous():
        send = send.clone()
    if n:
        _count(_nbytes(send) // n * (n - 1))
    st = _Staging(c)
    work = dist.all_to_all_single(st(recv_tensor.view(-1), read=False, write=True), st(send), group=c.torch_group,
                                  async_op=True)
    return _finish(st.handle([work]), async_op)


def alltoall_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`alltoall`."""
    return alltoall(tensor, tensor, comm, group=group, async_op=async_op)


def alltoall_v(send_tensor: torch.Tensor, send_counts, send_displs, recv_tensor: torch.Tensor, recv_counts,
               recv_displs, comm=None, *, group=None, async_op: bool = False):
    """All-to-all with a count and a displacement per rank (as MPI_Alltoallv).

    Member i sends the ``send_counts[j]`` elements of ``send_tensor`` (flattened) from
    offset ``send_displs[j]`` to member j (j a communicator rank), which stores them
    at offset ``recv_displs[i]`` of its ``recv_tensor``, where ``recv_counts[i]`` must
    equal member i's ``send_counts[j]`` (that pairing is not checked across ranks).
    Elements of ``recv_tensor`` outside the receive regions are left unchanged.
    """
    c, _ = _target(comm, group, "alltoall_v")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("send_tensor", send_tensor, contiguous=False)
    _check_tensor("recv_tensor", recv_tensor)
    _check_same_dtype("send_tensor", send_tensor, "recv_tensor", recv_tensor)
    n = c.nranks()
    send_counts = _counts("send_counts", send_counts, n)
    send_displs = _counts("send_displs", send_displs, n, sum(send_counts))
    recv_counts = _counts("recv_counts", recv_counts, n)
    recv_displs = _counts("recv_displs", recv_displs, n, sum(recv_counts))
    send_packed = _regions("send_counts", send_counts, "send_displs", send_displs, "send_tensor",
                           send_tensor.numel(), disjoint=False)
    recv_packed = _regions("recv_counts", recv_counts, "recv_displs", recv_displs, "recv_tensor",
                           recv_tensor.numel(), disjoint=True)
    return _alltoall_v(send_tensor.reshape(-1), send_counts, send_displs, send_packed, recv_tensor.view(-1),
                       recv_counts, recv_displs, recv_packed, c, async_op)


def alltoall_v_inplace(tensor: torch.Tensor, counts, displs, comm=None, *, group=None, async_op: bool = False):
    """In-place :func:`alltoall_v`: the region ``displs[j]``, ``counts[j]`` of ``tensor``
    is sent to member j and replaced by what member j sends (so member j's
    ``counts[i]`` must equal this member's ``counts[j]``)."""
    c, _ = _target(comm, group, "alltoall_v_inplace")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    n = c.nranks()
    counts = _counts("counts", counts, n)
    displs = _counts("displs", displs, n, sum(counts))
    packed = _regions("counts", counts, "displs", displs, "tensor", tensor.numel(), disjoint=True)
    flat = tensor.view(-1)
    return _alltoall_v(flat, counts, displs, packed, flat, counts, displs, packed, c, async_op, copy_send=True)


def _alltoall_v(send, send_counts, send_displs, send_packed, recv, recv_counts, recv_displs, recv_packed,
                c: BaguaCommunicator, async_op: bool, copy_send: bool = False):
    if send_packed:
        send_buf = send[:sum(send_counts)]
        if copy_send or not send_buf.is_contiguous() or send_buf.data_ptr() == recv.data_ptr():
            send_buf = send_buf.clone()
    else:
        send_buf = torch.cat([send[d:d + k] for k, d in zip(send_counts, send_displs)])
    finishers = []
    if recv_packed:
        recv_buf = recv[:sum(recv_counts)]
    else:
        recv_buf = torch.empty(sum(recv_counts), dtype=recv.dtype, device=recv.device)

        def unpack():
            offset = 0
            for k, d in zip(recv_counts, recv_displs):
                recv[d:d + k].copy_(recv_buf[offset:offset + k])
                offset += k

        finishers.append(unpack)
    me = c.rank()
    _count(sum(k for j, k in enumerate(send_counts) if j != me) * send_buf.element_size())
    st = _Staging(c)
    work = dist.all_to_all_single(st(recv_buf, read=False, write=True), st(send_buf), output_split_sizes=recv_counts,
                                  input_split_sizes=send_counts, group=c.torch_group, async_op=True)
    return _finish(st.handle([work], finishers), async_op)


def barrier(comm=None, *, group=None, async_op: bool = False):
    """Block until every member of the communicator has entered ``barrier``."""
    c, _ = _target(comm, group, "barrier")
    if not c.is_member():
        return _skip(async_op)
    work = dist.barrier(group=c.torch_group, async_op=True)
    return _finish(CommHandle([work]), async_op)


def send(tensor: torch.Tensor, dst: int, comm=None, *, group=None, async_op: bool = False):
    """Send ``tensor`` to rank ``dst`` (blocking unless ``async_op``)."""
    c, local = _target(comm, group, "send")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    dst = _peer(c, local, dst, "dst")
    if dst == get_rank():
        raise ValueError(f"dst={dst} is this process's own rank; send to another rank")
    _count(_nbytes(tensor))
    st = _Staging(c)
    work = dist.isend(st(tensor), dst=dst, group=c.torch_group)
    return _finish(st.handle([work]), async_op)


def recv(tensor: torch.Tensor, src: int, comm=None, *, group=None, async_op: bool = False):
    """Receive ``tensor`` from rank ``src`` (blocking unless ``async_op``)."""
    c, local = _target(comm, group, "recv")
    if not c.is_member():
        return _skip(async_op)
    _check_tensor("tensor", tensor)
    src = _peer(c, local, src, "src")
    if src == get_rank():
        raise ValueError(f"src={src} is this process's own rank; receive from another rank")
    st = _Staging(c)
    work = dist.irecv(st(tensor, read=False, write=True), src=src, group=c.torch_group)
    return _finish(st.handle([work]), async_op)


# -------------------------------------------------------------- two-level allreduce


class _Job:
    """A function run on the helper thread; ``wait()`` re-raises its exception."""

    def __init__(self, fn):
        self._fn = fn
        self._event = threading.Event()
        self._error = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        finally:
            self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._event.is_set()


_helper = {"thread": None, "queue": None, "lock": threading.Lock()}


def _submit(fn) -> _Job:
    """Run ``fn`` on the helper thread, after every job submitted before it."""
    job = _Job(fn)
    with _helper["lock"]:
        if _helper["thread"] is None:
            q = queue.SimpleQueue()

            def loop():
                while True:
                    item = q.get()
                    if item is None:
                        return
                    item.run()

            thread = threading.Thread(target=loop, name="bagua-algos-comm", daemon=True)
            thread.start()
            _helper.update(thread=thread, queue=q)
        _helper["queue"].put(job)
    return job


def _stop_helper() -> None:
    with _helper["lock"]:
        thread, q = _helper["thread"], _helper["queue"]
        _helper.update(thread=None, queue=None)
    if thread is not None:
        q.put(None)
        timeout = _state["timeout"] or DEFAULT_TIMEOUT
        thread.join(timeout.total_seconds() + 5)


def _hierarchical_groups() -> dict:
    """The default group's node communicators and, for the helper thread alone, a
    private copy of the inter-node groups (created collectively on first use)."""
    default = _get_default_group()
    node = default._node_groups()
    if "private_inter" not in node:
        local, me = get_local_size(), get_rank()
        if local == 1 or local == get_world_size():
            # One level is trivial; the other is posted from the caller's thread only.
            node["private_inter"] = node["by_local_rank"][me % local]
        else:
            for lr in range(local):
                g = _new_torch_group(range(lr, get_world_size(), local))
                if lr == me % local:
                    node["private_inter"] = BaguaCommunicator(g, range(lr, get_world_size(), local),
                                                              f"default/hierarchical-inter{lr}")
    return node


def hierarchical_allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False):
    """Allreduce over all workers in two levels: within each node, then across nodes
    between processes of equal local rank (each then holds the global result).

    Only SUM and AVG (a sum divided by the world size) are two-level reductions here.
    With ``async_op=True`` it returns at once: the intra-node allreduce is posted here
    and, on gloo, a helper thread posts the inter-node one (on groups of its own, in
    submission order) when the first completes; on NCCL both are posted here, ordered
    by CUDA streams.
    """
    _require_init("hierarchical_allreduce_inplace()")
    _check_tensor("tensor", tensor)
    op = _reduce_op(op, tensor)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"hierarchical allreduce supports ReduceOp.SUM and ReduceOp.AVG, got ReduceOp.{op.name}")
    node = _hierarchical_groups()
    intra, inter = node["intra"], node["private_inter"]
    finishers = [_divider(tensor, get_world_size())] if op == ReduceOp.AVG else []
    _count(_nbytes(tensor) * ((intra.nranks() > 1) + (inter.nranks() > 1)))
    st = _Staging(intra)
    buf = st(tensor, write=True)
    if intra.nranks() == 1 or inter.nranks() == 1:
        level = inter if intra.nranks() == 1 else intra
        works = [None if level.nranks() == 1 else
                 dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=level.torch_group, async_op=True)]
    elif intra.uses_nccl(buf):
        first = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=intra.torch_group, async_op=True)
        first.wait()  # orders the CUDA streams; the CPU does not block
        works = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=inter.torch_group, async_op=True)]
    else:
        first = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=intra.torch_group, async_op=True)

        def second():
            first.wait()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=inter.torch_group, async_op=True).wait()

        works = [_submit(second)]
    return _finish(st.handle(works, finishers), async_op)


# ----------------------------------------------------------------- neighbour exchange


def start_neighbor_exchange(
    sends: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    recvs: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    group=None,
) -> CommHandle:
    """Post all sends and receives of one step at once.

    ``sends`` and ``recvs`` map a peer's global rank to a tensor (or are lists of
    ``(peer, tensor)`` pairs when a peer gets several tensors; pairs to the same peer
    are matched in posting order). Returns a handle; ``wait()`` blocks until all are
    done. A pair with this process's own rank is a local copy. When every tensor is a
    CUDA tensor of a group with NCCL, the step is one ``batch_isend_irecv`` (NCCL groups
    its sends and receives, so no order of posting can deadlock); otherwise each send
    and receive is posted on gloo on its own (``irecv`` / ``isend``, receives first,
    each kind in order), CUDA tensors staged through host memory.

    Why receives first on gloo: measured over bandwidth-limited links, a worker that
    sends to two neighbours and receives from both finished in 1.6–1.75× the time when
    its sends were posted first
    (21 MB per message over emulated 100 Mbit/s and 1 Gbit/s links, 4 workers on a
    chain: 6.3 s against 4.0 s, 654 ms against 373 ms; docs/benchmarks.md).
    """
    _require_init("start_neighbor_exchange()")
    c = _as_communicator(group)
    send_items = list(sends.items()) if isinstance(sends, Mapping) else list(sends)
    recv_items = list(recvs.items()) if isinstance(recvs, Mapping) else list(recvs)
    for kind, items in (("sends", send_items), ("recvs", recv_items)):
        for i, (peer, t) in enumerate(items):
            _check_tensor(f"{kind}[{i}] tensor", t)
            _peer(c, False, peer, f"{kind}[{i}] peer")
    me = get_rank()
    own_sends = [t for peer, t in send_items if peer == me]
    own_recvs = [t for peer, t in recv_items if peer == me]
    if len(own_sends) != len(own_recvs):
        raise ValueError(
            f"{len(own_sends)} sends but {len(own_recvs)} receives with this process's own rank {me}; they pair up in order"
        )
    for src, dst in zip(own_sends, own_recvs):
        dst.copy_(src)
    send_items = [(p, t) for p, t in send_items if p != me]
    recv_items = [(p, t) for p, t in recv_items if p != me]
    _count(sum(_nbytes(t) for _, t in send_items))
    if not (send_items or recv_items):
        return CommHandle()
    g = c.torch_group
    if all(c.uses_nccl(t) for _, t in send_items + recv_items):
        ops = [dist.P2POp(dist.isend, t, peer, g) for peer, t in send_items]
        ops += [dist.P2POp(dist.irecv, t, peer, g) for peer, t in recv_items]
        return CommHandle(dist.batch_isend_irecv(ops))
    st = _Staging(c, force=True)
    works = [dist.irecv(st(t, read=False, write=True), src=peer, group=g) for peer, t in recv_items]
    works += [dist.isend(st(t), dst=peer, group=g) for peer, t in send_items]
    return st.handle(works)


def neighbor_exchange(sends, recvs, group=None) -> None:
    """Blocking :func:`start_neighbor_exchange`."""
    start_neighbor_exchange(sends, recvs, group).wait()


def all_gather_object(obj, comm=None, *, group=None) -> list:
    """Every member's picklable ``obj``, in communicator-rank order (e.g. to compare
    model fingerprints before any tensor is sent)."""
    c, _ = _target(comm, group, "all_gather_object")
    out = [None] * c.nranks()
    dist.all_gather_object(out, obj, group=c.torch_group)
    return out
