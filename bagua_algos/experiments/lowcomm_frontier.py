"""``reproduce lowcomm-frontier``: the low-communication algorithms compared at equal bytes.

For each of two budgets of bytes per step (a worker's, measured: 1/20 and 1/100 of what
gradient allreduce hands to its collectives a step), every method is configured so that
its measured bytes per step come as close to the budget as its knobs allow, and trained
on the same task, seeds and protocol:

- DiLoCo: H = the allreduce's bytes per synchronisation / the budget (fp32 deltas);
- Streaming DiLoCo with 4-bit deltas: two fragments, the min-max codec at 4 bits,
  H from its measured bytes per synchronisation, an overlap of one step where the
  fragments' spacing allows it (⌊H/2⌋ ≥ 2) and the paper's merge (α = 0.5);
- SparseLoCo: 2-bit values, chunks of 64; H chosen so that the density the budget
  leaves is nearest 5 % (its paper runs 1–3 %; at these budgets and run lengths a
  density that low needs H < 1 or H past a run's synchronisations), the density then
  solved from its measured bytes;
- DeMo: chunks of 64, ``topk`` (coefficients a chunk and step) solved from its measured
  bytes (interpolated between measured values, then measured again);
- SPARTA: the share of the parameters averaged a step, ``fraction`` = budget / the
  allreduce's bytes;
- and the synchronous baseline, gradient allreduce, at its own bytes (the same row for
  both budgets).

Bytes are measured, never estimated: each configuration runs in its per-rank form on two
gloo workers (``comm.bytes_sent``) for one whole period of its schedule (H steps: one
synchronisation of every fragment), the larger worker's count divided by the steps.

The protocol is DiLoCo's (``protocol "diloco"``: inner AdamW, weight decay 0.1, linear
warm-up then cosine decay), for every row but DeMo, whose update is a sign applied by
plain SGD (its docstring: torch.optim.SGD without momentum, as demo.py steps); DeMo
trains with SGD without momentum or weight decay under the same warm-up and cosine
decay. Every row's rate is tuned on seed 0 over the task's grid (:data:`LR_GRID`,
:data:`TEXT_LR_GRID`), then seeds 1, 2, … run
at that rate; reported: the mean over seeds [min, max] of the workers' own models (their
mean accuracy; for the text task also their mean validation loss).

Tasks (both 8 workers, IID shares, the one-process engine):

- ``mnist``: the sweep's MNIST subset (4000 training images), the 2-layer MLP, batch 32,
  40 epochs (600 steps), as ``diloco-h``;
- ``text``: a character-level language model on the standard library's help texts
  (:mod:`bagua_algos.experiments.text`: ``pydoc_data.topics``, windows of 64
  characters), a 2-layer causal Transformer of width 32, batch 8 sequences, 3 epochs
  (300 steps); next-character cross-entropy at every position; the validation loss
  and accuracy over the last 10 % of the corpus.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bagua_algos.algorithms.table import AlgorithmConfig
from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.protocol import PROTOCOLS, Protocol

__all__ = ["BUDGETS", "LR_GRID", "TASKS", "lowcomm_frontier", "measure_bytes", "configure"]

BUDGETS = (20, 100)
"""The budgets: gradient allreduce's measured bytes per step divided by these."""
LR_GRID = (1e-3, 3e-3, 1e-2, 3e-2)  # the MNIST MLP's
TEXT_LR_GRID = (3e-3, 1e-2, 3e-2, 1e-1)  # the character Transformer's (300 steps: 1e-3 trained every row least)
SPARSELOCO_DENSITY = 0.05  # the density SparseLoCo's H is chosen to come nearest to
DEMO_TOPK = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # DeMo's measured grid
DILOCO_PROTOCOL = PROTOCOLS["diloco"]
# DeMo steps on the sign of its exchanged direction with plain SGD (module notes)
DEMO_PROTOCOL = DILOCO_PROTOCOL.with_(name="diloco_sgd", optimizer="sgd", momentum=0.0, weight_decay=0.0,
                                      source=DILOCO_PROTOCOL.source + "; DeMo's sign applied by SGD without "
                                                                      "momentum or weight decay (demo.py)")
BASELINE = "synchronous (gradient allreduce)"


# ------------------------------------------------------------------------------ tasks


@dataclass(frozen=True)
class Task:
    name: str
    setting: rt.Setting
    text: bool  # the language model (validation loss reported) or the image classifier
    lr_grid: tuple = LR_GRID  # every row's rate is tuned over it

    def load(self, device):
        if self.text:
            from bagua_algos.experiments.text import load_text

            return load_text().to(device)
        return rt.load(self.setting.dataset, None, 0, device)

    def spec(self, data) -> tuple:
        """What a gloo worker needs to build the model and a batch: picklable."""
        if self.text:
            return ("text", data.num_classes, tuple(data.image_shape))
        return (self.setting.model, tuple(data.image_shape), data.num_classes)


TASKS = {
    "mnist": Task("mnist", rt.Setting("mnist", "mlp", 8, 32, 40, lr=1e-3, protocol=DILOCO_PROTOCOL), text=False),
    "text": Task("text", rt.Setting("text", "char_transformer", 8, 8, 3, lr=1e-3, protocol=DILOCO_PROTOCOL),
                 text=True, lr_grid=TEXT_LR_GRID),
}


def make_model(spec: tuple) -> torch.nn.Module:
    """A fresh model of ``spec`` (:meth:`Task.spec`; the caller seeds torch)."""
    if spec[0] == "text":
        from bagua_algos.experiments.text import CharTransformer

        return CharTransformer(spec[1], context=spec[2][0], width=32, layers=2, heads=4)
    return rt.make_model(spec[0], spec[1], spec[2])


def _loss_fn(spec: tuple) -> Callable:
    if spec[0] == "text":
        from bagua_algos.experiments.text import sequence_loss

        return sequence_loss
    return torch.nn.functional.cross_entropy


def _batch(spec: tuple, generator: torch.Generator, size: int = 2):
    if spec[0] == "text":
        x = torch.randint(0, spec[1], (size, *spec[2]), generator=generator)
        return x, torch.randint(0, spec[1], (size, *spec[2]), generator=generator)
    return (torch.randn(size, *spec[1], generator=generator),
            torch.randint(0, spec[2], (size,), generator=generator))


# ------------------------------------------------------------------------------ bytes


def period(config: AlgorithmConfig) -> int:
    """The steps of one whole period of ``config``'s schedule (every fragment
    synchronises once in steps 1..period); at least 2."""
    return max(2, int(config.kwargs.get("sync_every") or 1))


def _bytes_worker(rank, world_size, spec, configs):
    """On each gloo worker: every config's bytes handed to collectives per step, over
    one period of its schedule from its first step."""
    from bagua_algos.runtime import comm

    loss_fn = _loss_fn(spec)
    sent = {}
    for config in configs:
        torch.manual_seed(0)
        model = make_model(spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model.with_bagua([optimizer], config.build(optimizer))
        g = torch.Generator().manual_seed(rank)
        steps = period(config)
        comm.reset_bytes_sent()  # (after with_bagua's broadcast of the initial model)
        for _ in range(steps):
            x, y = _batch(spec, g)
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        sent[config.label] = comm.bytes_sent() / steps
        model.bagua_ddp.detach()
    return sent


def measure_bytes(spec: tuple, configs: list, timeout: float = 600.0) -> dict:
    """label → bytes a worker hands to collectives per step (the larger of two gloo
    workers), each config over one period of its schedule."""
    from bagua_algos.experiments.gloo_workers import run_workers

    per_rank = run_workers(_bytes_worker, 2, spec, list(configs), timeout=timeout)
    return {label: max(r[label] for r in per_rank) for label in per_rank[0]}


# ------------------------------------------------------------------------------ knobs


def _config(label: str, name: str, **kwargs) -> AlgorithmConfig:
    import bagua_algos.algorithms  # noqa: F401 - registers every algorithm

    return AlgorithmConfig(label, name, kwargs)


def _interpolate(points: list, target: float) -> float:
    """x where the piecewise-linear curve through ``points`` ((x, y), y increasing in x)
    reaches ``target`` (clamped to the ends)."""
    points = sorted(points)
    if target <= points[0][1]:
        return points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 <= target <= y1:
            return x0 if y1 == y0 else x0 + (x1 - x0) * (target - y0) / (y1 - y0)
    return points[-1][0]


def streaming(label: str, sync_every: int) -> AlgorithmConfig:
    """Streaming DiLoCo: two fragments, 4-bit min-max deltas, an overlap of one step where
    the fragments' spacing allows it."""
    sync_every = max(2, sync_every)
    overlap = 1 if sync_every // 2 >= 2 else 0
    return _config(label, "diloco", sync_every=sync_every, fragments=2, compression="minmax4", overlap=overlap)


def configure(spec: tuple, budgets: dict) -> tuple[dict, dict]:
    """(reference, {budget name: [AlgorithmConfig, ...]}): every method's knobs for each
    budget (bytes per step), from one gloo run of reference configurations.
    ``reference``: the measured reference bytes (``gradient_allreduce`` per step, …)."""
    probes = [_config("gradient_allreduce", "gradient_allreduce"),
              _config("diloco H=1", "diloco", sync_every=1),
              _config("streaming H=2", "diloco", sync_every=2, fragments=2, compression="minmax4"),
              _config("sparseloco 0.02", "sparseloco", sync_every=1, topk_density=0.02),
              _config("sparseloco 0.2", "sparseloco", sync_every=1, topk_density=0.2)]
    probes += [_config(f"demo {k}", "demo", chunk=64, topk=k) for k in DEMO_TOPK]
    ref = measure_bytes(spec, probes)
    allreduce = ref["gradient_allreduce"]
    per_sync = ref["diloco H=1"]
    streaming_per_sync = 2 * ref["streaming H=2"]
    # SparseLoCo's bytes per synchronisation, a + b·density (positions and levels per entry, a table per tensor)
    slope = (ref["sparseloco 0.2"] - ref["sparseloco 0.02"]) / 0.18
    intercept = ref["sparseloco 0.02"] - 0.02 * slope
    demo_points = [(k, ref[f"demo {k}"]) for k in DEMO_TOPK]
    rows = {}
    for name, budget in budgets.items():
        h_sparse = max(1, round((intercept + slope * SPARSELOCO_DENSITY) / budget))
        density = min(1.0, max(1e-4, (budget * h_sparse - intercept) / slope))
        rows[name] = [
            _config(f"DiLoCo [{name}]", "diloco", sync_every=max(1, round(per_sync / budget))),
            streaming(f"Streaming DiLoCo 4-bit [{name}]", round(streaming_per_sync / budget)),
            _config(f"SparseLoCo [{name}]", "sparseloco", sync_every=h_sparse, topk_density=round(density, 4)),
            _config(f"DeMo [{name}]", "demo", chunk=64, topk=max(1, round(_interpolate(demo_points, budget)))),
            _config(f"SPARTA [{name}]", "sparta", fraction=min(1.0, budget / allreduce)),
        ]
    return ref, rows


def knobs(config: AlgorithmConfig) -> str:
    """The row's knobs, as ``key=value`` text."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in config.kwargs.items())


# ------------------------------------------------------------------------------ training


@dataclass
class Result:
    label: str
    seed: int
    lr: float
    accuracy: float = float("nan")  # the workers' own models, mean over workers (last epoch)
    worst_accuracy: float = float("nan")
    averaged_accuracy: float = float("nan")
    loss: float = float("nan")  # text: the workers' mean validation loss (last epoch)
    averaged_loss: float = float("nan")
    step_seconds: float = float("nan")
    seconds: float = 0.0
    diverged: str = ""

    def score(self, text: bool) -> float:
        """What the tuning maximises: −(validation loss) for text, else accuracy; −inf when diverged."""
        if self.diverged:
            return -math.inf
        value = -self.loss if text else self.accuracy
        return value if math.isfinite(value) else -math.inf


def protocol_of(config: AlgorithmConfig) -> Protocol:
    return DEMO_PROTOCOL if config.name == "demo" else DILOCO_PROTOCOL


def train_once(task: Task, setting: rt.Setting, data, config: AlgorithmConfig, seed: int, lr: float,
               device) -> Result:
    """One run of ``config`` on the engine under its protocol (module notes)."""
    from bagua_algos.engine import Engine
    from bagua_algos.experiments.training import StackedWorkers, train_epochs

    protocol = protocol_of(config)
    setting = setting.with_(lr=lr, protocol=protocol)
    torch.manual_seed(seed)
    module = make_model(task.spec(data))
    engine = Engine(module, setting.workers, config.build(), protocol.optimizer_for(module, lr), device=device)
    n_steps = rt.steps_per_epoch(setting, len(data.train_y))

    def batches(epoch):
        return rt.iid_batches(len(data.train_y), setting.workers, setting.batch, epoch, seed, device)

    if task.text:
        from bagua_algos.experiments.text import TextWorkers

        workers = TextWorkers(engine, data, batches)
    else:
        workers = StackedWorkers(engine, data, batches, batched_average=False)
    started = time.perf_counter()
    curves = train_epochs(workers, setting.epochs, setting.max_steps_per_epoch,
                          lr_at=protocol.schedule_for(lr, setting.epochs, n_steps, setting.workers),
                          time_steps=True, codec_refusal_diverges=True)
    result = Result(config.label, seed, lr, seconds=time.perf_counter() - started)
    if curves.step_seconds:
        result.step_seconds = statistics.median(curves.step_seconds)
    if curves.diverged is not None or not curves.worker_accuracy:
        result.diverged = "diverged" if curves.diverged is None else (
            f"epoch {curves.diverged.epoch}: {curves.diverged.error or 'training loss not finite'}")
        return result
    result.accuracy = curves.mean_worker_accuracy[-1]
    result.worst_accuracy = curves.min_worker_accuracy[-1]
    result.averaged_accuracy = curves.averaged_accuracy[-1]
    if task.text:
        result.loss = statistics.mean(workers.last_loss["workers"])
        result.averaged_loss = workers.last_loss["averaged"]
        if not math.isfinite(result.loss):
            result.diverged = "validation loss not finite"
    return result


def tuned_runs(ctx, task: Task, setting: rt.Setting, data, config: AlgorithmConfig) -> tuple[float, list]:
    """(the rate, the runs of every seed at it): the rate tuned on seed 0 over the
    task's grid, then the other seeds at it."""
    grid = task.lr_grid
    first = {lr: train_once(task, setting, data, config, ctx.seeds[0], lr, ctx.device) for lr in grid}
    lr = max(grid, key=lambda g: first[g].score(task.text))
    runs = [first[lr]] + [train_once(task, setting, data, config, seed, lr, ctx.device) for seed in ctx.seeds[1:]]
    tried = ", ".join(f"{g:g}: {_score_text(first[g], task.text)}" for g in grid)
    seconds = sum(r.seconds for r in runs) + sum(first[g].seconds for g in grid if g != lr)
    print(f"   {config.label}: seed {ctx.seeds[0]} over the grid ({tried}) -> lr {lr:g}; "
          f"seeds {_runs_text(runs, task.text)} ({seconds:.0f} s)", flush=True)
    return lr, runs


def _score_text(run: Result, text: bool) -> str:
    if run.diverged:
        return "diverged"
    return f"loss {run.loss:.3f}" if text else f"{100 * run.accuracy:.1f}%"


def _runs_text(runs: list, text: bool) -> str:
    return " | ".join(_score_text(r, text) for r in runs)


# ------------------------------------------------------------------------------ the experiment


def _spread(values) -> tuple[float, float, float]:
    return rt.spread(values)


def _cell(values, scale: float = 100.0, digits: int = 1, unit: str = "%") -> str:
    mean, low, high = _spread(values)
    if not math.isfinite(mean):
        return "diverged"
    return f"{scale * mean:.{digits}f}{unit} [{scale * low:.{digits}f}, {scale * high:.{digits}f}]"


def setting_text(setting: rt.Setting) -> str:
    """The task's setting without a learning rate or a protocol (each row has its own
    rate and :func:`protocol_of`)."""
    data = "IID" if setting.alpha is None else f"Dirichlet alpha={setting.alpha:g}"
    return (f"{setting.dataset}, {setting.model}, {setting.workers} workers x batch {setting.batch} ({data}), "
            f"{setting.epochs} epochs")


def protocol_text(protocol: Protocol, epochs: int) -> str:
    """The protocol's optimizer and schedule (what is reported: :func:`reported_text`)."""
    return protocol.describe(epochs).rsplit("; reports ", 1)[0]


def reported_text(task: Task) -> str:
    """What the rows report and the tuning ranks (:meth:`Result.score`)."""
    if task.text:
        from bagua_algos.experiments.text import VALIDATION_SHARE

        return ("the workers' own models' validation loss (next-character cross-entropy over the last "
                f"{100 * VALIDATION_SHARE:g} % of the corpus), mean over workers, last epoch (tuned on it), "
                "and their next-character accuracy on the same windows")
    return "the workers' own models' test accuracy, mean over workers, last epoch (tuned on it)"


def run_task(ctx, task: Task) -> list[dict]:
    """One task: the knobs, their measured bytes, every row trained; the table and the
    CSV records."""
    # here, not at the top: importing reproduce.output runs the reproduce package, whose
    # catalog imports this module
    from bagua_algos.experiments.reproduce.output import print_table

    setting = ctx.setting({"proxy": task.setting, "seed": task.setting})
    data = task.load(ctx.device)
    spec = task.spec(data)
    torch.manual_seed(0)
    d = sum(p.numel() for p in make_model(spec).parameters())
    steps = rt.steps_per_epoch(setting, len(data.train_y))
    print(f"\n-- task {task.name}: {setting_text(setting)}; {d} parameters; {steps} steps an epoch, "
          f"{steps * setting.epochs} in all")
    print(f"   lr: tuned per row on seed {ctx.seeds[0]} over {list(task.lr_grid)} (the peak of the schedule; "
          f"each row's below)")
    print(f"   protocol of every row but DeMo: {protocol_text(DILOCO_PROTOCOL, setting.epochs)}")
    print(f"   DeMo's: {protocol_text(DEMO_PROTOCOL, setting.epochs)}")
    print(f"   reports: {reported_text(task)}")
    # the budgets, from the allreduce's measured bytes; every row's knobs; then their own bytes measured
    allreduce_config = _config(BASELINE, "gradient_allreduce")
    probe = measure_bytes(spec, [allreduce_config])
    allreduce = probe[BASELINE]
    budgets = {f"1/{k}": allreduce / k for k in BUDGETS}
    _, rows = configure(spec, budgets)
    configs = [allreduce_config] + [c for name in budgets for c in rows[name]]
    sent = measure_bytes(spec, configs)
    print(f"   gradient allreduce: {sent[BASELINE]:.0f} bytes a step (measured; 4 x {d} = {4 * d})")
    for name, budget in budgets.items():
        print(f"   budget {name}: {budget:.0f} bytes a step")
        for config in rows[name]:
            print(f"     {config.label:<34} {knobs(config):<58} measured {sent[config.label]:9.0f} bytes/step "
                  f"({sent[config.label] / budget:.2f} x the budget)")
    print(flush=True)
    # train: the baseline once, then every budget's rows
    results = {}
    for config in configs:
        lr, runs = tuned_runs(ctx, task, setting, data, config)
        results[config.label] = (lr, runs)
    records, table = [], []
    for name, budget in [("own", allreduce)] + list(budgets.items()):
        chosen = [allreduce_config] if name == "own" else rows[name]
        for config in chosen:
            lr, runs = results[config.label]
            ok = [r for r in runs if not r.diverged]
            record = {
                "task": task.name, "budget": name, "budget_bytes_per_step": budget, "method": config.label,
                "algorithm": config.name, "knobs": knobs(config), "bytes_per_step": sent[config.label],
                "bytes_vs_budget": sent[config.label] / budget, "bytes_vs_allreduce": sent[config.label] / allreduce,
                "protocol": protocol_of(config).name, "lr": lr, "seeds": len(runs),
                "diverged_seeds": len(runs) - len(ok),
            }
            for key in ("accuracy", "worst_accuracy", "averaged_accuracy", "loss", "averaged_loss"):
                mean, low, high = _spread([getattr(r, key) for r in ok])
                record.update({f"{key}_mean": mean, f"{key}_min": low, f"{key}_max": high})
            record["step_ms"] = 1000 * _spread([r.step_seconds for r in runs])[0]
            records.append(record)
            cells = [name, config.label.split(" [")[0], knobs(config), f"{sent[config.label]:.0f}",
                     f"{sent[config.label] / budget:.2f}"]
            if task.text:
                cells.append(_cell([r.loss for r in ok], 1.0, 3, ""))
            cells += [_cell([r.accuracy for r in ok]), f"{lr:g}",
                      f"{len(runs) - len(ok)} diverged" if len(ok) < len(runs) else ""]
            table.append(cells)
    columns = ["budget", "method", "knobs", "bytes/step", "x budget"]
    if task.text:
        columns.append("val loss (workers, mean [min, max] over seeds)")
    columns += [f"workers' {'val next-char' if task.text else 'test'} acc (mean [min, max])", "lr", ""]
    print()
    print_table(columns, table)
    verdicts(task, records)
    return records


def verdicts(task: Task, records: list) -> None:
    """One line per budget: SparseLoCo against DiLoCo (and the best row), on the seeds' spread."""
    key = "loss" if task.text else "accuracy"
    better = (lambda a, b: a < b) if task.text else (lambda a, b: a > b)
    for budget in sorted({r["budget"] for r in records} - {"own"}, key=lambda b: int(b.split("/")[1])):
        mine = {r["method"].split(" [")[0]: r for r in records if r["budget"] == budget}
        sparse, diloco = mine.get("SparseLoCo"), mine.get("DiLoCo")
        if not sparse or not diloco:
            continue
        s, d = sparse[f"{key}_mean"], diloco[f"{key}_mean"]
        apart = sparse[f"{key}_min"] > diloco[f"{key}_max"] or sparse[f"{key}_max"] < diloco[f"{key}_min"]
        if not (math.isfinite(s) and math.isfinite(d)):
            word = "cannot be compared (a row diverged on every seed)"
        else:
            word = ("beats" if better(s, d) else "does not beat") + (
                " (the seeds' ranges do not overlap)" if apart else " (within the seeds' spread)")
        fmt = (lambda v: f"{v:.3f}") if task.text else (lambda v: f"{100 * v:.1f}%")
        finite = {m: r for m, r in mine.items() if math.isfinite(r[f"{key}_mean"])}
        best = (min if task.text else max)(finite, key=lambda m: finite[m][f"{key}_mean"]) if finite else "none"
        print(f"   {task.name}, budget {budget}: SparseLoCo {word} DiLoCo ({fmt(s)} against {fmt(d)} "
              f"{'validation loss' if task.text else 'accuracy'}); best at this budget: {best}")


def lowcomm_frontier(ctx) -> None:
    """Every task: the methods at each budget (module notes); one CSV of every row."""
    ctx.header("SparseLoCo (Sarfi et al. 2025) claims to beat DiLoCo and DeMo at lower communication; "
               "Streaming DiLoCo, DeMo and SPARTA each claim near-synchronous quality at a fraction of its "
               "bytes: LLM pre-training on many GPUs, no common table at equal bytes",
               f"{', '.join(TASKS)} tasks, 8 workers, budgets 1/{' and 1/'.join(map(str, BUDGETS))} of gradient "
               f"allreduce's bytes, seeds {ctx.seeds}",
               "proxy tasks on a CPU (an MLP on the MNIST subset, a 2-layer character Transformer on the "
               "standard library's help texts) instead of LLM pre-training; every method at the same measured "
               "bytes per step, DiLoCo's protocol, the rate tuned per row on seed 0")
    records = []
    for task in TASKS.values():
        records += run_task(ctx, task)
    print(f"\n   wrote {ctx.write_csv(records)}")
