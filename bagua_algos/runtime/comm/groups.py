"""Process groups: Bagua's communicators, ``BaguaProcessGroup`` with its node
subgroups (created collectively, each with the job's timeout), ``new_group`` and the
lookups between communicators, groups and ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ...arguments import check_timeout, is_int
from .env import _require_init, get_local_size, get_rank, get_world_size, is_initialized


DEFAULT_TIMEOUT = timedelta(minutes=10)

_state = {
    "timeout": None,  # timedelta of init_process_group, given to every group created here
    "default": None,  # BaguaProcessGroup of the whole job
    "group_count": 0,
}
_torch_group_comms: dict = {}  # torch ProcessGroup -> BaguaCommunicator
_NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


def _joined(timeout: Optional[timedelta]) -> None:
    """Forget every group of a previous job; the new one's groups get ``timeout``
    (None: torch's default; a job this package did not start)."""
    _torch_group_comms.clear()
    _state.update(timeout=timeout, default=None, group_count=0)


def job_timeout() -> timedelta:
    """How long a wait on a peer may take in this job: init_process_group's timeout
    (DEFAULT_TIMEOUT when the job was started otherwise)."""
    return _state["timeout"] or DEFAULT_TIMEOUT


def _as_timedelta(timeout, name: str = "timeout") -> timedelta:
    """A ``timeout=`` argument (a timedelta or seconds, checked) as a timedelta."""
    seconds = check_timeout(timeout, name)
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)


def _timeout_kwargs(timeout=None) -> dict:
    """torch's ``timeout=`` for a new group: ``timeout`` if given, else the job's; none
    at all in a job this package did not start (torch's default then)."""
    timeout = _state["timeout"] if timeout is None else _as_timedelta(timeout)
    return {} if timeout is None else {"timeout": timeout}


def get_backend_name(group=None) -> str:
    """``"gloo"`` or ``"nccl"``: the backend of ``group`` (default: the job's). With
    ``"nccl"``, CUDA tensors travel over NCCL and CPU tensors over gloo. (Not Bagua's
    ``get_backend(model_name)``, the communication backend object of a module:
    :func:`bagua_algos.runtime.backend.get_backend`.)"""
    _require_init("get_backend_name()")
    return _as_communicator(group).backend()


def is_torch_world(group) -> bool:
    """Whether ``group`` is torch's ``dist.group.WORLD`` (the default group)."""
    return group is dist.group.WORLD


def _new_torch_group(ranks: Sequence[int], timeout=None):
    """A torch group over ``ranks`` (sorted) with ``timeout`` (default: the job's).
    Collective over the job."""
    return dist.new_group(ranks=sorted(ranks), **_timeout_kwargs(timeout))


@dataclass
class NodeGroups:
    """A group's node communicators (created collectively on first use)."""

    intra: "BaguaCommunicator"  # the group's members on this process's node
    inter: "BaguaCommunicator"  # the members with the local rank of the group's first rank
    by_local_rank: dict = field(default_factory=dict)  # local rank → its members, one per node
    # The default group only: the inter-node communicator of the two-level allreduce's
    # helper thread (groups of its own, so that its collectives never interleave with the
    # caller's on the public ones); comm.hierarchical creates it on first use.
    hierarchical_inter: Optional["BaguaCommunicator"] = None


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
        self._node: Optional[NodeGroups] = None  # built by _node_groups()

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
        return self._node_groups().intra

    def get_inter_node_communicator(self) -> BaguaCommunicator:
        return self._node_groups().inter

    def _node_groups(self) -> NodeGroups:
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

        intra = BaguaCommunicator(_NON_MEMBER, self.intra_ranks, f"{self.group_name}/intra")
        for n in range(world // local):
            members = [r for r in self.ranks if r // local == n]
            if members:
                g = group_of(members)
                if me in members:
                    intra = BaguaCommunicator(g, members, f"{self.group_name}/intra{n}")
        by_local_rank = {}
        for lr in range(local):
            members = [r for r in self.ranks if r % local == lr]
            if members:
                by_local_rank[lr] = BaguaCommunicator(group_of(members), members, f"{self.group_name}/inter{lr}")
        leader_local = self.ranks[0] % local if self.ranks else 0
        inter = by_local_rank.get(leader_local, BaguaCommunicator(_NON_MEMBER, [], f"{self.group_name}/inter"))
        self._node = NodeGroups(intra=intra, inter=inter, by_local_rank=by_local_rank)
        return self._node

    def __repr__(self) -> str:
        return f"BaguaProcessGroup({self.group_name}, ranks={self.ranks})"


def _get_default_group() -> BaguaProcessGroup:
    """The :class:`BaguaProcessGroup` of the whole job."""
    if not is_initialized():
        raise RuntimeError("Default process group has not been initialized, please make sure to call init_process_group.")
    if _state["default"] is None:
        _state["default"] = BaguaProcessGroup(list(range(dist.get_world_size())), None, "default")
    return _state["default"]


def new_group(ranks: Sequence[int] | None = None, stream=None, *,
              timeout: timedelta | float | None = None) -> BaguaProcessGroup:
    """A :class:`BaguaProcessGroup` over ``ranks`` (global ranks; all by default).

    Every process of the job must call it, in the same order, also those that are not
    members. ``stream`` is accepted for Bagua's signature and ignored. The group's
    torch group carries the timeout of :func:`init_process_group` (or ``timeout``: a
    timedelta or seconds).
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
    torch_group = _new_torch_group(ranks, timeout)
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
    return _get_default_group()._node_groups().intra


def inter_node_group() -> BaguaCommunicator:
    """The processes with this process's local rank, one on each node."""
    _require_init("inter_node_group()")
    return _get_default_group()._node_groups().by_local_rank[get_rank() % get_local_size()]
