"""Dirichlet non-IID partition of a labelled data set (pure numpy).

This module holds the math behind :class:`samplers.DistributedHeterogeneousSampler`
so that it can be tested without processes or ``torch.distributed``.

The partition follows ``distribute_data_dirichlet`` from the code of the
RelaySum paper (Vogels et al., 2021), which in turn adapts Tao Lin's
``partition_data.py``:

1. The ``(index, label)`` pairs are shuffled with a generator seeded by ``seed``.
2. The workers are split into consecutive groups of at most ``group_size``
   (10 by default).  Every group but the last receives a contiguous slice of
   ``floor(group_workers * N / num_workers)`` shuffled samples; the last
   group receives what is left.
3. Inside a group with ``T`` samples and ``g`` workers (fair share ``T / g``)
   each class ``c`` in turn is split as follows: draw ``p ~ Dir(alpha * 1_g)``,
   set ``p_j = 0`` for every worker ``j`` that already holds at least its fair
   share, renormalize, and cut the class' (shuffled) indices at
   ``floor(cumsum(p) * n_c)``.
4. If afterwards some worker of the group holds fewer than
   ``floor(T / (2 g))`` samples (half its fair share) the whole group is drawn
   again.  After ``max_attempts`` failed draws a
   :class:`DirichletPartitionError` is raised.

Small ``alpha`` gives each worker few classes (strongly non-IID); large
``alpha`` makes every worker's label mix close to the global one (IID-like).

:func:`equalize` then turns the unequal per-worker lists into equally long
per-rank shares the way the reference's ``distribute_evenly`` option does:
concatenate them in worker order and cut the sequence into contiguous pieces.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DirichletPartitionError",
    "dirichlet_partition",
    "encode_labels",
    "equalize",
    "partition_codes",
    "validate_alpha",
    "validate_int",
]

#: Default number of whole-group redraws before giving up.
DEFAULT_MAX_ATTEMPTS = 1000


class DirichletPartitionError(RuntimeError):
    """No draw met the "at least half the fair share" rule within the attempt limit."""


# --------------------------------------------------------------------------- #
# validation helpers
# --------------------------------------------------------------------------- #
def validate_alpha(alpha: Any, name: str = "alpha") -> float:
    """Return ``alpha`` as a float after checking it is a finite number > 0."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(
            f"{name} must be a real number > 0 (the Dirichlet concentration), "
            f"got {alpha!r} of type {type(alpha).__name__}"
        )
    value = float(alpha)
    if math.isnan(value):
        raise ValueError(f"{name} must be a finite number > 0, got {name}=nan")
    if math.isinf(value):
        raise ValueError(
            f"{name} must be a finite number > 0, got {name}={value}; infinite "
            f"concentration is not supported: for a (nearly) IID split use a large "
            f"finite {name}, e.g. {name}=1e4"
        )
    if value <= 0:
        raise ValueError(
            f"{name} must be a finite number > 0 (smaller = more heterogeneous), "
            f"got {name}={alpha!r}"
        )
    return value


def validate_int(value: Any, name: str, minimum: int) -> int:
    """Return ``value`` as an int after checking it is an integer >= ``minimum`` (bool excluded)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {name}={value}")
    return value


# --------------------------------------------------------------------------- #
# labels
# --------------------------------------------------------------------------- #
def encode_labels(labels: Any) -> tuple[np.ndarray, list]:
    """Map arbitrary hashable labels to class codes ``0 .. C-1``.

    Returns ``(codes, classes)`` where ``codes`` is an ``int64`` array with one
    entry per sample and ``classes[k]`` is the original label value of code
    ``k``.  Codes follow the sorted order of the distinct label values when
    they can be sorted, otherwise the order of first appearance.

    ``labels`` may be a list/tuple, a 1-D numpy array, or any object with a
    ``tolist()`` method (e.g. a torch tensor).
    """
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1:
            raise ValueError(
                f"labels must be one-dimensional (one label per sample), got an "
                f"array of shape {labels.shape}"
            )
        if labels.dtype.kind in "biuUSf":
            classes, codes = np.unique(labels, return_inverse=True)
            return codes.reshape(-1).astype(np.int64, copy=False), classes.tolist()
        values = labels.tolist()
    elif hasattr(labels, "tolist") and not isinstance(labels, (list, tuple, str)):
        values = labels.tolist()
        if any(isinstance(v, list) for v in values):
            raise ValueError(
                "labels must be one-dimensional (one label per sample), got a "
                "nested sequence"
            )
    elif isinstance(labels, (str, bytes)):
        raise TypeError(f"labels must be a sequence of labels, not a single {type(labels).__name__}")
    else:
        values = list(labels)

    first_seen: dict[Hashable, int] = {}
    for position, value in enumerate(values):
        try:
            if value not in first_seen:
                first_seen[value] = len(first_seen)
        except TypeError:
            raise TypeError(
                f"labels must be hashable values, but labels[{position}]={value!r} "
                f"of type {type(value).__name__} is not hashable"
            ) from None

    classes = list(first_seen)
    try:
        classes = sorted(classes)
    except TypeError:
        pass  # not mutually comparable: keep order of first appearance
    lookup = {value: code for code, value in enumerate(classes)}
    codes = np.fromiter((lookup[v] for v in values), dtype=np.int64, count=len(values))
    return codes, classes


# --------------------------------------------------------------------------- #
# the partition
# --------------------------------------------------------------------------- #
def _group_sizes(num_workers: int, group_size: int) -> list[int]:
    full, rest = divmod(num_workers, group_size)
    return [group_size] * full + ([rest] if rest else [])


def _split_group(
    class_indices: list[np.ndarray],
    num_group_workers: int,
    alpha: float,
    rng: np.random.Generator,
    max_attempts: int,
    group_number: int,
) -> list[np.ndarray]:
    """Dirichlet-split one group's samples (given per class) over its workers."""
    total = sum(len(idx) for idx in class_indices)
    fair = total / num_group_workers
    min_required = int(0.5 * total / num_group_workers)
    concentration = np.full(num_group_workers, alpha)

    for _ in range(max_attempts):
        pieces: list[list[np.ndarray]] = [[] for _ in range(num_group_workers)]
        sizes = np.zeros(num_group_workers, dtype=np.int64)
        for idx in class_indices:
            if len(idx) == 0:
                continue
            eligible = sizes < fair
            # While samples remain unassigned some worker is below its fair
            # share, so ``eligible`` is never all False here.
            p = rng.dirichlet(concentration)
            p = np.where(eligible, p, 0.0)
            mass = p.sum()
            if not (mass > 0.0 and np.isfinite(mass)):
                # With tiny alpha the eligible components can all underflow to
                # exactly 0.  The renormalized eligible sub-vector of a
                # symmetric Dirichlet is itself Dir(alpha * 1_k) over the k
                # eligible workers, so drawing that directly is the same
                # distribution without the 0/0.
                p = np.zeros(num_group_workers)
                p[eligible] = rng.dirichlet(np.full(int(eligible.sum()), alpha))
                mass = p.sum()
            p = p / mass
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for worker, chunk in enumerate(np.split(idx, cuts)):
                if len(chunk):
                    pieces[worker].append(chunk)
                    sizes[worker] += len(chunk)
        if sizes.min() >= min_required:
            return [
                np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
                for chunks in pieces
            ]

    raise DirichletPartitionError(
        f"dirichlet_partition: after {max_attempts} attempts no draw for worker "
        f"group {group_number} ({num_group_workers} workers, {total} samples, "
        f"{sum(1 for idx in class_indices if len(idx))} classes present) gave every "
        f"worker at least half its fair share ({min_required} samples) with "
        f"alpha={alpha}. This happens when alpha is small for the number of "
        f"classes (each class then goes to very few workers) or when the classes "
        f"have only a few samples per worker; increase alpha, use fewer workers, "
        f"or use more data."
    )


def partition_codes(
    codes: np.ndarray,
    num_classes: int,
    num_workers: int,
    alpha: float,
    seed: int,
    group_size: int,
    max_attempts: int,
) -> list[np.ndarray]:
    """:func:`dirichlet_partition` on labels already encoded and arguments already checked.

    ``codes`` are class codes ``0 .. num_classes-1`` as :func:`encode_labels` returns
    them, and the other arguments must already have passed :func:`validate_alpha` /
    :func:`validate_int` (with ``1 <= num_workers <= len(codes)``); nothing is checked
    again here. For callers (such as the sampler) that encode the labels themselves
    and keep the codes.
    """
    n = len(codes)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)  # shuffled sample indices
    shuffled_codes = codes[order]

    partitions: list[np.ndarray] = []
    start = 0
    sizes = _group_sizes(num_workers, group_size)
    for group_number, group_workers in enumerate(sizes):
        last = group_number == len(sizes) - 1
        stop = n if last else start + (group_workers * n) // num_workers
        group_order = order[start:stop]
        group_codes = shuffled_codes[start:stop]
        # stable sort by class keeps the shuffled order inside each class
        by_class = np.argsort(group_codes, kind="stable")
        bounds = np.searchsorted(group_codes[by_class], np.arange(num_classes + 1))
        class_indices = [
            group_order[by_class[bounds[c] : bounds[c + 1]]] for c in range(num_classes)
        ]
        partitions.extend(
            _split_group(class_indices, group_workers, alpha, rng, max_attempts, group_number)
        )
        start = stop
    return [p.astype(np.int64, copy=False) for p in partitions]


def dirichlet_partition(
    labels: Sequence[Hashable] | np.ndarray,
    num_workers: int,
    alpha: float,
    seed: int,
    group_size: int = 10,
    *,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> list[np.ndarray]:
    """Split sample indices ``0 .. len(labels)-1`` over workers, non-IID by Dirichlet(alpha).

    Args:
        labels: one hashable label per sample (list, 1-D numpy array, or
            anything with ``tolist()`` such as a tensor).
        num_workers: number of workers (>= 1, <= number of samples).
        alpha: Dirichlet concentration, a finite number > 0.  Small values
            (0.01) give very heterogeneous workers, large values (1e3) nearly
            IID ones.
        seed: non-negative integer; the result depends only on the labels and
            the arguments, so every process computes the same partition.
        group_size: workers are partitioned in groups of at most this many,
            as in the reference implementation (10).
        max_attempts: whole-group redraws allowed before raising
            :class:`DirichletPartitionError`.

    Returns:
        ``num_workers`` ``int64`` arrays of sample indices.  They are disjoint,
        their union is every index, and their lengths differ (use
        :func:`equalize` for equal shares).  Within a worker the indices are
        grouped by class code, each class chunk in shuffled order.
    """
    alpha = validate_alpha(alpha)
    num_workers = validate_int(num_workers, "num_workers", 1)
    group_size = validate_int(group_size, "group_size", 1)
    max_attempts = validate_int(max_attempts, "max_attempts", 1)
    seed = validate_int(seed, "seed", 0)
    codes, classes = encode_labels(labels)
    if len(codes) < num_workers:
        raise ValueError(
            f"num_workers={num_workers} exceeds the number of samples "
            f"({len(codes)} labels); every worker needs at least one sample, so "
            f"use at most {len(codes)} workers or a larger data set"
        )
    return partition_codes(
        codes, len(classes), num_workers, alpha, seed, group_size, max_attempts
    )


# --------------------------------------------------------------------------- #
# equal shares
# --------------------------------------------------------------------------- #
def equalize(
    partitions: Sequence[np.ndarray], num_replicas: int, drop_last: bool = False
) -> list[np.ndarray]:
    """Cut per-worker index lists into ``num_replicas`` equally long shares.

    The lists are concatenated in worker order and the resulting sequence of
    length ``N`` is cut into ``num_replicas`` contiguous pieces, so each share
    keeps the label skew of the workers it overlaps.

    * ``drop_last=False``: every share has ``ceil(N / num_replicas)`` indices;
      the sequence is padded by repeating indices from its start (i.e. the
      first ``pad`` indices of worker 0's list, cycling if ever needed), so up
      to ``num_replicas - 1`` samples appear twice per epoch.
    * ``drop_last=True``: every share has ``floor(N / num_replicas)`` indices;
      the last ``N mod num_replicas`` indices of the sequence are dropped.
    """
    num_replicas = validate_int(num_replicas, "num_replicas", 1)
    arrays = [np.asarray(p, dtype=np.int64).reshape(-1) for p in partitions]
    sequence = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    n = len(sequence)
    if n == 0:
        return [np.empty(0, dtype=np.int64) for _ in range(num_replicas)]
    per_rank = n // num_replicas if drop_last else -(-n // num_replicas)
    # np.resize truncates, or repeats the sequence cyclically from its start
    sequence = np.resize(sequence, per_rank * num_replicas)
    return [
        sequence[r * per_rank : (r + 1) * per_rank].copy() for r in range(num_replicas)
    ]
