"""How a comparison is trained: the optimizer, its learning-rate schedule and the quantity
reported — a training *protocol*, named after the paper whose code it follows.

A comparison between algorithms is decided as much by its protocol as by the algorithms:
on the sweep's 16-worker digits task, RelaySum/Grad moves by 30 points between heavy-ball
SGD at a constant rate and the RelaySum paper's Nesterov SGD with warm-up and step decay
(docs/results.md). So every run of the sweep and of ``reproduce`` trains under a named
:class:`Protocol`, prints it in its first lines and records it (``results.json``,
``runs.jsonl``, the CSVs), and a number set beside a paper's is trained under that
paper's protocol and reports that paper's quantity first.

The named protocols (:data:`PROTOCOLS`), each following its paper's code:

- ``heavy_ball``: SGD with heavy-ball momentum 0.9 at a constant rate, weight decay
  1e-4 on every parameter, the workers' mean accuracy: the project's own protocol until
  the papers' were added; none of the papers trains this way.
- ``relaysum``: the RelaySum paper (Vogels et al. 2021), epfml/relaysgd —
  ``base_optimizers.py``: ``torch.optim._functional.sgd(..., momentum=0.9,
  dampening=0.0, nesterov=True)``; ``tasks/cifar.py``: weight decay 1e-4 added to the
  gradient, 0 for batch-norm parameters; ``algorithms.py:learning_rate_schedule``: the
  rate rises linearly from 0 over 5 epochs (with more than one worker), then ×0.1 at
  epochs 150 and 180 of ``train.py``'s 200; ``paper-figures/table_2_cifar_results.ipynb``:
  each worker's test accuracy averaged over the epochs after 195, the minimum over the
  workers (then the mean over seeds, which the callers take).
- ``relaysum_no_momentum``: the same with momentum 0, Table 2's other half.
- ``powersgd``: the PowerSGD paper (Vogels et al. 2019), epfml/powersgd
  ``paper-code/train.py``: momentum 0.9 of the type "nesterov", which that file applies
  as ``grad += momentum`` after ``momentum = 0.9 * momentum + grad`` — a step along
  g + m, not torch's g + 0.9 m (:class:`PaperNesterovSGD`); weight decay 1e-4, 0 for
  batch-norm parameters, added after the reduction (as torch's SGD adds it); the rate
  warmed up linearly over 5 epochs from the one-worker rate to ``workers`` times it,
  /10 at epochs 150 and 250 of 300; the test accuracy of the (common) model.
- ``diloco``: DiLoCo (Douillard et al. 2023), Section 3: the inner optimizer AdamW
  (β = (0.9, 0.999), weight decay 0.1) under a linear warm-up then a cosine decay
  (1,000 warm-up steps of 88,000); the outer step is the algorithm's own.

Warm-up and milestones of a named protocol are given in the epochs of its paper's run
(``reference_epochs``) and scale with the run's length (:meth:`Protocol.at_epochs`), so
that a 30-epoch proxy decays where the paper's 200-epoch run does, in proportion. A
user's own schedule is a callable ``lr_at(epoch, step)`` (:attr:`Protocol.lr_at`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

__all__ = ["Protocol", "PROTOCOLS", "QUANTITIES", "PaperNesterovSGD", "protocol_named", "norm_parameter_names",
           "quantity_field", "tail_accuracy"]

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "step", "cosine")
WARMUP_STARTS = ("zero", "one_worker")
NESTEROV_FORMS = ("torch", "g_plus_m")
QUANTITIES = {
    # the quantity a protocol reports first and tunes on -> the run record's field
    "workers_mean": "final_mean_worker_accuracy",
    "worst_worker_tail": "final_worst_worker_tail_accuracy",
    "averaged_model": "final_averaged_model_accuracy",
}
QUANTITY_TEXT = {
    "workers_mean": "the workers' own models' test accuracy, mean over workers (last epoch)",
    "worst_worker_tail": "the worst worker: each worker's test accuracy averaged over the last {tail} of epochs, "
                         "the minimum over workers",
    "averaged_model": "the averaged model (1/n) sum x_i's test accuracy (last epoch)",
}


@dataclass(frozen=True)
class Protocol:
    """A training protocol: the optimizer, the schedule of its rate, the reported quantity.

    The learning rate itself (a grid, or one value) is not part of it: the caller tunes
    it, and the schedule multiplies it (:meth:`lr_factor`).
    """

    name: str = "custom"
    source: str = ""  # the file(s) of the paper's code it follows
    optimizer: str = "sgd"  # "sgd" (torch.optim.SGD, or PaperNesterovSGD) or "adamw"
    momentum: float = 0.9  # SGD momentum (0: plain SGD)
    nesterov: bool = False
    nesterov_form: str = "torch"  # "torch": step g + β m; "g_plus_m": step g + m (epfml/powersgd's code)
    dampening: float = 0.0
    weight_decay: float = 1e-4  # SGD: β-free L2 added to the gradient; AdamW: decoupled
    decay_norm: bool = True  # weight decay on normalisation layers' parameters too (the papers: no)
    adam_betas: tuple = (0.9, 0.999)
    schedule: str = "constant"  # "constant", "step" (× decay_factor at each milestone) or "cosine"
    warmup_epochs: float = 0.0  # linear warm-up, in epochs (of reference_epochs when that is set)
    warmup_start: str = "zero"  # "zero": from 0 (RelaySum); "one_worker": from lr / workers (PowerSGD)
    milestones: tuple = ()  # step schedule: epochs at which the rate is multiplied by decay_factor
    decay_factor: float = 0.1
    cosine_final: float = 0.0  # cosine schedule: the last rate as a fraction of the peak
    reference_epochs: int | None = None  # the paper's run length, in which warm-up and milestones are given
    quantity: str = "workers_mean"  # a key of QUANTITIES: reported first, tuned on
    tail_fraction: float = 0.0  # worst_worker_tail: the last fraction of epochs averaged per worker
    lr_at: Callable | None = field(default=None, compare=False)  # a user's own lr_at(epoch, step), in place of the schedule

    def __post_init__(self):
        def bad(argument, value, valid):
            raise ValueError(f"Protocol {argument}={value!r}: expected {valid}")

        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", self.optimizer, f"one of {list(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            bad("schedule", self.schedule, f"one of {list(SCHEDULES)}")
        if self.warmup_start not in WARMUP_STARTS:
            bad("warmup_start", self.warmup_start, f"one of {list(WARMUP_STARTS)}")
        if self.nesterov_form not in NESTEROV_FORMS:
            bad("nesterov_form", self.nesterov_form, f"one of {list(NESTEROV_FORMS)}")
        if self.quantity not in QUANTITIES:
            bad("quantity", self.quantity, f"one of {list(QUANTITIES)}")
        for argument in ("momentum", "dampening"):
            value = getattr(self, argument)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                bad(argument, value, "a number in [0, 1)")
        for argument in ("weight_decay", "warmup_epochs"):
            value = getattr(self, argument)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                bad(argument, value, "a finite number >= 0")
        if not (0 < self.decay_factor <= 1):
            bad("decay_factor", self.decay_factor, "a number in (0, 1]")
        if not (0 <= self.cosine_final <= 1):
            bad("cosine_final", self.cosine_final, "a number in [0, 1]")
        if not (0 <= self.tail_fraction < 1):
            bad("tail_fraction", self.tail_fraction, "a number in [0, 1)")
        if any(not (isinstance(m, (int, float)) and m > 0) for m in self.milestones) or \
                list(self.milestones) != sorted(self.milestones):
            bad("milestones", self.milestones, "increasing positive epochs")
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            bad("nesterov", self.nesterov, "False with momentum 0 or dampening > 0 (Nesterov needs momentum > 0 and "
                "dampening 0)")
        if self.optimizer == "adamw" and (self.momentum != 0.9 or self.nesterov):
            bad("optimizer", self.optimizer, "'sgd' with momentum/nesterov; AdamW's momentum is adam_betas[0]")
        if self.reference_epochs is not None and not (isinstance(self.reference_epochs, int) and self.reference_epochs > 0):
            bad("reference_epochs", self.reference_epochs, "None or a positive integer")
        if self.lr_at is not None and not callable(self.lr_at):
            bad("lr_at", self.lr_at, "None or a callable lr_at(epoch, step) -> learning rate")

    # ------------------------------------------------------------------ the schedule

    def with_(self, **changes) -> "Protocol":
        return replace(self, **changes)

    def at_epochs(self, epochs: int) -> "Protocol":
        """This protocol for a run of ``epochs`` epochs: warm-up and milestones given in
        the paper's ``reference_epochs`` scaled by ``epochs / reference_epochs`` (and
        ``reference_epochs`` cleared); unchanged when it has none."""
        if self.reference_epochs is None:
            return self
        scale = epochs / self.reference_epochs
        return replace(self, warmup_epochs=self.warmup_epochs * scale,
                       milestones=tuple(m * scale for m in self.milestones), reference_epochs=None)

    def lr_factor(self, epoch: float, epochs: int, workers: int = 1) -> float:
        """The schedule's multiplier of the peak rate at ``epoch`` (epochs done, a float)
        of a run of ``epochs`` epochs on ``workers`` workers:

        1. warm-up (``epoch < w``): linear from 0 (``"zero"``) or from 1/workers
           (``"one_worker"``) to 1 (RelaySum's code skips its warm-up on one worker;
           a comparison here always has several);
        2. ``"step"``: × decay_factor for every milestone ≤ epoch;
           ``"cosine"``: after the warm-up, c + (1 − c)(1 + cos(π p)) / 2 with p the
           fraction of the post-warm-up epochs done and c = ``cosine_final``;
           ``"constant"``: 1.
        """
        p = self.at_epochs(epochs)
        w = p.warmup_epochs
        if w > 0 and epoch < w:
            start = 0.0 if p.warmup_start == "zero" else 1.0 / workers
            return start + (1.0 - start) * epoch / w
        return _after_warmup(p, epoch, epochs)

    def schedule_for(self, lr: float, epochs: int, steps_per_epoch: int, workers: int) -> Callable[[int, int], float]:
        """``lr_at(epoch, step)`` of a run (what the training loop calls before each step):
        the user's own :attr:`lr_at` if given, else ``lr`` times :meth:`lr_factor` at
        ``epoch + step / steps_per_epoch``."""
        if self.lr_at is not None:
            return self.lr_at
        per_epoch = max(1, steps_per_epoch)
        return lambda epoch, step: lr * self.lr_factor(epoch + step / per_epoch, epochs, workers)

    # ------------------------------------------------------------------ the optimizer

    def optimizer_for(self, module: torch.nn.Module, lr: float) -> Callable:
        """``factory(params) -> optimizer`` for ``module``'s trainable parameters in
        ``named_parameters()`` order (a job's ``model.parameters()``, or the engine's
        stacked ``[n, *shape]`` views in the same order): with ``decay_norm`` False the
        normalisation layers' parameters go in a group without weight decay."""
        names = [name for name, p in _unique_named_parameters(module) if p.requires_grad]
        no_decay = set() if self.decay_norm else norm_parameter_names(module)

        def factory(params):
            params = list(params)
            if no_decay and len(params) != len(names):
                raise ValueError(f"the optimizer got {len(params)} parameters and the model has {len(names)} "
                                 "trainable ones: pass them all, in named_parameters() order")
            groups = [{"params": params}] if not no_decay else [
                {"params": [p for n, p in zip(names, params) if n not in no_decay]},
                {"params": [p for n, p in zip(names, params) if n in no_decay], "weight_decay": 0.0}]
            groups = [g for g in groups if g["params"]]
            if self.optimizer == "adamw":
                return torch.optim.AdamW(groups, lr=lr, betas=tuple(self.adam_betas), weight_decay=self.weight_decay)
            if self.nesterov and self.nesterov_form == "g_plus_m":
                return PaperNesterovSGD(groups, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)
            return torch.optim.SGD(groups, lr=lr, momentum=self.momentum, dampening=self.dampening,
                                   nesterov=self.nesterov, weight_decay=self.weight_decay)

        return factory

    # ------------------------------------------------------------------ the record

    @property
    def quantity_field(self) -> str:
        return QUANTITIES[self.quantity]

    def to_dict(self) -> dict:
        """Every knob, JSON-ready (a user's ``lr_at`` by its qualified name)."""
        d = asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        d["milestones"] = list(self.milestones)
        d["lr_at"] = None if self.lr_at is None else getattr(self.lr_at, "__qualname__", repr(self.lr_at))
        return d

    def describe(self, epochs: int | None = None) -> str:
        """One line: the optimizer, the schedule (in this run's epochs when given), the quantity."""
        p = self if epochs is None else self.at_epochs(epochs)
        if p.optimizer == "adamw":
            opt = f"AdamW betas {tuple(p.adam_betas)}, weight decay {p.weight_decay:g} (decoupled)"
        elif p.momentum == 0:
            opt = f"SGD without momentum, weight decay {p.weight_decay:g}"
        else:
            kind = ("Nesterov (step g + m, as epfml/powersgd's code)" if p.nesterov_form == "g_plus_m" else "Nesterov") \
                if p.nesterov else "heavy-ball"
            opt = f"SGD {kind} momentum {p.momentum:g}" + (f" dampening {p.dampening:g}" if p.dampening else "") + \
                  f", weight decay {p.weight_decay:g}"
        if p.weight_decay and not p.decay_norm:
            opt += " (0 on normalisation layers)"
        unit = "" if p.reference_epochs is None else f" of {p.reference_epochs}"
        if p.lr_at is not None:
            sched = f"the user's lr_at {to_name(p.lr_at)}"
        else:
            parts = []
            if p.warmup_epochs:
                start = "0" if p.warmup_start == "zero" else "lr/workers"
                parts.append(f"linear warm-up from {start} over {p.warmup_epochs:g} epochs{unit}")
            if p.schedule == "step" and p.milestones:
                parts.append(f"x{p.decay_factor:g} at epochs {', '.join(f'{m:g}' for m in p.milestones)}{unit}")
            elif p.schedule == "cosine":
                parts.append(f"cosine decay to {p.cosine_final:g} x lr")
            sched = ", then ".join(parts) if parts else "constant rate"
        quantity = QUANTITY_TEXT[p.quantity].format(tail=f"{100 * p.tail_fraction:g}%")
        return f"protocol {p.name}: {opt}; {sched}; reports {quantity}"


def to_name(fn) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _after_warmup(p: Protocol, epoch: float, epochs: int) -> float:
    if p.schedule == "step":
        return p.decay_factor ** sum(epoch >= m for m in p.milestones)
    if p.schedule == "cosine":
        span = max(epochs - p.warmup_epochs, 1e-12)
        done = min(max((epoch - p.warmup_epochs) / span, 0.0), 1.0)
        return p.cosine_final + (1 - p.cosine_final) * 0.5 * (1 + math.cos(math.pi * done))
    return 1.0


def _unique_named_parameters(module: torch.nn.Module):
    seen = set()
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p


NORM_LAYERS = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm)


def norm_parameter_names(module: torch.nn.Module) -> set:
    """The names of the normalisation layers' parameters (batch, instance, group and
    layer norm): the papers' code keeps them out of weight decay (epfml/relaysgd
    tasks/cifar.py, epfml/powersgd paper-code/train.py: ``optimizer_weight_decay_bn``)."""
    names = set()
    for prefix, sub in module.named_modules():
        if isinstance(sub, NORM_LAYERS):
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in sub.named_parameters(recurse=False))
    return names


class PaperNesterovSGD(torch.optim.Optimizer):
    """SGD with the momentum that epfml/powersgd's ``paper-code/train.py`` calls
    "nesterov", for every parameter p with gradient g (elementwise, so on the engine's
    stacked parameters it is every worker's own):

    1. g ← g + λ p  (weight decay, after the reduction, as that file adds it);
    2. m ← β m + g  (m starts at 0, so m = g at the first step, as the file's
       ``momentum.data = grad.clone()``);
    3. p ← p − η (g + m)  (``replace_grad_by_momentum``: ``grad += momentum``).

    torch's Nesterov steps along g + β m instead; at a constant gradient this one is
    (2 − β)/(1 − β)·g = 11 g a step against torch's 10 g (β = 0.9).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0):
        if not (lr > 0 and 0 <= momentum < 1 and weight_decay >= 0):
            raise ValueError(f"PaperNesterovSGD: lr > 0, 0 <= momentum < 1, weight_decay >= 0; got lr={lr}, "
                             f"momentum={momentum}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if group["weight_decay"] == 0 else p.grad.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                m = state.get("momentum_buffer")
                if m is None:
                    m = state["momentum_buffer"] = g.clone()
                else:
                    m.mul_(group["momentum"]).add_(g)
                p.add_(g + m, alpha=-group["lr"])
        return loss


RELAYSUM_SOURCE = ("epfml/relaysgd: base_optimizers.py (SGD nesterov=True, dampening 0), tasks/cifar.py (weight "
                   "decay added to the gradient, 0 for batch norm), algorithms.py learning_rate_schedule, train.py, "
                   "paper-figures/table_2_cifar_results.ipynb (the worst worker)")
PROTOCOLS = {
    "heavy_ball": Protocol(
        "heavy_ball", "the project's own protocol before the papers' (no paper trains this way)",
        momentum=0.9, weight_decay=1e-4),
    "relaysum": Protocol(
        "relaysum", RELAYSUM_SOURCE, momentum=0.9, nesterov=True, weight_decay=1e-4, decay_norm=False,
        schedule="step", warmup_epochs=5, warmup_start="zero", milestones=(150, 180), decay_factor=0.1,
        reference_epochs=200, quantity="worst_worker_tail", tail_fraction=0.025),
    "relaysum_no_momentum": Protocol(
        "relaysum_no_momentum", RELAYSUM_SOURCE + "; momentum 0 (Table 2's rows without momentum)", momentum=0.0,
        weight_decay=1e-4, decay_norm=False, schedule="step", warmup_epochs=5, warmup_start="zero",
        milestones=(150, 180), decay_factor=0.1, reference_epochs=200, quantity="worst_worker_tail",
        tail_fraction=0.025),
    "powersgd": Protocol(
        "powersgd", "epfml/powersgd paper-code/train.py (config, get_learning_rate, replace_grad_by_momentum, "
                    "get_weight_decay)",
        momentum=0.9, nesterov=True, nesterov_form="g_plus_m", weight_decay=1e-4, decay_norm=False,
        schedule="step", warmup_epochs=5, warmup_start="one_worker", milestones=(150, 250), decay_factor=0.1,
        reference_epochs=300, quantity="workers_mean"),
    "diloco": Protocol(
        "diloco", "DiLoCo (Douillard et al. 2023), Section 3 and Table 5: inner AdamW, weight decay 0.1, linear "
                  "warm-up (1,000 of 88,000 steps) then cosine decay",
        optimizer="adamw", weight_decay=0.1, schedule="cosine", warmup_epochs=1, reference_epochs=88,
        warmup_start="zero", quantity="workers_mean"),
}


def protocol_named(name: str) -> Protocol:
    """The named protocol; a ValueError naming the valid names otherwise."""
    try:
        return PROTOCOLS[name]
    except (KeyError, TypeError):
        raise ValueError(f"protocol {name!r} is not known; valid: {', '.join(PROTOCOLS)}") from None


def quantity_field(protocol: Protocol | None) -> str:
    return QUANTITIES["workers_mean" if protocol is None else protocol.quantity]


def tail_accuracy(worker_accuracy: list, tail_fraction: float) -> float:
    """The worst worker of RelaySum's Table 2: each worker's accuracy averaged over the
    epochs e (1-based, of E recorded) with e > (1 − tail_fraction)·E — at least the
    last — then the minimum over workers. ``worker_accuracy``: per epoch, every worker's."""
    if not worker_accuracy:
        return float("nan")
    epochs = len(worker_accuracy)
    first = min(int(math.floor((1 - tail_fraction) * epochs + 1e-9)), epochs - 1)  # 0-based start of e > (1-f) E
    tail = worker_accuracy[first:]
    workers = len(tail[0])
    return min(sum(epoch[i] for epoch in tail) / len(tail) for i in range(workers))
