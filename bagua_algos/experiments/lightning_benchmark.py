"""The same LightningModule under ``strategy="ddp"`` and ``strategy="bagua"``: step time, as a ratio, in one run.

    python benchmarks/lightning_benchmark.py                       # 2 CPU processes, gradient_allreduce
    python benchmarks/lightning_benchmark.py --algorithm powersgd --accelerator gpu --devices 2
    bagua-algos lightning-benchmark                                # the same (the lightning extra)

Lightning starts the other processes itself (its "popen" launcher re-runs the command),
or takes the ones torchrun / ``python -m bagua_algos.launch`` started. Both fits run in
the same processes, one after the other, on the same data and seed (DDP first: its
process group is then reused by the Bagua strategy). A step is timed from one
``on_train_batch_start`` to the next batch's (forward, backward, communication,
optimizer step, data): ``--warmup`` untimed steps, then ``--steps`` timed ones, then one
more batch whose start ends the last timed step; the median is reported. Rank 0 prints
the device, the command and the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import lightning as L
import torch

import bagua_algos.lightning  # noqa: F401 - registers strategy="bagua"
from bagua_algos.lightning import BaguaStrategy


class MLP(L.LightningModule):
    def __init__(self, width: int, depth: int, lr: float = 0.01):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class StepTimer(L.Callback):
    """Step k's time runs from its ``on_train_batch_start`` to the next batch's; the first
    ``warmup`` steps are left out of ``times``. A fit of :func:`batches_to_run` batches
    leaves exactly ``steps`` times."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.times, self._last, self._steps = [], None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._last is not None:
            self._steps += 1
            if self._steps > self.warmup:
                self.times.append(now - self._last)
        self._last = now

    def on_train_end(self, trainer, pl_module):
        self._last = None


def batches_to_run(steps: int, warmup: int) -> int:
    """``warmup`` untimed steps, ``steps`` timed ones, and one batch whose start ends the last."""
    return warmup + steps + 1


def fit(strategy, args, data) -> list[float]:
    L.seed_everything(0, verbose=False)
    model = MLP(args.width, args.depth)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices, num_nodes=1,
                        max_steps=batches_to_run(args.steps, args.warmup), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True))
    return timer.times, trainer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--algorithm", default="gradient_allreduce",
                   help="BaguaStrategy's algorithm: a registered name (default gradient_allreduce)")
    p.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu (default) or gpu")
    p.add_argument("--devices", type=int, default=2, help="processes, one per device (default 2)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per strategy (default 40)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed steps before the timed ones, per strategy (default 5)")
    p.add_argument("--width", type=int, default=1024, help="width of the MLP's layers (default 1024)")
    p.add_argument("--depth", type=int, default=3, help="hidden layers of the MLP (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per process per step (default 64)")
    args = p.parse_args(argv)
    for flag in ("devices", "steps", "width", "depth", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * args.devices * batches_to_run(args.steps, args.warmup)  # one epoch holds every batch
    x = torch.randn(n, args.width, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 10, (n,), generator=g))

    ddp_times, trainer = fit("ddp", args, data)
    bagua_times, trainer = fit(BaguaStrategy(args.algorithm), args, data)
    if trainer.global_rank != 0:
        return
    ddp, bagua = statistics.median(ddp_times), statistics.median(bagua_times)
    if args.accelerator == "cpu":
        device = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    else:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else args.accelerator
    params = sum(p.numel() for p in MLP(args.width, args.depth).parameters())
    print(f"device: {device}; {trainer.world_size} processes; torch {torch.__version__}, lightning {L.__version__}")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"model: MLP width {args.width} depth {args.depth} ({params / 1e6:.2f} M parameters), batch {args.batch_size}"
          f" per process, {len(ddp_times)} timed steps after {args.warmup}")
    print(f"strategy=ddp:   median step {ddp * 1e3:.1f} ms")
    print(f"strategy=bagua ({args.algorithm}): median step {bagua * 1e3:.1f} ms")
    print(f"ratio bagua/ddp step time: {bagua / ddp:.2f}")


if __name__ == "__main__":
    main()
