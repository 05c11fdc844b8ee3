"""The algorithms; importing this package registers each under its Bagua name."""

from .gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceAlgorithmImpl

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]
