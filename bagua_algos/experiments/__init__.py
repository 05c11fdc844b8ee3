"""The experiments: the heterogeneity sweep, the seeds' tables (``reproduce``) and the
benchmarks, each a module with a ``main(argv)``, all under one command, ``bagua-algos``
(:mod:`bagua_algos.experiments.cli`; docs/cli.md). The scripts in the repository's
``benchmarks/`` call the same ``main``.

Shared pieces: ``common`` (``--configs`` parsing, starting workers), ``data`` (the data
sets and models), ``training`` (the one training loop of the sweep and ``reproduce``),
``gloo_workers`` (a function run on N local gloo workers), ``cifar_resnet``.
"""
