"""QAdam: Adam whose momentum is averaged through 8-bit compression (Bagua's ``qadam``).

Two phases, switched once the optimizer has taken ``warmup_steps`` steps:

- warm-up (step s < warmup_steps): the gradients are averaged exactly (allreduce) and
  :class:`QAdamOptimizer` is Adam: m ← β1 m + (1−β1) g, v ← β2 v + (1−β2) g²,
  x ← x − lr/(1−β1^s) · m / (√(v/(1−β2^s)) + eps);
- compression (s ≥ warmup_steps): v is frozen; each worker updates its momentum with
  its *local* gradient, m_i ← β1 m + (1−β1) g_i, and the momenta are averaged through
  Bagua's MinMaxUInt8 scatter-gather (8 bits), m ← ≈ (1/n) Σ_i m_i; the optimizer then
  applies the same Adam update with that m.

``variant`` chooses between two updates:

- ``"bagua"`` (the default): Bagua 0.9.2's update, number for number: the bias
  correction 1−β2^s keeps following the step count after the warm-up, and
  ``weight_decay`` is applied during the warm-up only (the optimizer's own Adam
  update adds wd·x to the gradient; the compression phase's momentum takes the raw
  gradient, as Bagua's Python op does; a warning says so).
- ``"frozen"``: v̂ = v/(1−β2^s) is frozen with v, its bias correction staying at the
  last warm-up step, and ``weight_decay`` is applied as an L2 term, g ← g + wd·x. With
  Bagua's update 1−β2^s keeps growing towards 1 after a short warm-up, so v̂ shrinks and
  the step grows by up to 1/√(1−β2^W) (×7 after W = 20 steps at β2 = 0.999); the frozen
  form keeps Adam's step size (docs/benchmarks.md, "QAdam: Bagua's update and the
  frozen one").

As in Bagua 0.9, the algorithm rebuilds its buckets when the switch happens
(``need_reset``): in warm-up the Bagua tensors are the parameters with the gradient as
effective tensor, in compression the parameters with ``optimizer.state[p]["exp_avg"]``
as effective tensor (flattened into the bucket), and a Python op computes the momentum
before the compressed average. Unlike Bagua, the reset fires whenever the phase the
buckets were built for differs from the optimizer's (not only at step ==
warmup_steps), so a run resumed past the warm-up from a checkpoint compresses too.
Everything needed to resume is the optimizer's own state (``optimizer.state_dict()``).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Tuple

import torch
from torch.optim.optimizer import Optimizer

from ..arguments import check_choice, check_flag, check_int, check_real
from ..runtime.algorithm import Algorithm, AlgorithmImpl, BackwardHook
from ..runtime.bucket import aligned_buckets
from .table import AlgorithmConfig, OwnOptimizer, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["QAdamOptimizer", "QAdamAlgorithm", "QAdamAlgorithmImpl", "in_compression", "local_momentum_"]



def in_compression(optimizer_steps: int, warmup_steps: int) -> bool:
    """The phase of a training step whose optimizer has taken ``optimizer_steps`` steps
    before it: the momentum is compressed once warmup_steps of them are done (the
    step of count warmup_steps itself still averages gradients exactly, and its
    optimizer step leaves m and v as they are)."""
    return optimizer_steps >= warmup_steps


def local_momentum_(exp_avg: torch.Tensor, grad: torch.Tensor, param: torch.Tensor, beta1: float,
                    weight_decay: float) -> torch.Tensor:
    """A worker's own momentum in the compression phase, in place:
    m ← β1 m + (1 − β1)(g + wd·x) (wd = 0 in Bagua's variant). Elementwise, so stacked
    workers' rows give each worker's own."""
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    return exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)


class QAdamOptimizer(Optimizer):
    """The optimizer of QAdam (Bagua's arguments and defaults).

    Args:
        params: parameters or parameter groups.
        lr: learning rate (>= 0).
        warmup_steps: the momentum is compressed from optimizer step warmup_steps
            on; steps before it average gradients exactly and run full Adam (an int
            >= 2: v is estimated during those steps only, so give it enough of them;
            Bagua accepts 1, which leaves v at zero).
        betas: (β1, β2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty added to the gradient (>= 0): during the warm-up
            in both variants; in the compression phase by ``"frozen"`` only (Bagua's
            momentum op takes the raw gradient).
        variant: ``"bagua"`` (Bagua 0.9.2's update, the default) or ``"frozen"`` (v̂
            and its bias correction frozen after the warm-up; weight decay applied):
            see the module's documentation.
    """

    VARIANTS = ("bagua", "frozen")

    def __init__(self, params, lr: float = 1e-3, warmup_steps: int = 100,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 variant: str = "bagua"):
        check_real("lr", lr, 0.0)
        check_real("eps", eps, 0.0)
        check_real("weight_decay", weight_decay, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), each in [0, 1), got {betas!r}")
        check_real("betas[0]", betas[0], 0.0, 1.0, high_open=True)
        check_real("betas[1]", betas[1], 0.0, 1.0, high_open=True)
        warmup_steps = check_int("warmup_steps", warmup_steps, 2, what=(
            "an int >= 2 (v is estimated on steps 1 .. warmup_steps - 1 only; with fewer Adam would divide by eps)"))
        variant = check_choice("variant", variant, self.VARIANTS)
        if variant == "bagua" and weight_decay > 0:
            warnings.warn(
                f"QAdamOptimizer(weight_decay={weight_decay}) with variant='bagua' applies the weight decay during the "
                "warm-up only, as Bagua 0.9's QAdam does; pass variant='frozen' to apply it after the warm-up too",
                UserWarning, stacklevel=2)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.warmup_steps = warmup_steps
        self.variant = variant

    def _decay(self, group) -> float:
        """The L2 coefficient the compression phase's momentum applies to this group's
        gradients (the warm-up's Adam update always applies ``weight_decay``)."""
        return group["weight_decay"] if self.variant == "frozen" else 0.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # Adam's update as a few _foreach ops per run of parameters with one step
            # count, device and dtype, instead of ~8 ops per parameter (the test
            # test_qadam_foreach_step_equals_the_per_parameter_loop_bit_for_bit holds
            # it to the loop one parameter at a time).
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            runs: dict = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                runs.setdefault((state["step"], param.device, param.dtype), []).append(param)
            for (step, _, _), params in runs.items():
                exp_avg = [self.state[p]["exp_avg"] for p in params]
                exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
                if step < self.warmup_steps:
                    grads = [p.grad for p in params]
                    if wd != 0:
                        grads = torch._foreach_add(grads, params, alpha=wd)
                    torch._foreach_mul_(exp_avg, beta1)
                    torch._foreach_add_(exp_avg, grads, alpha=1 - beta1)
                    torch._foreach_mul_(exp_avg_sq, beta2)
                    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - beta2)
                # After the warm-up exp_avg is the compressed average the algorithm made
                # and v is frozen; "frozen" freezes v̂ too (its bias correction stays at
                # the last update), Bagua's keeps correcting by the step count.
                v_step = min(step, self.warmup_steps - 1) if self.variant == "frozen" else step
                denom = torch._foreach_sqrt(exp_avg_sq)
                torch._foreach_div_(denom, math.sqrt(1 - beta2 ** v_step))
                torch._foreach_add_(denom, eps)
                torch._foreach_addcdiv_(params, exp_avg, denom, value=-lr / (1 - beta1 ** step))
        return loss

class QAdamAlgorithmImpl(AlgorithmImpl):
    finds_parameters_in_the_optimizer = True  # (its own optimizer's param groups: the tensors it compresses)

    WORLD_SIZE_RULE = {
        "step counter": "carried over",
        "momentum and variance (the optimizer's state)": "carried over (the checkpoint helper loads the first "
                                                          "rank's on every rank)",
        "buckets": "rebuilt for the new world size (one chunk per worker)",
    }

    def __init__(self, process_group, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        super().__init__(process_group)
        self.optimizer = q_adam_optimizer
        self.hierarchical = hierarchical
        self.warmup_steps = q_adam_optimizer.warmup_steps
        self._compressing = None  # the phase the buckets were built for

    @property
    def optimizer_step_id(self) -> int:
        """Steps the optimizer has taken (its first parameter's count)."""
        param = self.optimizer.param_groups[0]["params"][0]
        return int(self.optimizer.state[param].get("step", 0))

    def _in_compression(self) -> bool:
        return in_compression(self.optimizer_step_id, self.warmup_steps)

    def need_reset(self) -> bool:
        return self._compressing is not None and self._compressing != self._in_compression()

    def init_tensors(self, bagua_ddp: BaguaDistributedDataParallel) -> list:
        module_params = bagua_ddp.bagua_build_params()
        names = {id(p): name for name, p in module_params}
        order = {id(p): index for index, (_, p) in enumerate(reversed(module_params))}
        self._compressing = self._in_compression()
        optimizer = self.optimizer
        tensors = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in names:
                    continue
                if not self._compressing:
                    tensor = param.bagua_ensure_grad().ensure_bagua_tensor(
                        names[id(param)], bagua_ddp.bagua_module_name,
                        getter_closure=lambda p: p.grad,
                        setter_closure=lambda p, t: setattr(p, "grad", t),
                    )
                else:
                    def set_momentum(p, t):
                        optimizer.state[p]["exp_avg"] = t

                    tensor = param.bagua_ensure_grad().ensure_bagua_tensor(
                        names[id(param)], bagua_ddp.bagua_module_name,
                        getter_closure=lambda p: optimizer.state[p]["exp_avg"],
                        setter_closure=set_momentum,
                    )
                tensors.append(tensor)
        missing = [name for name, p in module_params if not any(p is t for t in tensors)]
        if missing:
            raise ValueError(
                f"QAdamAlgorithm: parameters {missing} are not in the QAdamOptimizer given to QAdamAlgorithm; "
                "build the QAdamOptimizer from all of the module's trainable parameters"
            )
        tensors.sort(key=lambda t: order[id(t)])
        self._names = set(names.values())
        return tensors

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        return aligned_buckets(tensors, do_flatten, self.world_size)  # one chunk per worker

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if not self._compressing:
            bucket.append_centralized_synchronous_op(hierarchical=False, average=True, group=self.process_group)
            return

        def calculate_momentum(bucket_name):
            # m_i ← β1 m + (1 − β1)(g_i + wd·x), the worker's own momentum, then averaged
            # (wd = 0 after the warm-up in Bagua's variant).
            with torch.no_grad():
                for tensor in bucket.tensors:
                    group = self._group_of[id(tensor)]
                    local_momentum_(tensor.bagua_getter_closure(), tensor.grad, tensor, group["betas"][0],
                                    self.optimizer._decay(group))

        self._group_of = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        bucket.append_python_op(calculate_momentum, group=self.process_group)
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=True, scattergather=True,
            compression="MinMaxUInt8", group=self.process_group,
        )

    def init_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> BackwardHook:
        def hook(parameter_name, parameter):
            if parameter_name in self._names:
                parameter.bagua_mark_communication_ready()

        return hook


class QAdamAlgorithm(Algorithm):
    """Bagua's QAdam: exact gradient averaging during the optimizer's warm-up, then the
    Adam momentum averaged through 8-bit min-max compression.

    Args:
        q_adam_optimizer: the :class:`QAdamOptimizer` built from the module's parameters
            (give the same optimizer to ``with_bagua``).
        hierarchical: average exactly within each node, compress between nodes
            (Bagua's default: True).
    """

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        if not isinstance(q_adam_optimizer, QAdamOptimizer):
            raise TypeError(
                f"q_adam_optimizer must be a QAdamOptimizer (bagua.torch_api.algorithms.q_adam.QAdamOptimizer), "
                f"got {type(q_adam_optimizer).__name__}"
            )
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.optimizer = q_adam_optimizer

    def reify(self, process_group) -> QAdamAlgorithmImpl:
        return QAdamAlgorithmImpl(process_group, q_adam_optimizer=self.optimizer, hierarchical=self.hierarchical)

    _GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")

    def for_parameters(self, module: torch.nn.Module, params: list, optimizer_factory) -> tuple:
        """(the algorithm, its optimizer) for other tensors standing for ``module``'s
        parameters (the one-process engine's stacked ones, ``params`` in the module's
        order): QAdam owns its optimizer, so the engine takes no other; this is a
        QAdamOptimizer with the same settings, on ``params``."""
        if optimizer_factory is not None:
            raise ValueError(
                "optimizer: QAdam's optimizer is the QAdamOptimizer inside QAdamAlgorithm (the engine stacks its "
                "settings); pass optimizer=None with qadam")
        user = self.optimizer
        if any(len(state) for state in user.state.values()):
            raise ValueError("q_adam_optimizer has already taken steps; the engine starts QAdam from step 0, so give "
                             "it a QAdamOptimizer that has not stepped")
        in_optimizer = {id(p) for group in user.param_groups for p in group["params"]}
        missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in in_optimizer]
        if missing:
            raise ValueError(
                f"QAdamAlgorithm: parameters {missing} are not in the QAdamOptimizer given to QAdamAlgorithm; "
                "build the QAdamOptimizer from all of the module's trainable parameters")
        settings = [{key: group[key] for key in self._GROUP_SETTINGS} for group in user.param_groups]
        if any(s != settings[0] for s in settings[1:]):
            raise ValueError(
                f"q_adam_optimizer has parameter groups with different settings {settings}; the engine's stacked "
                "QAdam takes one setting of (lr, betas, eps, weight_decay) for the whole model")
        with warnings.catch_warnings():  # the user's optimizer already warned about its settings
            warnings.simplefilter("ignore", UserWarning)
            optimizer = QAdamOptimizer(params, warmup_steps=user.warmup_steps, variant=user.variant, **settings[0])
        return QAdamAlgorithm(optimizer, hierarchical=self.hierarchical), optimizer


register_algorithm(
    "qadam", QAdamAlgorithm,
    "Adam with exact warm-up, then the momentum averaged through 8-bit compression (Bagua's QAdam)",
    # Built on its own QAdamOptimizer, which the row builds (AlgorithmConfig.optimizer_for).
    rows=[(290, AlgorithmConfig("qadam", "qadam", tolerance=1e-3,
                                own_optimizer=OwnOptimizer(QAdamOptimizer, {"lr": 0.01, "warmup_steps": 2},
                                                           "q_adam_optimizer")))],
)
