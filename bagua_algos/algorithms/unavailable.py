"""Bagua's low-precision algorithms, by name, until the MinMaxUInt8 codec exists.

``ByteGradAlgorithm``, ``QAdamAlgorithm`` / ``QAdamOptimizer`` and
``LowPrecisionDecentralizedAlgorithm`` compress with Bagua's MinMaxUInt8 codec, which
bagua-algos does not have yet. Their names import (so a Bagua script's imports work),
and constructing one raises a clear error at once rather than training differently.
"""

from __future__ import annotations

__all__ = ["ByteGradAlgorithm", "QAdamAlgorithm", "QAdamOptimizer", "LowPrecisionDecentralizedAlgorithm"]


def _refuse(name: str):
    class Unavailable:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"{name} needs Bagua's MinMaxUInt8 compression, which this version of bagua-algos does "
                "not have yet; available algorithms: gradient_allreduce, allreduce_average, "
                "decentralized, relay, async"
            )

    Unavailable.__name__ = Unavailable.__qualname__ = name
    return Unavailable


ByteGradAlgorithm = _refuse("ByteGradAlgorithm")
QAdamAlgorithm = _refuse("QAdamAlgorithm")
QAdamOptimizer = _refuse("QAdamOptimizer")
LowPrecisionDecentralizedAlgorithm = _refuse("LowPrecisionDecentralizedAlgorithm")
