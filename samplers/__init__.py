"""Data samplers for decentralized training on heterogeneous (non-IID) data."""

from .dirichlet import DirichletPartitionError, dirichlet_partition, encode_labels, equalize
from .heterogeneous import DistributedHeterogeneousSampler

__all__ = [
    "DirichletPartitionError",
    "DistributedHeterogeneousSampler",
    "dirichlet_partition",
    "encode_labels",
    "equalize",
]
