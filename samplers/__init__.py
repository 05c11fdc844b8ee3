"""Data samplers for decentralized training on heterogeneous (non-IID) data."""

from .dirichlet import DirichletPartitionError, dirichlet_partition, encode_labels, equalize
from .heterogeneous import DistributedHeterogeneousSampler
from .shares import WorkerShares

__all__ = [
    "DirichletPartitionError",
    "DistributedHeterogeneousSampler",
    "WorkerShares",
    "dirichlet_partition",
    "encode_labels",
    "equalize",
]
