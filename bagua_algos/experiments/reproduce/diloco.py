"""DiLoCo (Douillard et al. 2023): the number of inner steps H against synchronous
training."""

from __future__ import annotations

import torch

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.protocol import PROTOCOLS
from bagua_algos.experiments.reproduce.compare import compare
from bagua_algos.experiments.reproduce.output import print_table
from bagua_algos.experiments.reproduce.rows import Row


DILOCO_H = (1, 10, 50, 200)
DILOCO_LR_GRID = (3e-4, 1e-3, 3e-3)
# DiLoCo (Douillard et al. 2023) varies the number of inner steps H at a fixed compute
# budget: fewer synchronisations cost little accuracy (its figure of H: 8 workers, H up to
# 2000, against the synchronous baseline). Its protocol (the protocol "diloco"): the inner
# optimizer AdamW, weight decay 0.1, linear warm-up then cosine decay, and the baseline
# data-parallel AdamW; the outer step is the algorithm's (Nesterov, 0.7, 0.9). The proxy:
# seed 001's MNIST MLP, 8 workers x 32, 40 epochs (about 600 steps, so that H = 200
# synchronises three times); the inner rate tuned per row over an AdamW grid.
DILOCO = {
    "seed": rt.Setting("cifar10", "resnet18", 8, 128, 100, lr=1e-3, protocol=PROTOCOLS["diloco"]),
    "proxy": rt.Setting("mnist", "mlp", 8, 32, 40, lr=1e-3, protocol=PROTOCOLS["diloco"]),
}


def diloco_h(ctx):
    """DiLoCo at H ∈ {1, 10, 50, 200} against gradient allreduce (synchronous): the
    workers' accuracy and each one's bytes per step, 4·d/H for DiLoCo (one allreduce of
    the d-parameter pseudo-gradient every H steps) against 4·d every step."""
    # Every row's inner rate tuned on the mean over seeds
    rows = [Row("synchronous (gradient allreduce)", "gradient_allreduce",
                seed={"paper": "the baseline"}, lr_grid=DILOCO_LR_GRID)]
    rows += [Row(f"DiLoCo H={h}", "diloco", {"sync_every": h}, lr_grid=DILOCO_LR_GRID,
                 seed={"paper": "close to the baseline up to large H, degrading slowly"}) for h in DILOCO_H]
    out = compare(ctx, DILOCO, rows, ["paper"], curves="accuracy", lr_label=True,
                  seed_text="the paper's C4 language model, 8 workers, H from 50 to 2000 at a fixed compute budget "
                            "(its figure of H): a trend, no table of numbers",
                  differs="proxy: MNIST subset and a 2-layer MLP, 8 workers x 32, 40 epochs, the paper's inner "
                          "AdamW (weight decay 0.1) with its warm-up and cosine decay scaled to 40 epochs, the "
                          "outer Nesterov SGD of DiLoCo's defaults (0.7, 0.9)")
    setting = ctx.setting(DILOCO)
    data = ctx.data(setting.dataset)
    torch.manual_seed(0)
    d = sum(p.numel() for p in rt.make_model(setting.model, data.image_shape, data.num_classes).parameters())
    print()
    table = []
    for record in out:
        h = next((k for k in DILOCO_H if record["method"] == f"DiLoCo H={k}"), 1)
        record["bytes_per_step"] = 4 * d / h
        table.append([record["method"], f"{4 * d / h / 2**10:.1f} KiB", f"{h}x fewer" if h > 1 else "as many"])
    print_table(["method", "bytes per step, a worker", "against synchronous"], table)
    print(f"\n   wrote {ctx.write_csv(out)}")
