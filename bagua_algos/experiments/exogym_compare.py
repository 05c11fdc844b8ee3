"""EXO Gym against the one-process engine: the same model, data, nodes and methods.

EXO Gym (exo-explore/gym on GitHub, the ``exogym`` package) simulates DiLoCo, DeMo,
SPARTA and others on one machine with one process per simulated node (``mp.spawn``,
a gloo group, a barrier after every step). The engine (``bagua_algos.engine``) stacks
the n workers in one process. This command trains both on the same task and prints,
per method: the time of a training step (every node's, after a warm-up; wall clock and
the CPU time of all its processes, which a loaded machine moves much less), the peak
memory of the whole process tree (PSS, sampled in a run of its own), the wall time of the run from an
empty Python to the trained model, and the final test accuracy (mean [min, max] over
the seeds), with the ratios EXO Gym / engine::

    PYTHONPATH=/path/to/gym python benchmarks/exogym_compare.py --nodes 8 --steps 300 --seeds 0,1,2

EXO Gym is not a dependency of this package and is imported only by the runs on its
side. To get it: clone exo-explore/gym and put the clone's root on ``PYTHONPATH`` (or
``pip install -e`` it). Its trainer imports ``einops`` (DeMo) and ``psutil`` (its
minibatch probe) besides torch, numpy and tqdm; ``wandb``, ``datasets``,
``transformers`` and ``boto3`` of its requirements are not imported by the trainer and
strategies this command uses. Without it, the command says so and exits with 2.

The task (both sides): the MNIST subset of the sweep (4000 training images, 1000 test),
the 2-layer MLP of ``reproduce`` (784-128-128-10), 8 nodes × batch 32, ``--steps``
steps, constant rates (no schedule), each node's data an IID share: EXO Gym's torch's
``DistributedSampler`` (its seed 0 whatever the run's, and never given the epoch: the
same order every epoch, a short last batch of each share), and with ``--data-order
exogym`` (the default) the engine the same batches (:func:`exogym_batches`); with
``own`` the engine deals the sweep's shares, permuted per epoch and seed. Methods:

- ``diloco``: inner AdamW (lr ``--lr-adamw``, weight decay 0.1), every ``--sync-every``
  steps an outer SGD step (lr 0.7, Nesterov momentum 0.9) on the mean pseudo-gradient
  (EXO Gym's ``DiLoCoStrategy``; the engine: ``diloco``);
- ``demo``: DeMo with chunks of 64, top 32 coefficients a chunk, decay 0.999, its sign
  applied at lr ``--lr-demo`` (EXO Gym's ``DeMoStrategy``, bloc97's optimizer; the
  engine: ``demo`` under SGD without momentum);
- ``sparta``: AdamW and a random share ``--sparta-fraction`` of the parameters averaged
  after every step (EXO Gym's ``SPARTAStrategy``; the engine: ``sparta``).

AdamW (``--adamw``): torch's fused implementation on both sides by default (EXO Gym's
``OptimSpec`` passes ``fused=True`` to each node's AdamW, the engine's factory to the
stacked one, built with ``flat_optimizer=True``: one AdamW over the ``[n, d]`` matrix
of every node's parameters, the same arithmetic per number). On a CPU torch's default
is the for-loop implementation, seven passes over every tensor a step; on the engine's
stacked parameters that was about half of a DiLoCo inner step (at 8 nodes: 4.1 ms of
AdamW against 0.74 ms fused, one thread), on a node's own parameters a smaller share of
its step. (torch's fused kernels write a strided tensor as if it were contiguous, so on
the engine's ``[n, *shape]`` views they trained wrongly: the engine now refuses them
there, and this comparison's figures before that was found are void.)

Every run is a fresh ``python -m bagua_algos.experiments.exogym_compare --one ...``
child, EXO Gym's and the engine's alike, interleaved per seed. The timed runs are not
watched: memory is measured in one more run per method and side (the first seed's,
after the timed ones; ``--no-memory`` skips them), whose process tree's PSS is sampled
every 0.1 s or 20 times a sample's CPU time, whichever is longer. Reading PSS costs
about 55 CPU ms for EXO Gym's nine processes and 6 ms for the engine's one: sampled
every 0.1 s, a third of a core was taken from the run it timed; at a twentieth of a
core it still slowed the engine's two spinning threads by about 8 % (2.76 against 2.55
ms a step, alternated). Step time: EXO Gym's strategy is subclassed only to
note the time on rank 0 after each step (its loop is unchanged: the step ends with its
barrier), the engine's steps are timed in the same way; both over the steps after the
first ``--warmup``. Threads: one torch thread per EXO Gym process (its 8 processes can
use every core); the engine's one process takes ``--engine-threads`` (default: the
cores this process may run on, the ones EXO Gym's nodes share). On a quiet 2-core
machine two threads take the engine's DiLoCo step from about 3.3 to 2.7 ms; with
another busy process on the machine, OpenMP's spinning threads wait for a core and
the step collapses (9–58 ms against one thread's 3.2–3.5): pass ``--engine-threads 1``
on a loaded machine.

EXO Gym's DiLoCo (``--exogym-diloco``): ``matched`` (the default) runs EXO Gym's
strategy with two changes (:class:`_MatchedDiLoCo`), so that both sides train the same
method: the outer step after steps H, 2H, … (EXO Gym's after H + 1, 2H + 1, …, never at
the last step) and each outer step on its own pseudo-gradient (EXO Gym's rank 0 aliases
its parameters with the master model's after the first synchronisation, which makes
every later pseudo-gradient zero). ``as-is`` runs EXO Gym's code unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

__all__ = ["main", "EXOGYM_HOWTO"]

EXOGYM_HOWTO = ("EXO Gym (the exogym package) is not importable: clone exo-explore/gym from GitHub and put the "
                "clone's root on PYTHONPATH (it needs einops and psutil besides torch, numpy and tqdm), e.g. "
                "PYTHONPATH=/path/to/gym python benchmarks/exogym_compare.py")
METHODS = ("diloco", "demo", "sparta")
# --adamw: torch.optim.AdamW's implementation, the same on both sides
ADAMW = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
FRAMEWORKS = ("exogym", "engine")


# ------------------------------------------------------------------------------ command line


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="exogym_compare", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=8, help="simulated nodes (default 8)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (default 10)")
    p.add_argument("--batch", type=int, default=32, help="a node's batch (default 32)")
    p.add_argument("--methods", default="diloco,demo", help=f"','-separated, of {', '.join(METHODS)}")
    p.add_argument("--seeds", default="0,1,2", help="','-separated seeds (default 0,1,2)")
    p.add_argument("--frameworks", default="exogym,engine", help="',' separated, of exogym, engine")
    p.add_argument("--sync-every", type=int, default=50, help="DiLoCo's H (default 50)")
    p.add_argument("--lr-adamw", type=float, default=1e-3, help="DiLoCo's and SPARTA's inner AdamW rate")
    p.add_argument("--lr-demo", type=float, default=1e-3, help="DeMo's rate")
    p.add_argument("--adamw", choices=tuple(ADAMW), default="fused",
                   help="torch's AdamW implementation, both sides (DiLoCo's and SPARTA's inner optimizer): "
                        "fused (default; one kernel a tensor), foreach, or for-loop (torch's default on a CPU)")
    p.add_argument("--exogym-diloco", choices=("matched", "as-is"), default="matched",
                   help="EXO Gym's DiLoCo: matched (default: its outer step taken on the true pseudo-gradient, after "
                        "steps H, 2H, ..., as the engine's; the module's notes) or as-is (its code unchanged)")
    p.add_argument("--data-order", choices=("exogym", "own"), default="exogym",
                   help="the engine's batches: exogym (default: EXO Gym's, torch's DistributedSampler at its seed 0 "
                        "and epoch 0 every epoch, each share's last short batch included) or own (the sweep's "
                        "iid_batches: permuted per epoch and seed, the short batch dropped)")
    p.add_argument("--engine-threads", type=int, default=_cores(),
                   help="torch threads of the engine's process (default: the cores this process may use, which EXO "
                        "Gym's nodes share, one thread each; 1 on a loaded machine)")
    p.add_argument("--sparta-fraction", type=float, default=0.005, help="SPARTA's share (EXO Gym's default)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory runs (one per method and side, sampled; the timed runs never are)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a run may take")
    p.add_argument("--out", default=None, help="write every run's record here (JSON)")
    p.add_argument("--one", nargs=3, metavar=("FRAMEWORK", "METHOD", "SEED"), help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.method_list = [m for m in args.methods.split(",") if m]
    args.framework_list = [f for f in args.frameworks.split(",") if f]
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"argument --seeds: expected ','-separated integers, got {args.seeds!r}")
    bad = [m for m in args.method_list if m not in METHODS]
    if bad or not args.method_list:
        parser.error(f"argument --methods: expected some of {', '.join(METHODS)}, got {args.methods!r}")
    bad = [f for f in args.framework_list if f not in FRAMEWORKS]
    if bad or not args.framework_list:
        parser.error(f"argument --frameworks: expected some of {', '.join(FRAMEWORKS)}, got {args.frameworks!r}")
    for name in ("nodes", "steps", "batch", "sync_every", "engine_threads"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: expected an integer >= 1")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"argument --warmup: expected 0 <= warmup < --steps ({args.steps}), got {args.warmup}")
    return args


# ------------------------------------------------------------------------------ the task


def _task(seed: int):
    """(the MNIST subset's split, a fresh MLP seeded by ``seed``)."""
    from bagua_algos.experiments import reproduce_train as rt

    data = rt.load("mnist", None, 0, "cpu")
    torch.manual_seed(seed)
    return data, rt.make_model("mlp", data.image_shape, data.num_classes)


def _accuracy(model: torch.nn.Module, data) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(data.test_x).argmax(-1) == data.test_y).float().mean())


class _LossModel(torch.nn.Module):
    """EXO Gym's model contract: ``model(batch)`` returns the loss."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)


class _StepClock:
    """Mixed into an EXO Gym strategy: every rank notes the wall and CPU time (this
    process's, all its threads) after each step and, after the last, writes them to
    ``clock_path.RANK`` (the strategy's own step is unchanged)."""

    def step(self):
        super().step()
        times = self.__dict__.setdefault("_times", [])
        times.append((time.perf_counter(), time.process_time()))
        if len(times) >= self.max_steps:
            Path(f"{self.clock_path}.{self.rank}").write_text(json.dumps(times))


class _MatchedDiLoCo:
    """Mixed into EXO Gym's ``DiLoCoCommunicator`` (exogym/strategy/diloco.py) for
    ``--exogym-diloco matched``: the DiLoCo the engine runs, two changes to it.

    - The schedule: EXO Gym calls ``communicate`` after the inner step with the step
      count from 0, before incrementing it (communicate_optimize_strategy.py, ``step``;
      strategy.py line 63), and synchronises at ``local_step % H == 0 and local_step >
      0`` (diloco.py line 34): after steps H + 1, 2H + 1, … (1-based), never after the
      last of 300 with H = 50. Given ``local_step + 1`` it synchronises after steps H, 2H,
      …, the last included, as the engine (and the paper, torchft).
    - The outer step: ``_synchronize_master_model`` (diloco.py line 67) sets rank 0's
      ``param.data`` to the master model's tensor, so from the first synchronisation on
      rank 0's parameters and the master's are one tensor: the next all-reduce averages
      the master in place, the pseudo-gradient master − average (line 62) is 0, and
      every outer step after the first is the averaged model moved by the decaying
      Nesterov momentum of the first. Here the master's values are copied into the
      parameters instead, so each outer step takes its own pseudo-gradient.
    """

    def communicate(self, model, rank, num_nodes, local_step):
        super().communicate(model, rank, num_nodes, local_step + 1)

    def _synchronize_master_model(self, model):
        master = self.master_model.state_dict()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.data.copy_(master[name].to(param.device))


class _MatchedStrategy:
    """Mixed into the timed DiLoCo strategy: its communicator becomes the matched one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        old = self.diloco_comm
        matched = globals()["MatchedDiLoCoCommunicator"].__new__(globals()["MatchedDiLoCoCommunicator"])
        matched.__dict__.update(old.__dict__)
        self.diloco_comm = matched
        self.communication_modules = [matched if m is old else m for m in self.communication_modules]


def _timed_strategies() -> dict:
    """method -> EXO Gym's strategy class with the clock mixed in (module-level names, so
    that they pickle into EXO Gym's spawned processes), ``diloco-matched`` the one with
    :class:`_MatchedDiLoCo`; {} without EXO Gym."""
    try:
        from exogym.strategy import DeMoStrategy, DiLoCoStrategy, SPARTAStrategy
        from exogym.strategy.diloco import DiLoCoCommunicator
    except ImportError:
        return {}

    def define(name, bases):
        if name not in globals():
            globals()[name] = type(name, bases, {"__module__": __name__, "__qualname__": name})
        return globals()[name]

    classes = {}
    for method, base in (("diloco", DiLoCoStrategy), ("demo", DeMoStrategy), ("sparta", SPARTAStrategy)):
        classes[method] = define(f"Timed{base.__name__}", (_StepClock, base))
    define("MatchedDiLoCoCommunicator", (_MatchedDiLoCo, DiLoCoCommunicator))
    classes["diloco-matched"] = define("TimedMatchedDiLoCoStrategy", (_MatchedStrategy, classes["diloco"]))
    return classes


def run_exogym(args, method: str, seed: int) -> dict:
    from types import SimpleNamespace

    from exogym.strategy.optim import OptimSpec
    from exogym.trainer import Trainer

    from bagua_algos.experiments.common import free_port

    data, net = _task(seed)
    train = torch.utils.data.TensorDataset(data.train_x, data.train_y)
    val = torch.utils.data.TensorDataset(data.test_x[:64], data.test_y[:64])
    clock = Path(tempfile.mkdtemp(prefix="exogym_clock_")) / "times.json"
    timed = _timed_strategies()["diloco-matched" if method == "diloco" and args.exogym_diloco == "matched" else method]
    adamw = OptimSpec(torch.optim.AdamW, lr=args.lr_adamw, weight_decay=0.1, **ADAMW[args.adamw])
    if method == "diloco":
        strategy = timed(optim_spec=adamw, H=args.sync_every, clock_path=str(clock))
    elif method == "demo":
        strategy = timed(compression_decay=0.999, compression_topk=32, compression_chunk=64, weight_decay=0.0,
                         strategy_config=SimpleNamespace(optimizer_kwargs={"lr": args.lr_demo}),
                         clock_path=str(clock))
    else:
        strategy = timed(optim_spec=adamw, p_sparta=args.sparta_fraction, clock_path=str(clock))
    trainer = Trainer(_LossModel(net), train, val, start_port=free_port(), device="cpu")
    final = trainer.fit(num_epochs=10**6, strategy=strategy, num_nodes=args.nodes, max_steps=args.steps,
                        batch_size=args.batch, minibatch_size=args.batch, val_size=0, val_interval=10**9,
                        disable_logging=True, seed=seed)
    ranks = [json.loads(Path(f"{clock}.{rank}").read_text()) for rank in range(args.nodes)]
    # rank 0's wall clock (every step ends with EXO Gym's barrier); the CPU time of all nodes
    times = [(wall, sum(rank[i][1] for rank in ranks)) for i, (wall, _) in enumerate(ranks[0])]
    return {"accuracy": _accuracy(final.net, data), "times": times}


def exogym_batches(n_samples: int, nodes: int, batch: int):
    """EXO Gym's batches, ``[nodes, b]`` index tensors, one epoch: each node's
    ``DistributedSampler`` (shuffle, its default seed 0; EXO Gym never calls
    ``set_epoch``, so every epoch is this one) read ``batch`` at a time by its
    ``DataLoader`` (the last batch short)."""
    from torch.utils.data import DistributedSampler

    shares = [list(DistributedSampler(range(n_samples), num_replicas=nodes, rank=rank, shuffle=True))
              for rank in range(nodes)]
    for start in range(0, len(shares[0]), batch):
        yield torch.tensor([share[start:start + batch] for share in shares])


def run_engine(args, method: str, seed: int) -> dict:
    import bagua_algos.algorithms  # noqa: F401 - registers every algorithm
    from bagua_algos.engine import Engine
    from bagua_algos.experiments import reproduce_train as rt
    from bagua_algos.runtime.algorithm import Algorithm

    data, net = _task(seed)
    adamw = ADAMW[args.adamw]
    if method == "diloco":
        algorithm = Algorithm.init("diloco", sync_every=args.sync_every)
        optimizer = lambda p: torch.optim.AdamW(p, lr=args.lr_adamw, weight_decay=0.1, **adamw)  # noqa: E731
    elif method == "demo":
        algorithm = Algorithm.init("demo", chunk=64, topk=32, decay=0.999)
        optimizer = lambda p: torch.optim.SGD(p, lr=args.lr_demo)  # noqa: E731
    else:
        algorithm = Algorithm.init("sparta", fraction=args.sparta_fraction, seed=seed)
        optimizer = lambda p: torch.optim.AdamW(p, lr=args.lr_adamw, weight_decay=0.1, **adamw)  # noqa: E731
    # The optimizer steps the one [n, d] parameter matrix (flat_optimizer): the same
    # arithmetic per number as each node's own AdamW, one fused call, no strided views
    # (torch's fused AdamW writes a strided view wrongly: the engine refuses it there).
    engine = Engine(net, args.nodes, algorithm, optimizer, flat_optimizer=True)
    train_x, train_y = data.train_x, data.train_y
    loss_fn = torch.nn.functional.cross_entropy
    times, epoch = [], 0
    while len(times) < args.steps:
        if args.data_order == "exogym":
            batches = exogym_batches(len(data.train_y), args.nodes, args.batch)
        else:
            batches = rt.iid_batches(len(data.train_y), args.nodes, args.batch, epoch, seed, "cpu")
        # The epoch's samples gathered in batch order by one index_select each (timed, in
        # its first step); a step's batch is then a view of consecutive rows: [n, b, ...].
        # (Freeing this 12.5 MB block each epoch also raises glibc's mmap threshold above
        # DeMo's per-step temporaries, which moves DeMo's engine step from about 17 to
        # 11 ms; DiLoCo's does not move: docs/benchmarks.md, "Against EXO Gym", run F.)
        batches = list(batches)
        rows = torch.cat([index.flatten() for index in batches])
        epoch_x, epoch_y = train_x.index_select(0, rows), train_y.index_select(0, rows)
        start = 0
        for index in batches:
            end = start + index.numel()
            engine.step(epoch_x[start:end].view(*index.shape, *train_x.shape[1:]),
                        epoch_y[start:end].view(index.shape), loss_fn)
            start = end
            times.append((time.perf_counter(), time.process_time()))
            if len(times) == args.steps:
                break
        epoch += 1
    with torch.no_grad():
        workers = (engine.model.predict(data.test_x) == data.test_y).float().mean(1)
    averaged = float((engine.model.predict_averaged(data.test_x) == data.test_y).float().mean())
    return {"accuracy": averaged, "workers_accuracy": workers.tolist(), "times": times}


def run_one(args) -> int:
    framework, method, seed = args.one[0], args.one[1], int(args.one[2])
    torch.set_num_threads(args.engine_threads if framework == "engine" else 1)
    started = time.perf_counter()
    record = (run_exogym if framework == "exogym" else run_engine)(args, method, seed)
    times = record.pop("times")
    timed = times[args.warmup:]
    per = max(1, len(timed) - 1)
    record.update({"framework": framework, "method": method, "seed": seed, "steps": len(times),
                   "threads": torch.get_num_threads(), "exogym_diloco": args.exogym_diloco,
                   "data_order": args.data_order,
                   "step_s": (timed[-1][0] - timed[0][0]) / per, "cpu_step_s": (timed[-1][1] - timed[0][1]) / per,
                   "in_process_s": time.perf_counter() - started})
    Path(args.result).write_text(json.dumps(record))
    return 0


# ------------------------------------------------------------------------------ memory


MEMORY_SAMPLE_GAP = 20
"""The memory sampler waits this many times a sample's CPU time (at least 0.1 s) before
the next: at most 1/21 of one core."""


def _sample_wait(cost_s: float) -> float:
    """Seconds the memory sampler waits after a sample that took ``cost_s`` CPU seconds.

    Reading smaps_rollup walks every mapping of every process: about 55 CPU ms for EXO
    Gym's nine processes at 8 nodes. Sampled every 0.1 s, that took a third of a core
    from the run being timed (EXO Gym's DiLoCo step 16.1–16.4 ms against 13.9–14.2 with
    this wait, alternated in one session)."""
    return max(0.1, MEMORY_SAMPLE_GAP * cost_s)


def _tree_pss_kib(root: int) -> int:
    """PSS (KiB) summed over ``root`` and every process below it."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            pass
    return total


def _run_child(args, framework: str, method: str, seed: int, argv: list, sample_memory: bool = False) -> dict:
    """One run in a fresh child; its record. With ``sample_memory`` its process tree's
    PSS is sampled (``peak_pss_mib``), which perturbs its timing: a timed run is not
    sampled (``peak_pss_mib`` None)."""
    result = Path(tempfile.mkdtemp(prefix="exogym_compare_")) / "run.json"
    threads = args.engine_threads if framework == "engine" else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    command = [sys.executable, "-m", "bagua_algos.experiments.exogym_compare", *argv,
               "--one", framework, method, str(seed), "--result", str(result)]
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            started_sample = time.thread_time()
            peak[0] = max(peak[0], _tree_pss_kib(child.pid))
            stop.wait(_sample_wait(time.thread_time() - started_sample))

    sampler = threading.Thread(target=sample, daemon=True)
    if sample_memory:
        sampler.start()
    try:
        _, err = child.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, 9)
        child.communicate()
        err = f"stopped after {args.timeout:.0f} s"
    stop.set()
    if sample_memory:
        sampler.join()
    wall = time.perf_counter() - started
    if child.returncode != 0 or not result.is_file():
        return {"framework": framework, "method": method, "seed": seed, "error": (err or "")[-2000:],
                "purpose": "memory" if sample_memory else "time"}
    record = json.loads(result.read_text())
    record.update({"peak_pss_mib": peak[0] / 1024 if sample_memory else None, "wall_s": wall,
                   "purpose": "memory" if sample_memory else "time"})
    return record


# ------------------------------------------------------------------------------ report


def _spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def _ok(records: list, method: str, framework: str, purpose: str) -> list:
    """The records of ``method`` on ``framework`` that ran, of one purpose (time, memory)."""
    return [r for r in records if r["method"] == method and r["framework"] == framework
            and r.get("purpose") == purpose and "error" not in r]


def report(records: list, methods: list) -> None:
    print()
    head = ["method", "framework", "step ms", "CPU ms a step", "peak PSS MiB", "wall s", "test acc %"]
    rows = []
    for method in methods:
        for framework in FRAMEWORKS:
            mine = _ok(records, method, framework, "time")
            if not mine:
                continue
            rows.append([method, framework, _spread([1000 * r["step_s"] for r in mine]),
                         _spread([1000 * r["cpu_step_s"] for r in mine]),
                         _spread([r["peak_pss_mib"] for r in _ok(records, method, framework, "memory")]),
                         _spread([r["wall_s"] for r in mine]),
                         _spread([100 * r["accuracy"] for r in mine])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print()
    for method in methods:
        by = {f: _ok(records, method, f, "time") for f in FRAMEWORKS}
        peaks = {f: [r["peak_pss_mib"] for r in _ok(records, method, f, "memory")] for f in FRAMEWORKS}
        if not (by["exogym"] and by["engine"]):
            continue
        ratio = [e["step_s"] / g["step_s"] for e in by["exogym"] for g in by["engine"] if e["seed"] == g["seed"]]
        cpu = [e["cpu_step_s"] / g["cpu_step_s"] for e in by["exogym"] for g in by["engine"] if e["seed"] == g["seed"]]
        memory = (f"{statistics.mean(peaks['exogym']) / statistics.mean(peaks['engine']):.2f}x"
                  if peaks["exogym"] and peaks["engine"] else "not measured")
        wall = statistics.mean(r["wall_s"] for r in by["exogym"]) / statistics.mean(r["wall_s"] for r in by["engine"])
        exo = [r["accuracy"] for r in by["exogym"]]
        eng = [r["accuracy"] for r in by["engine"]]
        overlap = max(min(exo), min(eng)) <= min(max(exo), max(eng))
        print(f"{method}: step time EXO Gym / engine {_spread(ratio)} (per seed), CPU time a step {_spread(cpu)}; "
              f"peak memory {memory}; "
              f"wall {wall:.2f}x; accuracy {100 * statistics.mean(exo):.1f}% against {100 * statistics.mean(eng):.1f}%"
              f" ({'ranges over seeds overlap' if overlap else 'ranges over seeds do not overlap'})")
    for r in records:
        if "error" in r:
            print(f"{r['framework']} {r['method']} seed {r['seed']} failed: {r['error'][-500:]}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.one:
        return run_one(args)
    if "exogym" in args.framework_list:
        try:
            import exogym  # noqa: F401
        except ImportError as err:
            print(f"exogym_compare: {EXOGYM_HOWTO} ({err})", file=sys.stderr)
            return 2
    print(f"exogym_compare: {args.nodes} nodes, MNIST subset, MLP 784-128-128-10, batch {args.batch} a node, "
          f"{args.steps} steps ({args.warmup} untimed), methods {args.method_list}, seeds {args.seed_list}, "
          f"AdamW {args.adamw}, EXO Gym's DiLoCo {args.exogym_diloco}, engine's data order {args.data_order}, "
          f"engine threads {args.engine_threads}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
          f"{platform.platform()}", flush=True)
    runs = [(seed, method, framework, False) for seed in args.seed_list for method in args.method_list
            for framework in (args.framework_list if seed % 2 == 0 else args.framework_list[::-1])]
    if not args.no_memory:  # memory: one sampled run per method and side, after the timed ones
        runs += [(args.seed_list[0], method, framework, True)
                 for method in args.method_list for framework in args.framework_list]
    records = []
    for seed, method, framework, sample_memory in runs:
        record = _run_child(args, framework, method, seed, argv, sample_memory)  # (a child ignores --out)
        records.append(record)
        what = f"  {framework} {method} seed {seed}{' (memory)' if sample_memory else ''}"
        if "error" in record:
            print(f"{what}: failed", flush=True)
        else:
            peak = f", peak {record['peak_pss_mib']:.0f} MiB" if sample_memory else ""
            print(f"{what}: {1000 * record['step_s']:.1f} ms/step ({1000 * record['cpu_step_s']:.1f} CPU ms){peak}, "
                  f"wall {record['wall_s']:.1f} s, test acc {100 * record['accuracy']:.1f}% "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    report(records, args.method_list)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
        print(f"exogym_compare: wrote {args.out}")
    return 0 if all("error" not in r for r in records) else 1


def _linux_loopback() -> None:
    """EXO Gym's ``init_process_group_portsafe`` sets ``GLOO_SOCKET_IFNAME=lo0``, the
    loopback's name on macOS; Linux names it ``lo``, so there every node's gloo group
    fails to form (and the function only prints the errors). Its trainer's reference is
    replaced by the same steps with the interface this system has (and an error that
    is raised)."""
    try:
        import exogym.trainer
    except ImportError:
        return
    import socket

    if "lo0" in (name for _, name in socket.if_nameindex()):
        return

    def init_process_group_portsafe(backend, rank, world_size, retries=10):
        import torch.distributed as dist

        port = int(os.environ.get("MASTER_PORT", "29500")) + 199
        os.environ.update({"MASTER_ADDR": "localhost", "GLOO_SOCKET_IFNAME": "lo"})
        errors = []
        for attempt in range(retries):
            try:
                os.environ["MASTER_PORT"] = str(port + attempt)
                dist.init_process_group(backend, rank=rank, world_size=world_size)
                return
            except Exception as err:  # noqa: BLE001 - as EXO Gym's: try the next port
                errors.append(str(err))
        raise RuntimeError(f"init_process_group failed {retries} times: {errors}")

    exogym.trainer.init_process_group_portsafe = init_process_group_portsafe


# Where EXO Gym is importable (its spawned nodes import this module to unpickle the
# strategy): its strategies with the clock, and the loopback's name on Linux
_timed_strategies()
_linux_loopback()

if __name__ == "__main__":
    sys.exit(main())
