"""Seed 001, the PowerSGD paper: Tables 1-4, 6, 10, 11 and Figure 7."""

from __future__ import annotations

import torch

from bagua_algos.experiments.reproduce.compare import compare
from bagua_algos.experiments.reproduce.output import print_table
from bagua_algos.experiments.reproduce.published import TABLE_10, TABLE_11
from bagua_algos.experiments.reproduce.rows import Row, at_powersgd_bytes
from bagua_algos.experiments.reproduce.settings import NO_NETWORK, POWERSGD, POWERSGD_DIFFERS


UNBIASED_RATES = (0.001, 0.003, 0.01, 0.03)
"""The unbiased low-rank rows' rates: its estimate's variance is (m + 1)/r times the
gradient's, and at SGD's rate it diverged on the proxy's MLP (at 0.01 too, on every seed)."""

UNBIASED_DIFFERS = (
    "; the unbiased rows read 10 points above the seed's (81/84 against 71/76) for a measured reason, not a "
    "defect: the algorithm is the text's (a fresh shared U of N(0, 1/r) entries each step, (MU)U^T, no error "
    "feedback, no warm start), and its estimate is less noisy relative to the gradient on the MLP than on "
    "ResNet-18 (E||G^ - G||^2/||G||^2 at initialisation, printed above: about 630 / 316 at rank 1 / 2 against "
    "ResNet-18's 1353 / 677): at about equal noise (our rank 1, ResNet-18's rank 2) ours still reads 81 against 76, the rest being the task's "
    "(an MNIST MLP against CIFAR-10's ResNet-18); fewer epochs are not the reason (at 60 epochs, rate 0.003: 85.9 / 88.1). epfml/powersgd's code for these rows "
    "(HalfRankKReducer without memory) orthonormalises U and reuses it across steps, not the text's estimator")


def unbiased_noise(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int) -> float:
    """E‖Ĝ − G‖² / ‖G‖² of the unbiased rank-``rank`` estimate Ĝ of the gradient G of
    ``model`` on the batch (x, y): with U of N(0, 1/r) entries, E‖M − M U Uᵀ‖² = ‖M‖²·(m + 1)/r
    for each compressed m-column matrix M (the module notes of
    :mod:`bagua_algos.algorithms.unbiased_low_rank`), 0 for a tensor sent whole."""
    from bagua_algos.algorithms.unbiased_low_rank import UnbiasedLowRankAlgorithm
    from bagua_algos.compression.powersgd import matrix_shape

    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    plan = UnbiasedLowRankAlgorithm(rank=rank).plan([tuple(g.shape) for g in grads])
    noise = 0.0
    for i, g in enumerate(grads):
        if not plan.whole(i):
            n, m = matrix_shape(g.shape)
            noise += float(g.double().pow(2).sum()) * (m + 1) / min(rank, n, m)
    return noise / sum(float(g.double().pow(2).sum()) for g in grads)


def _print_unbiased_noise(ctx) -> None:
    """The unbiased estimate's relative noise at initialisation on the proxy's model (a
    batch of 256 training images) and on the seed's CIFAR ResNet-18 (64 random inputs)."""
    from bagua_algos.experiments import reproduce_train as rt
    from bagua_algos.experiments.cifar_resnet import CifarResNet18

    setting = ctx.setting(POWERSGD)
    data = ctx.data(setting.dataset)
    torch.manual_seed(0)
    proxy = rt.make_model(setting.model, data.image_shape, data.num_classes).to(ctx.device)
    resnet = CifarResNet18().to(ctx.device)
    x, y = torch.randn(64, 3, 32, 32, device=ctx.device), torch.randint(0, 10, (64,), device=ctx.device)
    cells = [f"rank {r}: {setting.model} {unbiased_noise(proxy, data.train_x[:256], data.train_y[:256], r):.0f}, "
             f"ResNet-18 {unbiased_noise(resnet, x, y, r):.0f}" for r in (1, 2)]
    print(f"   the unbiased estimate's E||G^ - G||^2 / ||G||^2 at initialisation: {'; '.join(cells)}")


def seed001_table1(ctx):
    _print_unbiased_noise(ctx)
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB"}),
        Row("Rank-1 PowerSGD", "powersgd", {"rank": 1}, seed={"acc": "93.6%", "data/epoch": "4 MB"}),
        Row("Rank-2 PowerSGD", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB"}),
        Row("Unbiased rank 1", "unbiased_low_rank", {"rank": 1}, seed={"acc": "71.2%", "data/epoch": "3 MB"},
            lr_grid=UNBIASED_RATES),
        Row("Unbiased rank 2", "unbiased_low_rank", {"rank": 2}, seed={"acc": "75.9%", "data/epoch": "4 MB"},
            lr_grid=UNBIASED_RATES),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch"], data_column=True, lr_label=True,
            differs=POWERSGD_DIFFERS + "; the unbiased rows' learning rate tuned on the mean over the seeds over "
            f"{list(UNBIASED_RATES)}: at SGD's 0.1 they diverged in the first epoch on the MLP" + UNBIASED_DIFFERS)


def seed001_table2(ctx):
    rows = [
        Row("Best approximation", "powersgd", {"rank": 2, "power_iterations": 4, "warm_start": False},
            seed={"acc": "94.4%"}),
        Row("Warm start (default)", "powersgd", {"rank": 2}, seed={"acc": "94.4%"}),
        Row("Without warm start", "powersgd", {"rank": 2, "warm_start": False}, seed={"acc": "94.0%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc"], data_column=True)


def seed001_table3(ctx):
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB (1x)",
                                                            "time/batch": "312 ms +0%"}),
        Row("Rank 1", "powersgd", {"rank": 1}, seed={"acc": "93.6%", "data/epoch": "4 MB (243x)",
                                                     "time/batch": "220 ms -26%"}),
        Row("Rank 2", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB (136x)",
                                                     "time/batch": "239 ms -23%"}),
        Row("Rank 4", "powersgd", {"rank": 4}, seed={"acc": "94.5%", "data/epoch": "14 MB (72x)",
                                                     "time/batch": "260 ms -16%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            curves="accuracy", differs=POWERSGD_DIFFERS + NO_NETWORK)


SEPARATELY_TUNED = (0.003125, 0.00625, 0.0125, 0.025, 0.05, 0.1)
"""The rates a Table 4 compressor other than PowerSGD is tuned over: the seed tuned each
method's learning rate on its own; at the shared 0.1, Random Block and Random K with error
feedback diverged here. With error feedback a random entry waits about numel / b steps
between sends, so their stable rate falls with the budget b: at rank 2's bytes both chose
the lowest rate of a grid that stopped at 0.0125."""


def seed001_table4(ctx):
    def s(acc, data, time_):
        return {"acc": acc, "data/epoch": data, "time/batch": time_}

    rows = [
        Row("No compression", table_label="gradient_allreduce", seed=s("94.3%", "1023 MB", "312 ms")),
        Row("Medium: Rank 7", "powersgd", {"rank": 7}, seed=s("94.6%", "24 MB", "285 ms")),
        Row("Medium: Random Block", "random_block", {"powersgd_rank": 7}, seed=s("93.3%", "24 MB", "243 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Random K", "random_k", {"powersgd_rank": 7}, seed=s("94.0%", "24 MB", "540 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Sign+Norm", "sign_norm", {}, seed=s("93.9%", "32 MB", "429 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Top K", "top_k", {"bytes_fraction": 1 / 32}, seed=s("94.4%", "32 MB", "444 ms")),
        Row("High: Rank 2", "powersgd", {"rank": 2}, seed=s("94.4%", "8 MB", "239 ms")),
        Row("High: Random Block", "random_block", {"powersgd_rank": 2}, seed=s("87.8%", "8 MB", "240 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("High: Random K", "random_k", {"powersgd_rank": 2}, seed=s("92.6%", "8 MB", "534 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("High: Top K", "top_k", at_powersgd_bytes(2), seed=s("93.6%", "8 MB", "411 ms")),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            differs=POWERSGD_DIFFERS + NO_NETWORK + "; Top K at the medium budget takes Sign+Norm's 1/32 of the "
            "bytes, as in the seed; Random Block, Random K and Sign+Norm tuned on the mean over the seeds over "
            f"{list(SEPARATELY_TUNED)} (the seed tuned each method)")


TABLE_6_ATOMO_RATIO = 1023 / 113
"""Table 6's Atomo budget: 113 MB a epoch against SGD's 1023 MB, 9.05x below the full
gradient (where rank-2 PowerSGD's 8 MB is 136x)."""


def atomo_bytes_ratio(model: torch.nn.Module, rank: int, view: str) -> float:
    """The full gradient's bytes over rank-``rank`` Atomo's message (float32), each tensor
    viewed as a matrix by ``view`` (:class:`bagua_algos.compression.atomo.AtomoCodec`)."""
    import math

    from bagua_algos.compression.atomo import AtomoCodec

    shapes = [tuple(p.shape) for p in model.parameters()]
    return 4 * sum(math.prod(s) for s in shapes) / AtomoCodec(shapes, rank, torch.float32, view).message_bytes


def atomo_rank_at_ratio(model: torch.nn.Module, ratio: float, view: str = "seed") -> int:
    """The rank whose Atomo message is nearest ``ratio`` times smaller than the gradient
    (the ratio falls as the rank grows; the search stops past the widest matrix)."""
    widest = max(max(p.shape) for p in model.parameters())
    return min(range(1, widest + 1), key=lambda r: abs(atomo_bytes_ratio(model, r, view) - ratio))


def seed001_table6(ctx):
    from bagua_algos.experiments import reproduce_train as rt
    from bagua_algos.experiments.cifar_resnet import CifarResNet18

    # Atomo's budget from the seed (Appendix G.6): rank 2, each tensor viewed as a matrix
    # the way its code does ("lower compression at the same rank" than PowerSGD's view)
    resnet = atomo_bytes_ratio(CifarResNet18(), 2, "seed")
    setting = ctx.setting(POWERSGD)
    data = ctx.data(setting.dataset)
    torch.manual_seed(0)
    model = rt.make_model(setting.model, data.image_shape, data.num_classes)
    own, at_table = atomo_bytes_ratio(model, 2, "seed"), atomo_rank_at_ratio(model, TABLE_6_ATOMO_RATIO)
    print(f"   Atomo's budget (seed 001 Appendix G.6): rank 2 with the seed code's matrix view (a vector as N/2 x 2, "
          f"a convolution as (out*in/2) x (2*k*k)); on CIFAR ResNet-18 that is {resnet:.2f}x below the full gradient "
          f"(Table 6: 1023 MB / 113 MB = {TABLE_6_ATOMO_RATIO:.2f}x); on the proxy's {setting.model} (no convolution) "
          f"{own:.1f}x, about PowerSGD's; a second row takes Table 6's ratio: rank {at_table} "
          f"({atomo_bytes_ratio(model, at_table, 'seed'):.2f}x)")
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB",
                                                            "time/batch": "312 ms +0%"}),
        Row("Atomo (rank 2)", "atomo", {"rank": 2, "matrix_view": "seed"},
            seed={"acc": "92.6%", "data/epoch": "113 MB", "time/batch": "948 ms +201%"}, lr_grid=(0.025, 0.05, 0.1)),
        Row(f"Atomo at Table 6's ratio (rank {at_table})", "atomo", {"rank": at_table, "matrix_view": "seed"},
            seed={"acc": "92.6%", "data/epoch": "113 MB (9.05x)", "time/batch": "948 ms +201%"},
            lr_grid=(0.025, 0.05, 0.1)),
        # Signum's momentum is the algorithm's, before the vote (Appendix I): plain SGD applies the vote
        Row("Signum", "signum", {"momentum": 0.9}, seed={"acc": "93.6%", "data/epoch": "32 MB",
                                                         "time/batch": "301 ms -3%"},
            lr_grid=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2), optimizer_momentum=0.0),
        Row("Rank 2 PowerSGD", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB",
                                                              "time/batch": "239 ms -23%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            curves="accuracy", lr_label=True,
            differs=POWERSGD_DIFFERS + NO_NETWORK + "; Atomo's and Signum's lr tuned on the mean over the seeds "
            "over a small grid (the seed tuned them separately, its Appendix I); Atomo's bytes: rank 2 with the seed "
            f"code's matrix view ({own:.1f}x on the MLP, {resnet:.2f}x on ResNet-18 = Table 6's ratio) and rank "
            f"{at_table} at Table 6's {TABLE_6_ATOMO_RATIO:.2f}x")


def seed001_fig7(ctx):
    rows = [
        Row("Rank-4 w/ error feedback", "powersgd", {"rank": 4}, seed={"final acc": "94.4%"}),
        Row("Rank-4 w/o error feedback", "powersgd", {"rank": 4, "error_feedback": False},
            seed={"final acc": "< 88.5% (read off the plot)"}),
    ]
    compare(ctx, POWERSGD, rows, ["final acc"], curves="accuracy")


class WikiTextLSTM(torch.nn.Module):
    """The parameters of seed 001's LSTM (Table 11): a 28869-word embedding of 650 tied
    to the decoder, three LSTM layers of 650 and the decoder's bias. Only the shapes are
    used (the training data, WikiText-2, is not here)."""

    def __init__(self, vocabulary: int = 28869, width: int = 650, layers: int = 3):
        super().__init__()
        self.encoder = torch.nn.Parameter(torch.empty(vocabulary, width))
        self.rnn = torch.nn.LSTM(width, width, layers)
        self.decoder_bias = torch.nn.Parameter(torch.empty(vocabulary))


def _ratio_table(ctx, model, seed_table, seed_totals, title):
    from bagua_algos.compression.powersgd import compression_summary

    summary = compression_summary(model, rank=1)
    layers = {layer["name"].removesuffix(".weight"): layer for layer in summary["layers"]}
    rows, table = [], []
    for name, (shape, ratio) in seed_table.items():
        layer = layers[name]
        rows.append({"parameter": name, "seed_matrix": f"{shape[0]}x{shape[1]}", "seed_ratio_x_r": ratio,
                     "ours_matrix": "x".join(map(str, layer["matrix_shape"])), "ours_ratio_x_r": layer["ratio"],
                     "uncompressed_kib": layer["uncompressed_bytes"] / 1024})
        table.append([name, f"{shape[0]} x {shape[1]}", f"{ratio}/r", " x ".join(map(str, layer["matrix_shape"])),
                      f"{layer['ratio']:.1f}/r", f"{layer['uncompressed_bytes'] / 1024:.0f} KiB"])
    vectors = sum(layer["uncompressed_bytes"] for layer in summary["layers"] if not layer["compressed"])
    total = summary["total_uncompressed_bytes"]
    table.append(["bias vectors (total)", "", seed_totals[0], "", "none", f"{vectors / 1024:.0f} KiB"])
    table.append(["total", "", seed_totals[1], "", f"{summary['total_ratio']:.1f}/r", f"{total / 2**20:.1f} MiB"])
    rows.append({"parameter": "total", "seed_ratio_x_r": seed_totals[1], "ours_ratio_x_r": summary["total_ratio"],
                 "uncompressed_kib": total / 1024})
    print_table(["parameter", "seed: matrix", "seed: ratio", "ours: matrix", "ours: ratio (rank 1)", "ours: size"],
                table)
    print(f"\n   wrote {ctx.write_csv(rows)}")


def seed001_table10(ctx):
    from bagua_algos.experiments.cifar_resnet import CifarResNet18

    ctx.header("CIFAR-10 ResNet-18's parameter shapes and rank-r PowerSGD's per-tensor compression",
               "the same model (bagua_algos/experiments/cifar_resnet.py), bagua_algos.compression.powersgd.compression_summary",
               "none: shapes and arithmetic only (tests/test_powersgd_math.py asserts it)")
    _ratio_table(ctx, CifarResNet18(), TABLE_10, ("38 KB, none", "43 MB, 243/r"), "Table 10")


def seed001_table11(ctx):
    ctx.header("WikiText-2 LSTM's parameter shapes and rank-r PowerSGD's per-tensor compression",
               "an LSTM with the table's shapes (tied encoder/decoder), compression_summary",
               "none: shapes and arithmetic only; the LSTM is not trained (WikiText-2 is not here)")
    _ratio_table(ctx, WikiTextLSTM(), TABLE_11, ("174 KB, none", "110 MB, 310/r"), "Table 11")
