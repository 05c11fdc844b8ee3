"""The papers' published numbers, as data: the tables our runs are printed beside.

Seed 001 (the PowerSGD paper) Tables 10 and 11, seed 000 (the PowerSGD thesis) Table
4.1, seed 002 (the RelaySGD thesis) Tables A.1-A.3 and the RelaySum paper's Table 2,
and seed 004's (TernGrad's study report) worked example. The numbers the experiments
quote row by row (a ``Row``'s ``seed``) stay with their experiment."""

from __future__ import annotations


# Seed 001 Table 10: parameter -> (matrix shape, compression x r). And Table 11 (the LSTM).
TABLE_10 = {
    "layer4.1.conv2": ((512, 4608), 461), "layer4.0.conv2": ((512, 4608), 461),
    "layer4.1.conv1": ((512, 4608), 461), "layer4.0.conv1": ((512, 2304), 419),
    "layer3.1.conv2": ((256, 2304), 230), "layer3.1.conv1": ((256, 2304), 230),
    "layer3.0.conv2": ((256, 2304), 230), "layer3.0.conv1": ((256, 1152), 209),
    "layer2.1.conv2": ((128, 1152), 115), "layer2.1.conv1": ((128, 1152), 115),
    "layer2.0.conv2": ((128, 1152), 115), "layer4.0.shortcut.0": ((512, 256), 171),
    "layer2.0.conv1": ((128, 576), 105), "layer1.1.conv1": ((64, 576), 58),
    "layer1.1.conv2": ((64, 576), 58), "layer1.0.conv2": ((64, 576), 58),
    "layer1.0.conv1": ((64, 576), 58), "layer3.0.shortcut.0": ((256, 128), 85),
    "layer2.0.shortcut.0": ((128, 64), 43), "linear": ((10, 512), 10), "conv1": ((64, 27), 19),
}
TABLE_11 = {
    "encoder": ((28869, 650), 636), "rnn.weight_ih_l0": ((2600, 650), 520), "rnn.weight_hh_l0": ((2600, 650), 520),
    "rnn.weight_ih_l1": ((2600, 650), 520), "rnn.weight_hh_l1": ((2600, 650), 520),
    "rnn.weight_ih_l2": ((2600, 650), 520), "rnn.weight_hh_l2": ((2600, 650), 520),
}


def _parse_thesis_table_4_1() -> dict:
    text = """(2, 256) 124 11087 36;(2, 512) 128 11176 39;(2, 1024) 120 10923 35;(2, 2048) 126 12328 52;
    (2, 4096) 132 11774 50;(4, 256) 302 11671 52;(4, 512) 301 10497 51;(4, 1024) 346 11793 54;(4, 2048) 466 12098 51;
    (4, 4096) 461 12448 51;(8, 256) 938 12351 51;(8, 512) 954 12177 56;(8, 1024) 669 11954 51;(8, 2048) 650 12204 62;
    (8, 4096) 807 12500 78;(16, 256) 1366 12214 67;(16, 512) 1321 11780 73;(16, 1024) 1320 12503 89;
    (16, 2048) 1332 12832 113;(16, 4096) 1337 13296 144;(32, 256) 3342 14109 123;(32, 512) 2892 11872 135;
    (32, 1024) 2703 15903 167;(32, 2048) 2727 14239 216;(32, 4096) 2986 18132 278;(64, 256) 5991 14093 234;
    (64, 512) 5438 11562 259;(64, 1024) 6224 13836 322;(64, 2048) 5440 14284 429;(64, 4096) 6446 12940 562;
    (128, 256) 11948 15023 460;(128, 512) 11719 16406 517;(128, 1024) 11729 18203 673;(128, 2048) 11657 17731 911;
    (128, 4096) 12248 27551 1262"""
    table = {}
    for entry in text.split(";"):
        shape, numbers = entry.strip().split(")")
        r, m = (int(v) for v in shape.strip("( ").split(","))
        table[(r, m)] = tuple(int(v) for v in numbers.split())
    return table


# (rank r, rows m) -> Gram-Schmidt, torch.qr (before 1.9), the thesis's CUDA kernel, in us
THESIS_TABLE_4_1 = _parse_thesis_table_4_1()


# Tables A.1-A.3: final test accuracy after 50 epochs, lr -> (alpha 1, 0.1, 0.01).
THESIS_A = {
    "allreduce_average": {0.01: (0.8688, 0.8683, 0.8691), 0.025: (0.8858, 0.8810, 0.8822),
                          0.05: (0.8923, 0.8878, 0.8902), 0.075: (0.8887, 0.8944, 0.8926),
                          0.1: (0.8905, 0.2320, 0.8894)},
    "decentralized_all": {0.01: (0.8668, 0.5543, 0.2970), 0.025: (0.8789, 0.6472, 0.5257),
                          0.05: (0.8846, 0.8074, 0.3379), 0.075: (0.8872, 0.4863, 0.1000),
                          0.1: (0.8837, 0.2851, 0.1000)},
    "relay_double_binary_tree": {0.01: (0.7060, 0.4642, 0.3093), 0.025: (0.8568, 0.8634, 0.8638),
                                 0.05: (0.8759, 0.8757, 0.8785), 0.075: (0.8833, 0.8870, 0.8848),
                                 0.1: (0.8896, 0.8927, 0.8868)},
    "relay_binary_tree": {0.01: (0.6343, 0.5392, 0.7231), 0.025: (0.8512, 0.8575, 0.8649),
                          0.05: (0.8762, 0.8729, 0.8819), 0.075: (0.8853, 0.8885, 0.8862),
                          0.1: (0.8884, 0.1000, 0.1000)},
    "relay_chain": {0.01: (0.7381, 0.7135, 0.7597), 0.025: (0.8553, 0.8646, 0.8644),
                    0.05: (0.8781, 0.8763, 0.8798), 0.075: (0.8850, 0.8881, 0.8792),
                    0.1: (0.8872, 0.1000, 0.8866)},
}
# the Dirichlet alphas of the tables' columns (seed 002's Tables A, the RelaySum paper's Table 2)
ALPHAS = (1.0, 0.1, 0.01)
# the thesis's learning-rate grid: the rows of Tables A.1-A.3
LR_GRID = (0.01, 0.025, 0.05, 0.075, 0.1)


# Vogels et al. 2021 (RelaySum), Table 2: CIFAR-10, VGG-11, 16 workers, 3 seeds, 200 epochs
# (epfml/relaysgd, paper-figures/table_2_cifar_results.ipynb). Every method twice: without
# momentum and with it (local momentum, or quasi-global momentum for D-PSGD), each half
# under its own protocol and learning-rate grid (experiments/neurips21-cifar-*-tuning.py).
# The reported figure is the worst worker: each worker's test accuracy averaged over the
# epochs after 195, the minimum over workers, the mean over seeds.
# half -> table row -> (the paper's method, its worst worker at α = 1, 0.1, 0.01)
RELAYSUM_TABLE2 = {
    "without momentum": {
        "allreduce_average": ("all-reduce", (87.0, 87.0, 87.0)),
        "relay_chain": ("RelaySum/Model (chain)", (87.3, 87.2, 86.5)),
        "relay_double_binary_tree": ("RelaySum/Model (double binary trees)", (87.4, 86.9, 84.6)),
        "relaysum_grad_chain": ("RelaySum/Grad (chain)", (88.8, 88.5, 83.5)),
        "decentralized_ring": ("D-PSGD (ring)", (87.4, 79.9, 53.9)),
        "d2_ring": ("D² (ring)", (87.2, 84.0, 38.2)),
        "sgp": ("SGP (time-varying exponential)", (87.4, 86.7, 86.7)),
    },
    "with momentum": {
        "allreduce_average": ("all-reduce + momentum", (90.2, 90.2, 90.2)),
        "relay_chain": ("RelaySum/Model (chain) + local momentum", (89.5, 89.2, 88.4)),
        "relay_double_binary_tree": ("RelaySum/Model (double binary trees) + local momentum", (90.2, 89.5, 89.1)),
        "relaysum_grad_chain": ("RelaySum/Grad (chain) + local momentum", (86.9, 87.8, 68.6)),
        "decentralized_ring_qgm": ("D-PSGD (ring) + quasi-global momentum", (89.5, 84.8, 63.3)),
        "d2_ring": ("D² (ring) + local momentum", (88.2, 88.5, 61.0)),
        "sgp": ("SGP (time-varying exponential) + local momentum", (89.5, 89.2, 87.5)),
    },
}


def _by_alpha(grid, below_one=(), at=None) -> dict:
    """A tuning script's grid per α of ALPHAS: ``grid``, plus ``below_one`` where α < 1,
    plus ``at[α]`` at that α (the scripts add rates by α)."""
    return {a: tuple(sorted(set(grid) | (set(below_one) if a < 1 else set()) | set((at or {}).get(a, ()))))
            for a in ALPHAS}


# Table 2's learning-rate grids as epfml/relaysgd's tuning scripts (experiments/
# neurips21-cifar-<name>-tuning.py) list them, per half, row and α: half -> row ->
# (script name, {α: grid}). Each script centres its grid on the centralized rate (0.2
# without momentum, 0.1 with) and adds rates at α < 1; RelaySum/Model's scales it by
# corr = 5 on the chain and 3 on the double binary trees. All-reduce is tuned on the IID
# split (data_split_method "random") once.
RELAYSUM_GRIDS = {
    "without momentum": {
        "allreduce_average": ("centralized", _by_alpha((0.1, 0.2, 0.4, 0.8, 1.6))),
        "relay_chain": ("relaysum-model", _by_alpha((0.5, 1.0, 2.0))),
        "relay_double_binary_tree": ("relaysum-model", _by_alpha((0.3, 0.6, 1.2))),
        "relaysum_grad_chain": ("relaysum-grad", _by_alpha((0.1, 0.2, 0.4))),
        # the script's loop without momentum reuses the list of its loop with momentum
        # (0.05, 0.1, and 0.2 at α = 1; 0.025, 0.0125 at α < 1) and adds 0.05 at α < 1
        "decentralized_ring": ("gossip", _by_alpha((0.05, 0.1), (0.0125, 0.025), {1.0: (0.2,)})),
        "d2_ring": ("d2", _by_alpha((0.05, 0.1, 0.2))),
        "sgp": ("push-sum", _by_alpha((0.05, 0.1, 0.2, 0.4))),
    },
    "with momentum": {
        "allreduce_average": ("centralized", _by_alpha((0.05, 0.1, 0.2))),
        # 0.025 at α < 1 is the centralized rate / 4 without corr, as the script has it
        "relay_chain": ("relaysum-model", _by_alpha((0.25, 0.5, 1.0), (0.025,))),
        "relay_double_binary_tree": ("relaysum-model", _by_alpha((0.15, 0.3, 0.6), (0.025,))),
        "relaysum_grad_chain": ("relaysum-grad", _by_alpha((0.05, 0.1), (0.025,))),
        "decentralized_ring_qgm": ("quasi-global", _by_alpha((0.05, 0.1), (0.025,), {1.0: (0.2,), 0.1: (0.2,)})),
        "d2_ring": ("d2", _by_alpha((0.05, 0.1, 0.2), (0.025,))),
        "sgp": ("push-sum", _by_alpha((0.05, 0.1, 0.2, 0.4), (0.025,))),
    },
}
# The rates the paper then ran on 3 seeds (experiments/neurips21-cifar-<name>-reps.py,
# best_lrs; all-reduce: 0.1 in both halves): half -> row -> (α = 1, 0.1, 0.01). Some lie
# outside the tuning script's grid as stored (D-PSGD without momentum 0.4 and 0.2,
# RelaySum/Model (chain) with momentum 0.125 = 0.025 x 5): the scripts were edited
# after tuning.
RELAYSUM_PAPER_LRS = {
    "without momentum": {
        "allreduce_average": (0.1, 0.1, 0.1), "relay_chain": (2.0, 2.0, 1.0),
        "relay_double_binary_tree": (1.2, 0.6, 0.3), "relaysum_grad_chain": (0.4, 0.4, 0.4),
        "decentralized_ring": (0.4, 0.1, 0.2), "d2_ring": (0.2, 0.2, 0.1), "sgp": (0.4, 0.2, 0.2),
    },
    "with momentum": {
        "allreduce_average": (0.1, 0.1, 0.1), "relay_chain": (0.5, 0.5, 0.125),
        "relay_double_binary_tree": (0.6, 0.3, 0.15), "relaysum_grad_chain": (0.05, 0.1, 0.025),
        "decentralized_ring_qgm": (0.1, 0.025, 0.05), "d2_ring": (0.05, 0.05, 0.0126), "sgp": (0.1, 0.1, 0.025),
    },
}


SEED004_EXAMPLE = (-5.0, 2.0, -3.0, 7.0, -1.0, 5.0, 3.0)  # the six inputs and the "3" the report pads with
