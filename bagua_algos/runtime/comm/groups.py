"""Process groups: the backend rule, ``init_process_group``, Bagua's communicators
and ``BaguaProcessGroup`` with its node subgroups (created collectively, each with the
job's timeout)."""

from __future__ import annotations

import atexit
import os
import sys
import types
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ...arguments import is_int
from ..gpus import gpu_shortage
from .env import _env_int, _require_init, get_local_size, get_rank, get_world_size, is_initialized
from .helper_thread import _stop_helper


DEFAULT_TIMEOUT = timedelta(minutes=10)

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
    workers = local_world_size if local_world_size and local_world_size > 0 else _env_int("LOCAL_WORLD_SIZE", 1)
    shortage = gpu_shortage(f"{where}={backend!r}", workers, "--nproc_per_node",
                            f"init_process_group(backend='gloo'), {BACKEND_ENV}=gloo, or the launcher's --backend gloo")
    if shortage:
        raise RuntimeError(shortage)
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
    _stop_helper((_state["timeout"] or DEFAULT_TIMEOUT).total_seconds() + 5)
    _torch_group_comms.clear()
    _state.update(timeout=None, owner=False, default=None, group_count=0)
    if is_initialized():
        dist.destroy_process_group()
        _drop_groups_held_as_defaults()


def _drop_groups_held_as_defaults() -> None:
    """Point every torch.distributed function whose default argument is a process
    group back at ``None`` (the default group), so that destroyed groups are freed.

    Why: torch.distributed.nn.functional declares ``group=group.WORLD``, evaluated once,
    when the module is first imported; building the first optimizer imports it (torch.optim
    → torch._dynamo → FSDP). A script that builds its optimizer after init_process_group
    thus leaves the job's group in ten default tuples, and dist.destroy_process_group()
    cannot free it: its gloo threads (or NCCL watchdog) run on into interpreter
    finalization. A gloo thread that drops a finished op there needs the GIL for the op's
    tensors, CPython ends it with pthread_exit, and the process aborts ("terminate called
    without an active exception", SIGABRT, after a successful run: a core's backtrace is
    in docs/exit_abort.md). ``None`` is what ``group.WORLD`` was before init and what
    torch reads as the default group.
    """
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if name.startswith("torch.distributed") else None
        if not isinstance(namespace, dict):  # another package, or a placeholder in sys.modules
            continue
        for fn in list(namespace.values()):
            if type(fn) is not types.FunctionType:  # type(): no attribute access on the module's objects
                continue
            if fn.__defaults__ and any(isinstance(d, dist.ProcessGroup) for d in fn.__defaults__):
                fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in fn.__defaults__)
            if fn.__kwdefaults__ and any(isinstance(d, dist.ProcessGroup) for d in fn.__kwdefaults__.values()):
                fn.__kwdefaults__ = {k: None if isinstance(d, dist.ProcessGroup) else d
                                     for k, d in fn.__kwdefaults__.items()}


def _destroy_at_exit() -> None:
    # A process group still alive at interpreter exit is torn down while its backend
    # threads run, which can abort the process; destroy it first (only if ours). A
    # script that called torch's dist.destroy_process_group() itself may still have
    # left the group in torch's default arguments: free it now, not at finalization.
    if not _state["owner"]:
        return
    try:
        if is_initialized():
            destroy_process_group()
        else:
            _drop_groups_held_as_defaults()
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
        if not is_int(rank) or not 0 <= rank < len(self.ranks):
            raise ValueError(
                f"{what}={rank!r} is not a rank of this communicator: with comm= it is a rank inside "
                f"the communicator, 0..{len(self.ranks) - 1} (its global ranks are {self.ranks})"
            )
        return self.ranks[int(rank)]

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
            if not is_int(r) or not 0 <= r < world:
                raise ValueError(f"new_group(ranks=...): invalid rank {r!r}, ranks must be in [0, {world})")
        ranks = [int(r) for r in ranks]
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
