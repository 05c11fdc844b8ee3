"""DiLoCo: H local steps of the user's (inner) optimizer, then an outer optimizer step on
the workers' averaged pseudo-gradient (Douillard et al. 2023), and its streaming form
(fragments synchronised at staggered steps, Douillard et al. 2025).

Every worker keeps θ_outer, the model of the last synchronisation (the same on every
worker). After inner step t (counted from 1, ``bagua_train_step_counter``), fragment f of
the parameters synchronises when (t − f·⌊H/F⌋) mod H = 0, t ≥ 1 (F = 1: after steps
H, 2H, …, as in the paper and torchft):

1. Δ_i = θ_outer − θ_i                the worker's pseudo-gradient (the fragment's slice);
2. Δ = (1/n) Σ_i Δ_i                  one allreduce-mean (through ``compression``, below);
3. θ_outer ← outer SGD step on Δ      torch.optim.SGD's rule: b ← μ b + Δ (b = Δ at the
                                      first step), d = Δ + μ b with Nesterov, else d = b;
                                      θ_outer ← θ_outer − η d;
4. θ_i ← θ_outer                      every worker restarts from the outer model.

The inner optimizer's state is kept across rounds (the paper's). With ``outer_lr=1``,
``outer_momentum=0`` the outer step is θ_outer ← mean_i θ_i: plain local SGD, i.e.
``allreduce_average(communication_interval=H)`` with DiLoCo's schedule (after steps H,
2H, … instead of Bagua's 1, H + 1, …).

Fragments (``fragments=F``): the parameters are cut into F groups of whole layers (a
layer: the tensors of one module, named alike but for their last dotted part). With
``fragment_pattern="strided"`` (the default) layer j, counted in the runtime's bucket
order, goes to fragment j mod F, so every fragment spans the depth of the network: the
pattern Streaming DiLoCo (Douillard et al. 2025) prefers, its strided pattern having
been slightly better than the sequential one in its comparison of the two.
``"sequential"`` cuts consecutive runs of whole tensors of about equal size instead.

Overlap (Streaming DiLoCo, ``overlap=τ`` ≥ 1): the allreduce of fragment f's Δ starts
after inner step t and the worker trains on; after inner step t + τ it waits for the
result, takes the outer step 3 (from θ_outer and the Δ of step t: the outer copy and
momentum do not change in between), and merges instead of step 4:

4'. θ_i ← α θ_i(t + τ) + (1 − α) θ_outer       α = ``merge_alpha``

This is the merge of Streaming DiLoCo (Douillard et al. 2025) with its mixing factor α,
defaulting to the paper's α = 0.5 (α = 0 takes the outer model; α = 1 keeps the local
one). torchft's DiLoCo names τ ``fragment_sync_delay`` and α ``fragment_update_alpha``
and accepts only α = 0. The next pseudo-gradient is again taken against θ_outer, not
against the merged parameters. τ = 0 is plain DiLoCo (step 4, no merge). τ < ⌊H/F⌋, as
torchft requires: a fragment's result lands before the next fragment starts, so one
fragment is in flight at a time. In a job the allreduce is posted with
``async_op=True`` (gloo and NCCL run it beside the training thread) and its handle
waited for at step t + τ; ``minmax*`` run their two collective stages at step t (the
codec decodes and re-encodes between them), so there the result is only held. On the
engine the stacked collective is synchronous and the result is held for τ steps: the
same arithmetic. A run that ends with a fragment in flight leaves its outer step
untaken (as the paper's schedule). A checkpoint first waits for the fragments in flight
and saves the averaged Δ (``diloco_pending``) and the step it lands at
(``diloco_due``, 0: none): a resumed run takes that outer step at that step.

``compression`` sends Δ_i through a codec (the bytes counted are what a worker hands to
the collective): ``"fp16"`` / ``"bf16"`` (an allreduce of Δ_i rounded to that dtype, as
OpenDiLoCo's FP16 outer all-reduce), ``"minmax8"`` / ``"minmax4"`` (Bagua's min-max
scatter-gather at 8 or 4 bits, :func:`~bagua_algos.runtime.ops.compressed_scatter_gather`;
Streaming DiLoCo exchanges 4-bit floats, this is the min-max grid at 4 bits).

Written once for a leading worker dimension: a job's process is one worker, the
one-process engine runs this impl for its n workers at once (the fragments' buckets
``[n, numel]``).

Example::

    >>> from bagua_algos.algorithms import DiLoCoAlgorithm
    >>> DiLoCoAlgorithm(sync_every=50, fragments=2).sync_every
    50
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..arguments import check_choice, check_flag, check_int, check_real
from ..runtime import comm
from ..runtime.algorithm import Algorithm, PostOptimizerStepHook
from ..runtime.bucket import BaguaBucket, worker_numel
from ..runtime.ops import compressed_scatter_gather
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["DiLoCoAlgorithm", "DiLoCoAlgorithmImpl", "DILOCO_COMPRESSIONS", "fragment_syncs_at", "fragment_groups",
           "strided_fragment_groups", "layer_of", "FRAGMENT_PATTERNS", "outer_sgd_step_", "STREAMING_MERGE_ALPHA"]

DILOCO_COMPRESSIONS = (None, "fp16", "bf16", "minmax8", "minmax4")
_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"minmax8": 8, "minmax4": 4}
#: Streaming DiLoCo's mixing factor α (its Algorithm 2): θ_i ← α θ_i + (1 − α) θ_outer.
STREAMING_MERGE_ALPHA = 0.5


def fragment_syncs_at(step: int, fragment: int, fragments: int, sync_every: int) -> bool:
    """Whether fragment ``fragment`` of ``fragments`` synchronises after inner step
    ``step`` (from 1): (step − fragment·⌊H/F⌋) mod H = 0."""
    shifted = step - fragment * (sync_every // fragments)
    return shifted >= 0 and step >= 1 and shifted % sync_every == 0


#: How the parameters are cut into fragments: "strided" (Streaming DiLoCo's preferred) first.
FRAGMENT_PATTERNS = ("strided", "sequential")


def layer_of(name: str) -> str:
    """The layer a parameter named ``name`` belongs to: the name without its last dotted
    part (``"blocks.3.attn.weight"`` → ``"blocks.3.attn"``); a name with no dot is its
    own layer."""
    return name.rsplit(".", 1)[0] if "." in name else name


def strided_fragment_groups(layers: list, fragments: int) -> list:
    """Streaming DiLoCo's strided pattern: ``layers`` gives each tensor's layer (any
    hashable key, in bucket order); the distinct layers, numbered j = 0, 1, … in order of
    first appearance, go to fragment j mod F, and each group lists its tensors' indices
    in bucket order. F is capped at the number of layers (no fragment is empty)."""
    order = list(dict.fromkeys(layers))
    fragments = min(fragments, len(order))
    index = {layer: j % fragments for j, layer in enumerate(order)}
    groups = [[] for _ in range(fragments)]
    for i, layer in enumerate(layers):
        groups[index[layer]].append(i)
    return groups


def fragment_groups(numels: list, fragments: int) -> list:
    """``numels`` (tensor sizes, in bucket order) cut into ``fragments`` consecutive runs
    of whole tensors of about equal size: run f ends at the tensor boundary nearest to
    (f + 1)/F of the total, each run at least one tensor (fewer runs when there are
    fewer tensors than fragments)."""
    fragments = min(fragments, len(numels))
    total, groups, start, size = sum(numels), [], 0, 0
    for f in range(fragments):
        target = total * (f + 1) / fragments
        end = start + 1
        size += numels[start]
        last_end = len(numels) - (fragments - f - 1)  # leave a tensor to each later run
        while end < last_end and size + numels[end] / 2 <= target:
            size += numels[end]
            end += 1
        if f == fragments - 1:
            end = len(numels)
        groups.append(list(range(start, end)))
        start = end
    return groups


@torch.no_grad()
def outer_sgd_step_(outer: torch.Tensor, momentum: Optional[torch.Tensor], delta: torch.Tensor, lr: float,
                    mu: float, nesterov: bool, first: bool) -> None:
    """torch.optim.SGD's step on θ_outer with gradient Δ, in place (no dampening, no
    weight decay): b ← Δ at the first step, else μ b + Δ; d = Δ + μ b (Nesterov) or b
    (μ > 0) or Δ; θ_outer ← θ_outer − η d. ``momentum`` (b) may be None when μ = 0."""
    if mu == 0:
        outer.add_(delta, alpha=-lr)
        return
    if first:
        momentum.copy_(delta)
    else:
        momentum.mul_(mu).add_(delta)
    step = delta.add(momentum, alpha=mu) if nesterov else momentum
    outer.add_(step, alpha=-lr)


class DiLoCoAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """Per fragment, one bucket (``fragment<f>``) whose ``state`` holds θ_outer
    (``diloco_outer``), the outer momentum (``diloco_momentum``, with μ > 0) and how many outer steps
    it took (``diloco_outer_steps``), and with ``overlap`` the averaged Δ in flight
    (``diloco_pending``) and the step its outer step lands at (``diloco_due``, 0: none):
    checkpointed with the bucket, resumed exactly."""

    WORLD_SIZE_RULE = {
        "step counter": "carried over (so the synchronisation schedule goes on)",
        "outer model, outer momentum, outer steps": "carried over (the same on every rank, whatever n)",
        "averaged pseudo-gradient in flight and its step (overlap)":
            "carried over (the average is the same on every rank, whatever n)",
        "fragments": "rebuilt alike (they depend on the model only)",
    }

    def __init__(self, process_group, settings: "DiLoCoAlgorithm"):
        super().__init__(process_group)
        self.settings = settings
        self.bytes_total = 0  # what this worker handed to collectives (a worker's, on the engine too)
        self._in_flight: dict = {}  # bucket name -> the CommHandle of its Δ's allreduce (overlap)

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        flat = [t for group in tensors for t in group]
        if not flat:
            raise ValueError("DiLoCoAlgorithm: the module has no parameter that requires grad")
        # (a subclass's settings without the argument, SparseLoCo's one fragment: the default)
        if getattr(self.settings, "fragment_pattern", FRAGMENT_PATTERNS[0]) == "strided":
            groups = strided_fragment_groups([layer_of(t.bagua_tensor_name) for t in flat], self.settings.fragments)
        else:
            groups = fragment_groups([worker_numel(t) for t in flat], self.settings.fragments)  # a worker's sizes
        return [BaguaBucket([flat[i] for i in group], flatten=do_flatten, name=f"fragment{f}")
                for f, group in enumerate(groups)]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()  # no bucket ops: the outer step runs on the training thread after the inner step
        state = bucket.state
        weights = bucket.flat_view()
        if not (torch.is_tensor(state.get("diloco_outer")) and state["diloco_outer"].shape == weights.shape):
            # with_bagua broadcast the parameters before calling us: this is the common θ_outer
            state["diloco_outer"] = weights.detach().clone()
            state.pop("diloco_momentum", None)
            state["diloco_outer_steps"] = 0
        if self.settings.outer_momentum and not (torch.is_tensor(state.get("diloco_momentum"))
                                                 and state["diloco_momentum"].shape == weights.shape):
            state["diloco_momentum"] = torch.zeros_like(weights)  # (none without outer momentum)
        if self.settings.overlap and not (torch.is_tensor(state.get("diloco_pending"))
                                          and state["diloco_pending"].shape == weights.shape):
            state["diloco_pending"] = torch.zeros_like(weights)
            state["diloco_due"] = 0

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            step = bagua_ddp.bagua_train_step_counter
            settings = self.settings
            for f, bucket in enumerate(bagua_ddp.bagua_buckets):
                due = bucket.state.get("diloco_due", 0)
                if due and step >= due:  # (also a checkpoint's, resumed with overlap=0: merge_alpha 0 then)
                    self.finish_outer_step(bucket)
                if fragment_syncs_at(step, f, len(bagua_ddp.bagua_buckets), settings.sync_every):
                    if settings.overlap:
                        self.start_outer_step(bucket, step)
                    else:
                        self.outer_step(bucket)

        return hook

    @torch.no_grad()
    def outer_step(self, bucket: BaguaBucket) -> None:
        """Steps 1–4 on one fragment."""
        settings, state = self.settings, bucket.state
        weights = bucket.flat_view()
        outer = state["diloco_outer"]
        delta = outer - weights  # Δ_i, a worker's (a row each on the engine)
        self.bytes_total += self.average_pseudo_gradient(bucket, delta)
        outer_sgd_step_(outer, state.get("diloco_momentum"), delta, settings.outer_lr, settings.outer_momentum,
                        settings.nesterov, state["diloco_outer_steps"] == 0)
        state["diloco_outer_steps"] += 1
        weights.copy_(outer)
        bucket.write_flat(weights)

    @torch.no_grad()
    def start_outer_step(self, bucket: BaguaBucket, step: int) -> None:
        """Steps 1–2 on one fragment, the allreduce left running; its outer step and merge
        come after step ``step`` + τ (:meth:`finish_outer_step`)."""
        state = bucket.state
        delta = state["diloco_pending"]
        torch.sub(state["diloco_outer"], bucket.flat_view(), out=delta)  # Δ_i
        handle, sent = self._average(delta, async_op=True)
        self.bytes_total += sent
        self._in_flight[bucket.name] = handle
        state["diloco_due"] = step + self.settings.overlap

    @torch.no_grad()
    def finish_outer_step(self, bucket: BaguaBucket) -> None:
        """Waits for the fragment's averaged Δ, steps θ_outer on it (step 3) and merges
        (step 4'): θ_i ← α θ_i + (1 − α) θ_outer."""
        settings, state = self.settings, bucket.state
        handle = self._in_flight.pop(bucket.name, None)
        if handle is not None:
            handle.wait()
        outer = state["diloco_outer"]
        outer_sgd_step_(outer, state.get("diloco_momentum"), state["diloco_pending"], settings.outer_lr,
                        settings.outer_momentum, settings.nesterov, state["diloco_outer_steps"] == 0)
        state["diloco_outer_steps"] += 1
        state["diloco_due"] = 0
        weights = bucket.flat_view()
        weights.mul_(settings.merge_alpha).add_(outer, alpha=1.0 - settings.merge_alpha)
        bucket.write_flat(weights)

    def average_pseudo_gradient(self, bucket: BaguaBucket, delta: torch.Tensor) -> int:
        """Step 2 of :meth:`outer_step`: ``delta`` (this worker's Δ_i, a row each on the
        engine) becomes what the outer step applies, the mean over the workers; returns
        a worker's bytes. A subclass exchanging Δ otherwise (SparseLoCo) overrides it."""
        return self._average(delta)

    def wait_in_flight(self) -> None:
        """Wait for every fragment's allreduce in flight: its averaged Δ is then in
        ``diloco_pending`` (what a checkpoint saves)."""
        for handle in self._in_flight.values():
            handle.wait()

    def _average(self, delta: torch.Tensor, async_op: bool = False):
        """Δ ← mean_i Δ_i through the compression, in place; returns a worker's bytes, or
        with ``async_op`` (handle, bytes): ``delta`` holds the mean once the handle's
        ``wait()`` returns. The min-max codec runs its stages now (a done handle)."""
        compression = self.settings.compression
        if compression in _BITS:
            before = comm.bytes_sent()
            x = delta if delta.dtype == torch.float32 else delta.float()
            compressed_scatter_gather(x, _BITS[compression], True, self.process_group)
            if x is not delta:
                delta.copy_(x)
            sent = comm.bytes_sent() - before
            return (comm.CommHandle(), sent) if async_op else sent
        wire = delta if compression is None else delta.to(_CAST[compression])
        sent = wire.shape[-1] * wire.element_size()
        handle = comm.allreduce_inplace(wire, comm.ReduceOp.AVG, group=self.process_group, async_op=True)
        if wire is not delta:
            handle.then(lambda: delta.copy_(wire))  # back to the working dtype once the mean has arrived
        if async_op:
            return handle, sent
        handle.wait()
        return sent

    def on_detach(self, bagua_ddp: BaguaDistributedDataParallel) -> None:
        self.wait_in_flight()  # no collective of this module outlives its hooks

    def state_dict(self) -> dict:
        # The runtime saves this before cloning the buckets' state: the fragments in
        # flight land in their ``diloco_pending`` first.
        self.wait_in_flight()
        return {"bytes_total": self.bytes_total}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.wait_in_flight()  # what was in flight is replaced by the checkpoint's
        self._in_flight.clear()
        self.bytes_total = int(state.get("bytes_total", 0))


class DiLoCoAlgorithm(Algorithm):
    """DiLoCo (Douillard et al. 2023) and its streaming form.

    Args:
        sync_every: H, the inner steps between outer steps (an int >= 1).
        outer_lr: η of the outer SGD (> 0; DiLoCo's 0.7).
        outer_momentum: μ of the outer SGD, in [0, 1) (DiLoCo's 0.9).
        nesterov: Nesterov momentum in the outer step (DiLoCo's; needs μ > 0).
        fragments: F, the parameters cut into F fragments of whole layers, fragment f
            synchronised at steps f·⌊H/F⌋ + kH (Streaming DiLoCo; 1: all at once).
        fragment_pattern: ``"strided"`` (layer j to fragment j mod F: Streaming DiLoCo's
            preferred pattern, the default) or ``"sequential"`` (consecutive runs of whole
            tensors of about equal size). Only matters with ``fragments`` ≥ 2.
        overlap: τ, the inner steps between the start of a fragment's allreduce and its
            outer step (Streaming DiLoCo; 0: at once, plain DiLoCo). Less than
            ⌊sync_every / fragments⌋.
        merge_alpha: α of Streaming DiLoCo's merge θ_i ← α θ_i + (1 − α) θ_outer, in
            [0, 1], used with ``overlap`` ≥ 1 (None: the paper's 0.5); with overlap 0 the
            worker takes θ_outer and passing it is an error.
        compression: None, ``"fp16"``, ``"bf16"``, ``"minmax8"`` or ``"minmax4"``: how
            the pseudo-gradients travel (the module's notes).

    The user's optimizer is the inner one (AdamW in the paper, or SGD).
    """

    def __init__(self, sync_every: int = 500, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 nesterov: bool = True, fragments: int = 1, overlap: int = 0, merge_alpha=None, compression=None,
                 fragment_pattern: str = "strided"):
        self.sync_every = check_int("sync_every", sync_every, 1, what="the inner steps between outer steps, >= 1")
        self.outer_lr = check_real("outer_lr", outer_lr, 0.0, low_open=True, what="a finite number > 0 (DiLoCo: 0.7)")
        self.outer_momentum = check_real("outer_momentum", outer_momentum, 0.0, 1.0, high_open=True,
                                         what="a momentum in [0, 1) (DiLoCo: 0.9)")
        self.nesterov = check_flag("nesterov", nesterov)
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0 (as torch.optim.SGD); pass nesterov=False "
                             "with outer_momentum=0")
        self.fragments = check_int("fragments", fragments, 1, what="the number of fragments, >= 1")
        if self.fragments > self.sync_every:
            raise ValueError(f"fragments={self.fragments} staggers the fragments by ⌊H/F⌋ steps, so it must be at "
                             f"most sync_every={self.sync_every}")
        self.fragment_pattern = check_choice("fragment_pattern", fragment_pattern, FRAGMENT_PATTERNS)
        spacing = self.sync_every // self.fragments
        self.overlap = check_int("overlap", overlap, 0, spacing,
                                 what=f"an int >= 0 and < ⌊sync_every/fragments⌋ = {spacing} (the steps between two "
                                      "fragments' synchronisations: a fragment's outer step lands before the next "
                                      "fragment starts)")
        if merge_alpha is None:
            self.merge_alpha = STREAMING_MERGE_ALPHA if self.overlap else 0.0
        elif not self.overlap:
            raise ValueError(f"merge_alpha={merge_alpha!r} mixes the local parameters into the outer ones τ steps "
                             "after a synchronisation, so it needs overlap >= 1; with overlap=0 every worker takes "
                             "θ_outer (leave merge_alpha None)")
        else:
            self.merge_alpha = check_real("merge_alpha", merge_alpha, 0.0, 1.0,
                                          what="a number in [0, 1] (Streaming DiLoCo: 0.5; 0: take θ_outer)")
        self.compression = check_choice("compression", compression, DILOCO_COMPRESSIONS)

    def reify(self, process_group) -> DiLoCoAlgorithmImpl:
        return DiLoCoAlgorithmImpl(process_group, self)


register_algorithm(
    "diloco", DiLoCoAlgorithm,
    "DiLoCo: H inner steps, then an outer Nesterov SGD step on the averaged pseudo-gradient",
    rows=[
        # Inner steps apart, an outer Nesterov step every sync_every (short here, so short
        # runs synchronise); the streaming form with two fragments and 8-bit deltas.
        (300, AlgorithmConfig("diloco", "diloco", {"sync_every": 2}, replicas="drift")),
        (310, AlgorithmConfig("diloco_streaming_8bit", "diloco",
                              {"sync_every": 4, "fragments": 2, "compression": "minmax8"},
                              replicas="drift", tolerance=1e-3)),
        # Streaming DiLoCo's overlap: each fragment's outer step and merge one step after its sync.
        (320, AlgorithmConfig("diloco_streaming_overlap", "diloco", {"sync_every": 4, "fragments": 2, "overlap": 1},
                              replicas="drift")),
    ],
)
