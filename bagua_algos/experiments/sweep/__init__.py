"""The heterogeneity sweep: every algorithm × topology × Dirichlet α on N local workers
(``bagua-algos sweep``, ``python benchmarks/heterogeneity_sweep.py``).

One module per concern:

- ``config``: :class:`~bagua_algos.experiments.sweep.config.SweepConfig`, every setting of a sweep
  as one frozen value, checked when built (in Python too), which the other modules read;
- ``cli``: the flags, the SweepConfig they make, the checks against the machine (GPUs,
  memory, ``--resume``), what ``--engine auto`` and ``--jobs`` resolve to, and ``main``;
- ``runs``: one run on either engine through the experiments' training loop
  (:mod:`bagua_algos.experiments.training`) and every run of the sweep in turn, the lr grid
  extended where a row's best rate is at its edge;
- ``schedule``: how many runs train at a time (idle CPUs) and the pool that trains them
  (forked on the CPU; spawned, one per GPU slot, with ``--device cuda``);
- ``executors``: ``--executor local|ray``: where the local jobs' GPUs are, and each run
  one Ray task on a Ray cluster, the driver keeping the run log;
- ``runlog``: ``runs.jsonl``, each finished run kept as it ends, and ``--resume``;
- ``report``: the best run per (config, α), the table, ``results.csv`` and ``results.json``;
- ``plots``: accuracy against epochs and the workers' class histograms;
- ``memory``: the memory a run needs and what the machine has.
"""
