"""The same LightningModule under ``strategy="ddp"`` and ``strategy="bagua"``: step time, as a ratio, in one run.

    python benchmarks/lightning_benchmark.py                       # 2 CPU processes, gradient_allreduce
    python benchmarks/lightning_benchmark.py --algorithm powersgd --accelerator gpu --devices 2

Lightning starts the other processes itself (its "popen" launcher re-runs this script),
or takes the ones torchrun / ``python -m bagua_algos.launch`` started. Both fits run in
the same processes, one after the other, on the same data and seed (DDP first: its
process group is then reused by the Bagua strategy). A step is timed from one
``on_train_batch_start`` to the next batch's (forward, backward, communication,
optimizer step, data); the first ``--warmup`` steps are left out; the median is
reported. Rank 0 prints the device, the command and the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402

import bagua_algos.lightning  # noqa: E402,F401 - registers strategy="bagua"
from bagua_algos.lightning import BaguaStrategy  # noqa: E402


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
    def __init__(self):
        self.times, self._last = [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now

    def on_train_end(self, trainer, pl_module):
        self._last = None


def fit(strategy, args, data) -> list[float]:
    L.seed_everything(0, verbose=False)
    model = MLP(args.width, args.depth)
    timer = StepTimer()
    trainer = L.Trainer(strategy=strategy, accelerator=args.accelerator, devices=args.devices, num_nodes=1,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True))
    return timer.times[args.warmup:], trainer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="gradient_allreduce", help="BaguaStrategy's algorithm name")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    args = p.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.devices))
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * args.devices * (args.steps + 1)
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
