"""The transport a group's workers communicate through: one interface, two implementations.

Every call of ``comm`` (Bagua's names: ``allreduce``, ``get_rank``, ...) is answered by
a :class:`Transport`:

* :class:`~.process.ProcessTransport`, the job's processes over torch.distributed
  (gloo, NCCL): one worker per process, a worker's tensors its own;
* the one-process engine's stacked transport (``bagua_algos.engine.transport``): the n
  workers of one process, each tensor ``[n, ...]``, a row per worker.

Which one answers a call: a transport passed as the call's ``comm=`` or ``group=`` (the
engine's group is its transport); else the transport made current on this thread by
:func:`using_transport` (the engine's step); else the process transport. A call that
names a process group while another transport is current is refused: the engine's
workers communicate only among themselves.

A transport implements every method below; one it cannot serve raises
``NotImplementedError`` naming the call and what to do instead. A collective added to
``comm`` is a method here first, so neither implementation can miss it: the
:class:`Transport` base class has no default for a collective (``abc``), and a test
checks that ``comm``'s public calls and this interface name the same collectives.

Shapes. The rows a process's tensors hold are its workers (:attr:`Transport.row_dims`:
``()`` in a process, whose tensors are a worker's own; ``(n,)`` on the engine). A rank
is per worker, so on the engine ``get_rank()`` is a ``[n]`` tensor and a neighbour
exchange's peer a ``[n]`` long tensor (-1: none); in a process a peer may be an int or
a ``[1]`` tensor.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Optional

__all__ = ["Transport", "using_transport", "current_transport", "transport_for", "set_process_transport"]

_local = threading.local()
_process: list = []  # [the process transport], set once by comm.process (it imports this module)


class Transport(abc.ABC):
    """What ``comm``'s calls need of a transport (the collectives, the ranks, the groups).

    Each method takes the arguments of the ``comm`` call of its name, in its order,
    ``comm=`` / ``group=`` / ``async_op=`` included (a transport may ignore them: they
    chose it). The docstrings of ``comm``'s calls state what each computes; a
    transport's implementation must compute it, bit for bit where the engine is checked
    against processes."""

    row_dims: tuple = ()
    """The leading dimensions of a worker's tensors under this transport: ``()`` where a
    process's tensors are one worker's own, ``(n,)`` where they stack n workers' rows."""

    runs_in_caller: bool = False
    """Whether every call completes on the caller's thread before it returns (nothing
    of it can overlap the caller's work): an op may then do its exchange where its
    result is needed instead of where its inputs are ready."""

    def padding_view(self, bucket_name: str, last, padding: int):
        """Storage this transport lends bucket ``bucket_name`` for its ``padding`` zero
        columns after ``last`` (its last tensor), or None: the bucket allocates them."""
        return None

    # --- the environment (Bagua's env module) -------------------------------------
    @abc.abstractmethod
    def is_initialized(self) -> bool: ...

    @abc.abstractmethod
    def get_rank(self, group=None): ...

    @abc.abstractmethod
    def get_world_size(self, group=None) -> int: ...

    @abc.abstractmethod
    def get_local_rank(self): ...

    @abc.abstractmethod
    def get_local_size(self) -> int: ...

    @abc.abstractmethod
    def get_node_rank(self) -> int: ...

    @abc.abstractmethod
    def leads_node(self) -> bool: ...

    # --- groups ---------------------------------------------------------------------
    @abc.abstractmethod
    def default_group(self): ...

    @abc.abstractmethod
    def group_rank(self, group): ...

    @abc.abstractmethod
    def group_ranks(self, group) -> list: ...

    @abc.abstractmethod
    def worker_ranks(self, group=None) -> list: ...

    @abc.abstractmethod
    def intra_node_group(self): ...

    @abc.abstractmethod
    def inter_node_group(self): ...

    # --- collectives ------------------------------------------------------------------
    @abc.abstractmethod
    def allreduce_inplace(self, tensor, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def allreduce(self, send_tensor, recv_tensor, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def hierarchical_allreduce_inplace(self, tensor, op, *, async_op=False): ...

    @abc.abstractmethod
    def broadcast(self, tensor, src=0, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def reduce(self, send_tensor, recv_tensor, dst, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def reduce_inplace(self, tensor, dst, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def allgather(self, send_tensor, recv_tensor, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def allgather_inplace(self, tensor, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def gather(self, send_tensor, recv_tensor, dst, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def gather_inplace(self, tensor, count, dst, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def scatter(self, send_tensor, recv_tensor, src, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def scatter_inplace(self, tensor, count, src, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def reduce_scatter(self, send_tensor, recv_tensor, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def reduce_scatter_inplace(self, tensor, op, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def alltoall(self, send_tensor, recv_tensor, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def alltoall_inplace(self, tensor, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def alltoall_v(self, send_tensor, send_counts, send_displs, recv_tensor, recv_counts, recv_displs, comm=None, *,
                   group=None, async_op=False): ...

    @abc.abstractmethod
    def alltoall_v_inplace(self, tensor, counts, displs, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def barrier(self, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def send(self, tensor, dst, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def recv(self, tensor, src, comm=None, *, group=None, async_op=False): ...

    @abc.abstractmethod
    def all_gather_object(self, obj, comm=None, *, group=None) -> list: ...

    @abc.abstractmethod
    def broadcast_object(self, obj, src=0, comm=None, *, group=None): ...

    # --- between neighbours ----------------------------------------------------------
    @abc.abstractmethod
    def start_neighbor_exchange(self, sends, recvs, group=None): ...

    @abc.abstractmethod
    def neighbor_exchange(self, sends, recvs, group=None) -> None: ...

    @abc.abstractmethod
    def neighbor_allreduce(self, x, out, self_weight, neighbors, group=None) -> None: ...


@contextlib.contextmanager
def using_transport(transport: Transport):
    """Within this block (on this thread) ``comm``'s calls that name no group are
    ``transport``'s (the engine's step runs in one)."""
    if not isinstance(transport, Transport):
        raise TypeError(f"transport must be a comm.Transport, got {type(transport).__name__}")
    before = getattr(_local, "transport", None)
    _local.transport = transport
    try:
        yield transport
    finally:
        _local.transport = before


def current_transport() -> Transport:
    """The transport made current on this thread (:func:`using_transport`), else the
    process transport."""
    transport = getattr(_local, "transport", None)
    return transport if transport is not None else _process[0]


def set_process_transport(transport: Transport) -> None:
    """Install the process transport (called once, by ``comm.process``)."""
    _process[:] = [transport]


def transport_for(comm=None, group=None) -> Transport:
    """The transport that answers a call given ``comm=`` and ``group=`` (the rule in the
    module's docstring)."""
    for named in (comm, group):
        if isinstance(named, Transport):
            return named
    current: Optional[Transport] = getattr(_local, "transport", None)
    if current is None:
        return _process[0]
    if comm is None and group is None:
        return current
    raise TypeError(f"the one-process engine's workers communicate through their own group (comm=None or the "
                    f"algorithm's process_group); got {comm if comm is not None else group!r}")
