"""Process groups and collectives with Bagua 0.9's names, on torch.distributed.

This package is the only code in the project that calls ``torch.distributed``. It
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
same kinds of objects. The two differ only in what a rank argument means, and each
reads as in the library its keyword comes from (``checks.COMMUNICATOR_RANKS`` and
``checks.GLOBAL_RANKS`` in the code):

* with ``comm=`` (Bagua's API), ``src``, ``dst`` are ranks **inside the
  communicator**, 0 ... ``comm.nranks() - 1``. Bagua hands them unchanged to its
  NCCL communicator, which numbers its members by their position in the
  communicator's sorted global ranks (``BaguaSingleCommunicatorPy(rank=ranks.index(
  get_rank()), nranks=len(ranks))``), so NCCL's root is a communicator rank. With
  ``comm=None`` the communicator is the whole job and the two numberings agree.
* with ``group=``, ``src``, ``dst`` (and the peers of :func:`start_neighbor_exchange`)
  are **global** ranks, as with ``torch.distributed``'s ``group=`` and as this
  project's internal callers have always passed them.

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
* ``barrier``, ``all_gather_object``, ``broadcast_object``, receives: 0.

Layout (one module per concern; the names in ``__all__`` below are re-exported here,
so callers write ``from bagua_algos.runtime import comm`` and ``comm.allreduce(...)``;
the compatibility package imports a few others from their modules):

* ``env``: rank, world size, local rank and size, node rank;
* ``lifecycle``: joining and leaving the job: the backend rule (:func:`choose_backend`),
  :func:`init_process_group`, :func:`destroy_process_group`, the exit hook;
* ``groups``: communicators, :class:`BaguaProcessGroup` and its node subgroups,
  :func:`new_group`, the job's timeout given to every group;
* ``reduce_op``: :class:`ReduceOp` and AVG where the backend has none;
* ``checks``: the argument checks of the calls, and what a rank argument means;
* ``handle``: :class:`CommHandle`; ``counter``: :func:`bytes_sent`;
* ``staging``: host copies of CUDA tensors for gloo;
* ``collectives``: the 18 collectives and ``send``/``recv``;
* ``hierarchical`` (with ``helper_thread``): the two-level allreduce;
* ``neighbors``: the neighbour exchange, ``all_gather_object`` and ``broadcast_object``;
* ``transport``: the interface every call is answered through (:class:`Transport`), and
  which transport answers a call; ``process``: the job's processes' transport, which
  binds the implementations above; ``api``: the public calls, each handing its arguments
  to its transport. The one-process engine's transport, every worker a row of each
  tensor, is the engine's own (``bagua_algos.engine.transport``).
"""

from __future__ import annotations

from .checks import _as_communicator  # noqa: F401 - for tests and Bagua's private names
from . import fault_tolerance  # noqa: F401 - comm.fault_tolerance: torchft replicas (opt-in)
from .api import (_get_default_group, all_gather_object, allgather, allgather_inplace, allreduce,  # noqa: F401
                  allreduce_inplace, alltoall, alltoall_inplace, alltoall_v, alltoall_v_inplace, barrier, broadcast,
                  broadcast_object, gather, gather_inplace, get_local_rank, get_local_size, get_node_rank, get_rank,
                  get_world_size, group_rank, group_ranks, hierarchical_allreduce_inplace, inter_node_group,
                  intra_node_group, is_initialized, leads_node, neighbor_allreduce, neighbor_exchange, recv, reduce,
                  reduce_inplace, reduce_scatter, reduce_scatter_inplace, scatter, scatter_inplace, send,
                  start_neighbor_exchange, worker_ranks)
from .counter import bytes_sent, count_sent, reset_bytes_sent
from .groups import (DEFAULT_TIMEOUT, BaguaCommunicator, BaguaProcessGroup, _state,  # noqa: F401
                     from_torch_group, get_backend_name, new_group)
from .handle import CommHandle
from .lifecycle import BACKEND_ENV, BACKENDS, choose_backend, destroy_process_group, init_process_group
from .process import PROCESS_TRANSPORT, ProcessTransport
from .reduce_op import ReduceOp
from .staging import _Staging  # noqa: F401 - tests force it on CPU tensors
from .transport import Transport, current_transport, transport_for, using_transport

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
    "broadcast_object",
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
    "leads_node",
    # this project's extras
    "BACKEND_ENV",
    "BACKENDS",
    "choose_backend",
    "CommHandle",
    "all_gather_object",
    "get_backend_name",
    "group_rank",
    "group_ranks",
    "intra_node_group",
    "inter_node_group",
    "hierarchical_allreduce_inplace",
    "neighbor_exchange",
    "start_neighbor_exchange",
    "bytes_sent",
    "reset_bytes_sent",
    "count_sent",
    "neighbor_allreduce",
    "worker_ranks",
    # the transports
    "Transport",
    "ProcessTransport",
    "PROCESS_TRANSPORT",
    "current_transport",
    "transport_for",
    "using_transport",
]
