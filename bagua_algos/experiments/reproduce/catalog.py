"""Every experiment, by name (:data:`EXPERIMENTS`, ``reproduce list``), and the seeds'
tables and figures with no command and why (:data:`NOT_REPRODUCIBLE`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bagua_algos.experiments.data import CifarAugmentation
from bagua_algos.experiments.lowcomm_frontier import lowcomm_frontier
from bagua_algos.experiments.protocol import Protocol, protocol_named
from bagua_algos.experiments.reproduce.cost import SeedCost
from bagua_algos.experiments.reproduce.diloco import DILOCO, diloco_h
from bagua_algos.experiments.reproduce.relaysum import RELAYSUM_HALVES, RELAYSUM_SEED_RUNS, relaysum_table2
from bagua_algos.experiments.reproduce.seed000 import (seed000_fig4_1, seed000_fig4_2, seed000_fig4_5,
                                                       seed000_fig4_6, seed000_fig4_7, seed000_fig4_8,
                                                       seed000_table4_1)
from bagua_algos.experiments.reproduce.seed001 import (seed001_fig7, seed001_table1, seed001_table2,
                                                       seed001_table3, seed001_table4, seed001_table6,
                                                       seed001_table10, seed001_table11)
from bagua_algos.experiments.reproduce.seed002 import (SEED002_PROTOCOL, seed002_fig5_1, seed002_fig5_2,
                                                       seed002_fig5_3, seed002_table_a)
from bagua_algos.experiments.reproduce.settings import POWERSGD
from bagua_algos.experiments.reproduce.seed004 import seed004_codec, seed004_fig1


def weight_decay_words(protocol: Protocol) -> str:
    """What ``protocol`` does with weight decay, read from its fields."""
    if not protocol.weight_decay:
        return f"protocol {protocol.name}: no weight decay"
    where = "also on normalisation layers" if protocol.decay_norm else "0 on normalisation layers"
    return f"protocol {protocol.name}: weight decay {protocol.weight_decay:g}, {where}"


def seed_scale_training(protocols) -> str:
    """The seed scale's data and training in words: the papers' CIFAR-10 pipeline and
    the weight decay of each protocol it trains under."""
    return (f"none in the data: the papers' CIFAR-10 pipeline ({CifarAugmentation().describe()}); "
            + "; ".join(weight_decay_words(p) for p in protocols))


# The protocols the seed scales train under, read from the experiments' own settings.
POWERSGD_PROTOCOLS = (POWERSGD["seed"].protocol,)
SEED002_PROTOCOLS = (protocol_named(SEED002_PROTOCOL[SEED002_PROTOCOL.index("--protocol") + 1]),)
RELAYSUM_PROTOCOLS = tuple(protocol_named(flags[flags.index("--protocol") + 1]) for flags in RELAYSUM_HALVES.values())


@dataclass(frozen=True)
class Experiment:
    name: str
    source: str  # the seed's table or figure
    summary: str
    run: Callable
    seed_scale: str  # what --scale seed runs, and its estimated time on one GPU (docs/results.md)
    seed_scale_differs: str = ""  # empty: seed_scale_training(protocols)
    needs_data: bool = True  # the seed scale needs --data-dir
    cost: "SeedCost | None" = None  # the seed scale's training, for `estimate`
    protocols: tuple = POWERSGD_PROTOCOLS  # the protocols the seed scale trains under

    def __post_init__(self):
        if not self.seed_scale_differs:
            text = seed_scale_training(self.protocols) if self.needs_data else "none: no CIFAR-10 training"
            object.__setattr__(self, "seed_scale_differs", text)


EXPERIMENTS = [
    Experiment("seed001-table1", "seed 001 Table 1 (= seed 000 Table 2.1)",
               "biased PowerSGD with error feedback vs the unbiased rank-r compressor", seed001_table1,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 15, 300, 16)),
    Experiment("seed001-table2", "seed 001 Table 2 (= seed 000 Table 2.2)",
               "best rank-2 approximation vs warm start vs no warm start", seed001_table2,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 9, 300, 16)),
    Experiment("seed001-table3", "seed 001 Table 3 (ResNet-18 half) and Figure 4 (left)",
               "PowerSGD at ranks 1, 2, 4: accuracy, data/epoch, time/batch; accuracy curves", seed001_table3,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 12, 300, 16)),
    Experiment("seed001-table4", "seed 001 Table 4",
               "compressors with error feedback at rank 7's and rank 2's bytes", seed001_table4,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 30, 300, 16)),
    Experiment("seed001-table6", "seed 001 Table 6 and Figure 5",
               "Spectral Atomo and Signum against rank-2 PowerSGD", seed001_table6,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 18, 300, 16)),
    Experiment("seed001-fig7", "seed 001 Figure 7 (= seed 000 Figure 2.3)",
               "rank-4 PowerSGD with and without error feedback", seed001_fig7,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 6, 300, 16)),
    Experiment("seed001-table10", "seed 001 Table 10", "ResNet-18's shapes and rank-r compression ratios",
               seed001_table10, "the same (no data)", needs_data=False),
    Experiment("seed001-table11", "seed 001 Table 11", "the LSTM's shapes and rank-r compression ratios",
               seed001_table11, "the same (no data)", needs_data=False),
    Experiment("seed000-fig4.1", "seed 000 Figure 4.1", "step time by rank: Gram-Schmidt vs QR", seed000_fig4_1,
               "ResNet-18, batch 128, one GPU, synthetic inputs", needs_data=False),
    Experiment("seed000-fig4.2", "seed 000 Figure 4.2", "forward and backward time against batch size",
               seed000_fig4_2, "VGG-19, batch 128-1024, one GPU, synthetic inputs", needs_data=False),
    Experiment("seed000-fig4.5", "seed 000 Figure 4.5", "the error buffer's norm and the loss over training",
               seed000_fig4_5, "CIFAR-10 ResNet-18, 16 workers, 300 epochs",
               cost=SeedCost("resnet18", 3, 300, 16)),
    Experiment("seed000-fig4.6", "seed 000 Figure 4.6", "decaying error feedback: loss for lambda in [0, 1]",
               seed000_fig4_6, "CIFAR-10 ResNet-18, 16 workers, 300 epochs, lr tuned per lambda",
               cost=SeedCost("resnet18", 30, 300, 16)),
    Experiment("seed000-fig4.7", "seed 000 Figure 4.7", "Nesterov error feedback against PowerSGD",
               seed000_fig4_7, "CIFAR-10 VGG-19 (batch norm), 4 workers x 256, 300 epochs",
               cost=SeedCost("vgg19", 12, 300, 4)),
    Experiment("seed000-fig4.8", "seed 000 Figure 4.8 (accuracy per epoch only)",
               "asynchronous error averaging (full, adaptive) against PowerSGD and SGD", seed000_fig4_8,
               "CIFAR-10 VGG-19 (batch norm), 4 workers x 256, 300 epochs",
               "one device: no transfer is late, so the time axis is not reproduced",
               cost=SeedCost("vgg19", 12, 300, 4)),
    Experiment("seed000-table4.1", "seed 000 Table 4.1", "orthogonalization times on the (r, m) grid",
               seed000_table4_1, "the same grid on a GPU, with this project's CUDA kernel", needs_data=False,
               seed_scale_differs="torch.qr is today's, not the pre-1.9 one the seed timed"),
    Experiment("seed002-fig5.1", "seed 002 Figure 5.1", "RelaySGD on chain, binary tree, double binary tree x alpha",
               seed002_fig5_1, "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 135, 200, 8), protocols=SEED002_PROTOCOLS),
    Experiment("seed002-fig5.2", "seed 002 Figure 5.2", "RelaySGD, D-PSGD and allreduce x alpha", seed002_fig5_2,
               "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 135, 200, 8), protocols=SEED002_PROTOCOLS),
    Experiment("seed002-fig5.3", "seed 002 Figure 5.3", "RelaySGD against allreduce x alpha", seed002_fig5_3,
               "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 90, 200, 8), protocols=SEED002_PROTOCOLS),
    Experiment("seed002-tableA", "seed 002 Tables A.1-A.3", "the 50-epoch learning-rate grid of every row",
               seed002_table_a, "CIFAR-10 VGG-11, 8 workers x 32, 50 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 225, 50, 8), protocols=SEED002_PROTOCOLS),
    Experiment("diloco-h", "DiLoCo (Douillard et al. 2023), its figure of H",
               "the number of inner steps H in {1, 10, 50, 200} against synchronous training", diloco_h,
               "CIFAR-10 ResNet-18, 8 workers x 128, 100 epochs",
               cost=SeedCost("resnet18", 15, 100, 8), protocols=(DILOCO["seed"].protocol,)),
    Experiment("lowcomm-frontier", "SparseLoCo, DeMo, SPARTA, (Streaming) DiLoCo papers: no common table",
               "the low-communication methods at two equal budgets of measured bytes per step, MNIST MLP and a "
               "character-level Transformer", lowcomm_frontier,
               "no seed scale: the papers pre-train LLMs on many GPUs; --scale seed runs the proxy",
               needs_data=False),
    Experiment("relaysum-table2", "RelaySum paper Table 2 (seed 002's source)",
               "all-reduce, RelaySum/Model (chain, trees), RelaySum/Grad, D-PSGD / quasi-global momentum, D², SGP x "
               "alpha, without and with momentum, 16 workers, the worst worker",
               relaysum_table2, "CIFAR-10 VGG-11, 16 workers x 32, 200 epochs, each row over its tuning script's "
               "grid", cost=SeedCost("vgg11", RELAYSUM_SEED_RUNS, 200, 16), protocols=RELAYSUM_PROTOCOLS),
    Experiment("seed004-fig1", "seed 004 Figure 1 (and Figures 2-3: header and tail)",
               "the worked example of the 2-bit min-max codec", seed004_fig1, "the same (no data)",
               needs_data=False),
    Experiment("seed004-codec", "seed 004 (no table: its claim)", "2-bit codec against 8-bit and unquantised runs",
               seed004_codec, "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs",
               cost=SeedCost("vgg11", 15, 200, 8)),
]
BY_NAME = {e.name: e for e in EXPERIMENTS}
# The seed's tables and figures with no command, and why.
NOT_REPRODUCIBLE = [
    ("seed 001 Table 3 (LSTM half), Table 7, Figure 4 (right)", "WikiText-2 is not available offline"),
    ("seed 001 Table 5, Figure 3", "per-phase times and scaling over 2-16 GPUs on two backends need a cluster"),
    ("seed 001 Appendix B figure", "collective timings of a 16-GPU cluster"),
    ("seed 001 Table 9, Figure 6", "a Transformer on WikiText-103 over 32 cloud GPUs"),
    ("seed 001 Table 8", "a setting table (of Table 9), no result"),
    ("seed 001 Figure 1", "an illustration of the compressors"),
    ("seed 001 Lemma 3 (linearity)", "reproduced as a test: tests/test_powersgd_algorithm.py (linearity)"),
    ("seed 000 Figures 4.3, 4.4", "communication and phase times over 2-16 networked nodes"),
    ("seed 000 Figures 2.1, 2.2, 3.1, A.1, A.2", "illustrations"),
    ("seed 002 Table 5.1", "throughput on 8 GPUs (benchmarks/bagua_synthetic.py is the command on such a node)"),
    ("seed 002 Figures 2.1, 2.2, 3.1", "illustrations"),
    ("seed 002 RelaySum's sums", "reproduced as a test against a single-process simulator: "
                                 "tests/test_model_averaging.py::test_relay_matches_single_process_simulator"),
]


def list_experiments() -> None:
    width = max(len(e.name) for e in EXPERIMENTS)
    for e in EXPERIMENTS:
        print(f"{e.name.ljust(width)}  {e.source}: {e.summary}")
    print("\nnot reproducible here (or reproduced by a test):")
    for what, why in NOT_REPRODUCIBLE:
        print(f"  {what}: {why}")
