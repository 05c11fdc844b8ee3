"""Bagua's decentralized synchronous op: gossip averaging of the bucket's weights
(all peers, shift_one pairs, or a topology's Metropolis–Hastings weights), one
:class:`~..gossip.Gossip` (every gossip of the package is that one coding)."""

from __future__ import annotations

import threading
from collections import deque

import torch

from topologies import ShiftOneTopology, shift_one_peer

from .. import comm
from ..gossip import Gossip
from ..topology import resolve_topology
from .common import effective, is_whole_world, within_nodes

__all__ = ["DecentralizedSynchronousOp", "PEER_SELECTION_MODES", "shift_one_peer"]

PEER_SELECTION_MODES = ("all", "shift_one")


class DecentralizedSynchronousOp:
    """Gossip averaging of the bucket's weights into ``peer_weight``.

    One execution:

    1. peer_weight ← x (the bucket). Without ``hierarchical`` the gossip is
       :meth:`~..gossip.Gossip.mix_into`, which for shift_one and a topology folds this
       copy into the exchange: x is sent from the bucket (forward and backward only read
       it) and the result built in peer_weight, bit for bit the copy's gossip, one pass
       over the weights fewer; "all" (an allreduce in place) still copies first, as does
       ``hierarchical`` (peer_weight is reduced within the node);
    2. with ``hierarchical``, averaged within the node; only the node leaders (local
       rank 0) go on, gossiping among the nodes;
    3. the gossip, one :class:`~..gossip.Gossip` over the members (the group's workers,
       or the node leaders):

       - "all": peer_weight ← the mean over the members (an allreduce average);
       - "shift_one": peer_weight ← (peer_weight + that of one peer) / 2, the pairing
         :func:`shift_one_peer` of the number of executions so far (the time-varying
         :class:`~topologies.ShiftOneTopology`);
       - ``topology``: peer_weight ← Σ_j W_ij x_j over the topology's neighbours, W its
         Metropolis–Hastings matrix;

    4. with ``hierarchical``, the leader's result is broadcast within the node.

    ``copy_back_peer_weight(bucket)`` writes peer_weight into the bucket. With shift_one
    (or a time-varying topology) between workers, the op leaves the peer's weights in
    peer_weight, and copy_back averages them with the bucket's and writes the result
    into both in one sweep (:meth:`~..gossip.Gossip.exchange_into`): after copy_back
    peer_weight holds the mixed weights, as Bagua's tests read them. Where the
    group's transport runs every call on the caller's thread (``runs_in_caller``: the
    one-process engine) the gossip itself runs at copy_back, in place on every worker's
    weights (see ``_execute``).
    """

    def __init__(self, bucket, peer_weight, hierarchical: bool, peer_selection_mode: str, group, topology=None):
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {list(PEER_SELECTION_MODES)}, got {peer_selection_mode!r}"
            )
        if not torch.is_tensor(peer_weight) or effective(peer_weight).numel() != bucket.numel * (bucket.workers or 1):
            raise ValueError(
                f"peer_weight must be a tensor of the bucket's {bucket.numel} elements "
                "(bucket.flattened_tensor().ensure_bagua_tensor(...) makes one)"
            )
        self.peer_weight = peer_weight
        self.hierarchical = bool(hierarchical)
        self.peer_selection_mode = peer_selection_mode
        self.group = group
        self._state = bucket.state  # checkpointed by the runtime with the bucket
        self._state.setdefault("decentralized_exchanges", 0)
        # A transport that runs its calls on the caller's thread leaves nothing to overlap:
        # the gossip then runs at copy_back, in place (see _execute).
        self.in_place = comm.transport_for(None, group).runs_in_caller
        if self.hierarchical:
            if not is_whole_world(group):
                raise ValueError("hierarchical=True gossips between nodes of all workers; use the default group")
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))  # node leaders
            self.is_leader = comm.leads_node()
            self.my_index = comm.get_node_rank()
        else:
            self.peer_ranks = comm.group_ranks(group)
            self.is_leader = True
            self.my_index = comm.group_rank(group)
        members = len(self.peer_ranks)
        # One worker in all: the gossip result is the weights themselves, which nothing
        # changes between the op and copy_back_peer_weight; only the count moves.
        self.local_only = members == 1 and (not self.hierarchical or comm.get_local_size() == 1)
        self.topology = None
        if topology is not None:
            what = "the gossip between node leaders" if self.hierarchical else "the process group"
            self.topology = topology = resolve_topology(topology, members, members=what)
        elif peer_selection_mode == "shift_one":
            if members % 2:
                what = "nodes" if self.hierarchical else "workers"
                raise ValueError(f"peer_selection_mode='shift_one' needs an even number of {what}, got {members}")
            topology = ShiftOneTopology(members)
        # The gossip among the members ("all": over the nodes' leaders' group when
        # hierarchical); None with one member, whose gossip is the weights themselves.
        self.gossip = None
        if members > 1:
            # the rows of x: the members whose workers this process runs (a job: its own)
            rows = [self.my_index] if self.hierarchical else comm.worker_ranks(group)
            exchange_group = comm.inter_node_group() if self.hierarchical and topology is None else group
            self.gossip = Gossip(topology, rows, self.peer_ranks, exchange_group)
        # post(): a job's pairwise exchange of CPU weights between workers may be posted
        # by the training thread. _posted holds, per execution announced by post() and
        # not yet run, its (handle, finish), its posting error, or None (the op
        # exchanges itself); _exchanging is set while an execution runs. Both under
        # _post_lock, so an exchange is posted only while none is queued or in flight.
        self.postable = (self.gossip is not None and not self.in_place and not self.hierarchical
                         and self.gossip.exchanges_pairwise and effective(peer_weight).device.type == "cpu")
        self._posted: deque = deque()
        self._exchanging = False
        self._post_lock = threading.Lock()

    def post(self, bucket) -> None:
        """Announce the op's next execution; its caller marks the bucket ready next.

        Called by the decentralized algorithm's forward pre-hook, on the training
        thread. Where the op is :attr:`postable` and no execution is queued or running,
        the exchange is posted now (:meth:`~..gossip.Gossip.start_exchange_into`), so the
        transfer starts without waiting for the communication thread to wake and take
        the GIL (1.2–4.6 ms a step with 4 workers on 2 cores; docs/benchmarks.md,
        "Against Decent-DP"); the execution then only waits for it. Otherwise (a second
        training forward in a step while the first's exchange runs, say) the execution
        exchanges as before. Either way each rank's exchanges run one after another in
        the order of the schedule, so the peers' messages pair up. A posting error is
        raised by the execution, on the communication thread, as its own would be."""
        with self._post_lock:
            entry = None
            if self.postable and not self._posted and not self._exchanging:
                x = effective(self.peer_weight)
                try:
                    entry = self.gossip.start_exchange_into(bucket.flat_view().view_as(x), x, self.step)
                except Exception as err:  # noqa: BLE001 - raised by the execution, where failures are handled
                    entry = err
            self._posted.append(entry)

    def __call__(self, bucket) -> None:
        with self._post_lock:
            posted = self._posted.popleft() if self._posted else None
            self._exchanging = True
        try:
            self._execute(bucket, posted)
        finally:
            with self._post_lock:
                self._exchanging = False

    def _execute(self, bucket, posted) -> None:
        if self.local_only:
            self._state["decentralized_exchanges"] += 1
            return
        if self.in_place:
            # The transport runs forward and backward between this op and
            # copy_back_peer_weight on one thread, with the weights unchanged: there is no
            # communication to overlap, so the gossip of x^t runs at copy_back, in place on
            # the weights (the two copies through peer_weight saved; it is not filled).
            self._deferred = self.step
            self._state["decentralized_exchanges"] += 1
            return
        x = effective(self.peer_weight)  # (Bagua's flattened_tensor(), [L] in a job)
        weights = bucket.flat_view().view_as(x)
        if self.hierarchical:
            x.copy_(weights)
            within_nodes(x, lambda x: self._gossip(x, self.step), self._intra_if_hierarchical(), self.is_leader)
        else:
            # Between workers the weights are read where they lie (forward and backward
            # only read them until copy_back): sent from the bucket, the result built in
            # peer_weight, bit for bit the copy's gossip without the copy. A pairwise
            # average (shift_one) is finished at copy_back, where the weights may be
            # written: the sum, the halving and the copy back in one sweep. (None first:
            # an exchange that fails leaves no earlier exchange's finish behind.)
            self._finish = None
            if posted is None:
                self._finish = self.gossip.exchange_into(weights, x, self.step)
            elif isinstance(posted, BaseException):
                raise posted
            else:  # posted by post() on the training thread
                handle, finish = posted
                handle.wait()
                self._finish = finish
        self._state["decentralized_exchanges"] += 1

    _deferred = None  # in_place: the exchange count of the gossip copy_back runs, if one is due
    _finish = None  # a job: what completes the last exchange (Gossip.exchange_into), due at copy_back

    def _intra_if_hierarchical(self):
        return comm.intra_node_group() if self.hierarchical else None

    @property
    def step(self) -> int:
        """Executions so far (the shift_one schedule)."""
        return self._state["decentralized_exchanges"]

    def _gossip(self, x: torch.Tensor, step: int) -> None:
        """x ← the gossip of x at exchange ``step`` (shift_one's pairing), in place."""
        if self.gossip is not None:
            self.gossip.mix_(x, step)

    def copy_back_peer_weight(self, bucket) -> None:
        """The bucket's weights ← the gossip result (with one worker, they are it)."""
        if self.local_only:
            return
        if self.in_place:
            step, self._deferred = self._deferred, None
            if step is not None:
                x = bucket.flat_view()
                within_nodes(x, lambda x: self._gossip(x, step), self._intra_if_hierarchical(), self.is_leader)
                bucket.write_flat(x)
            return
        peer_weight = effective(self.peer_weight)
        finish, self._finish = self._finish, None
        if finish is not None:
            # A flattened bucket's flat view is the weights' storage: written in the same
            # sweep as peer_weight's result. Otherwise it is a copy: written tensor by tensor.
            if bucket.flatten:
                finish(bucket.flat_view().view_as(peer_weight))
                return
            finish(None)
        bucket.write_flat(peer_weight)
