"""``WorkerShares`` lives in :mod:`samplers.shares` (``from samplers import WorkerShares``).

This re-export stays only while experiments/reproduce_train.py and experiments/sweep/runs.py
still import it from here; with their import lines it goes, and the engine imports
nothing but the runtime and the argument checks (tests/test_layers.py).
"""

from samplers.shares import WorkerShares

__all__ = ["WorkerShares"]
