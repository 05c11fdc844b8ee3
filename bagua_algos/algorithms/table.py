"""The algorithm table: every registered algorithm in each topology and mode that
matters, as one row each, with what tests and benchmarks need to know about it.

One list, read by everything that runs "every algorithm": the GPU tests (CUDA against
CPU, NCCL against gloo), the host-staging test, the world-size-one test, the Lightning
test, the heterogeneity sweep's default rows, and the one-process engine. A test
checks that the table names every algorithm the package registers, so an algorithm
added without a row fails the suite.

A row (:class:`AlgorithmConfig`) is a registry name, keyword arguments for its
constructor and traits. To train with a row::

    config = config_by_label("relay_chain")
    optimizer = config.optimizer_for(model.parameters(), lambda params: torch.optim.SGD(params, lr=0.1))
    algorithm = config.build(optimizer)
    model.with_bagua([optimizer], algorithm)

``optimizer_for`` returns the caller's optimizer, except for an algorithm built on an
optimizer of its own (``qadam``: :class:`~bagua_algos.algorithms.q_adam.QAdamOptimizer`,
whose state the algorithm reads and writes), for which it builds that one from the
row's :class:`OwnOptimizer`; ``build`` then hands it to the algorithm.

Rows pickle (the keyword arguments travel as plain dicts); across processes a label
is enough: :func:`config_by_label`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from ..arguments import check_choice, check_flag, check_int, check_real
from ..runtime.algorithm import Algorithm
from .q_adam import QAdamOptimizer

__all__ = ["AlgorithmConfig", "OwnOptimizer", "ALGORITHM_TABLE", "REPLICAS", "config_by_label", "one_per_algorithm"]

REPLICAS = ("equal", "differ", "drift")
"""What an algorithm does to the workers' models (the ``replicas`` trait):

- ``"equal"``: every worker holds the same model after every step (the centralized
  algorithms: one averaged gradient, or the average of the models, applied everywhere);
- ``"differ"``: the models differ after a step whatever the number of workers (D-PSGD
  applies each worker's own gradient after mixing);
- ``"drift"``: they may differ and are pulled together over steps (relay's delayed
  sums, the low-precision ring, asynchronous rounds); with two workers some of these
  leave them equal."""


def _read_only(mapping: Mapping[str, Any], what: str) -> Mapping[str, Any]:
    if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
        raise TypeError(f"{what} must be a mapping from argument names (str) to values, got {mapping!r}")
    return MappingProxyType(dict(mapping))


class _PicklesAsDicts:
    """Pickling for a frozen dataclass holding MappingProxyType fields (which do not
    pickle): rebuilt from its fields, the mappings as plain dicts."""

    def __reduce__(self):
        values = tuple(dict(v) if isinstance(v, MappingProxyType) else v
                       for v in (getattr(self, f.name) for f in fields(self)))
        return type(self), values


@dataclass(frozen=True)
class OwnOptimizer(_PicklesAsDicts):
    """The optimizer an algorithm is built on, and how the algorithm takes it."""

    cls: type  # the optimizer's class
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # its keyword arguments
    argument: str = ""  # the algorithm's keyword argument that takes the optimizer

    def __post_init__(self):
        if not (isinstance(self.cls, type) and issubclass(self.cls, torch.optim.Optimizer)):
            raise TypeError(f"cls must be a torch.optim.Optimizer subclass, got {self.cls!r}")
        object.__setattr__(self, "kwargs", _read_only(self.kwargs, "kwargs"))
        if not isinstance(self.argument, str) or not self.argument:
            raise ValueError(
                f"argument must name the algorithm's keyword argument for the optimizer, got {self.argument!r}")


@dataclass(frozen=True)
class AlgorithmConfig(_PicklesAsDicts):
    """One row of the table: an algorithm in one topology or mode, with its traits."""

    label: str  # unique in the table: names the row in test ids, results and look-ups
    name: str  # the GlobalAlgorithmRegistry name
    kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # the constructor's (read-only)
    # The optimizer the algorithm is built on (qadam); None: it trains with the caller's.
    own_optimizer: Optional[OwnOptimizer] = None
    # Fewest workers it runs with, and whether their number must be even (shift_one
    # pairs the workers up); with_bagua refuses other counts.
    min_workers: int = 1
    even_workers: bool = False
    replicas: str = "equal"  # one of REPLICAS
    # It communicates in background rounds on a thread of its own (async): a run
    # depends on timing, so two runs of one seed differ; abort(model) stops the rounds
    # and averages once, after which the models are equal.
    background_rounds: bool = False
    # A CPU run and a CUDA run of one seed agree up to `tolerance`. False for stochastic
    # rounding: the CPU and CUDA generators expand the same keys to different numbers.
    device_independent: bool = True
    # Absolute tolerance between runs of one seed on different devices or backends:
    # float rounding; for quantized messages the size of a level (CUDA's fused
    # multiply-add can put one value on the other side of a rounding boundary).
    tolerance: float = 1e-5
    # With one worker its communication is an exact identity: training equals the
    # optimizer alone (async: after abort), and the bucket ops say local_only.
    exact_alone: bool = False
    # A default row of benchmarks/heterogeneity_sweep.py (its --configs default).
    in_sweep: bool = False

    def __post_init__(self):
        for what in ("label", "name"):
            value = getattr(self, what)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{what} must be a non-empty string, got {value!r}")
        object.__setattr__(self, "kwargs", _read_only(self.kwargs, f"{self.label}: kwargs"))
        if self.own_optimizer is not None and not isinstance(self.own_optimizer, OwnOptimizer):
            raise TypeError(f"{self.label}: own_optimizer must be an OwnOptimizer or None, got {self.own_optimizer!r}")
        check_int(f"{self.label}: min_workers", self.min_workers, 1)
        for flag in ("even_workers", "background_rounds", "device_independent", "exact_alone", "in_sweep"):
            check_flag(f"{self.label}: {flag}", getattr(self, flag))
        check_choice(f"{self.label}: replicas", self.replicas, REPLICAS)
        check_real(f"{self.label}: tolerance", self.tolerance, 0.0, low_open=True)

    def runs_with(self, world_size: int) -> bool:
        """Whether the algorithm runs with ``world_size`` workers."""
        return world_size >= self.min_workers and not (self.even_workers and world_size % 2)

    def optimizer_for(self, params: Iterable, default: Callable[[Iterable], torch.optim.Optimizer]):
        """The optimizer to train ``params`` with: the algorithm's own (built from
        ``own_optimizer``) if it has one, else ``default(params)``."""
        if self.own_optimizer is None:
            return default(params)
        return self.own_optimizer.cls(params, **self.own_optimizer.kwargs)

    def build(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Algorithm:
        """A new Algorithm of this row. A row with ``own_optimizer`` needs that optimizer
        (the one :meth:`optimizer_for` returns); other rows do not use ``optimizer``."""
        kwargs = dict(self.kwargs)
        if self.own_optimizer is not None:
            if not isinstance(optimizer, self.own_optimizer.cls):
                raise TypeError(
                    f"{self.label}: {self.name!r} is built on its own {self.own_optimizer.cls.__name__}; pass the "
                    f"optimizer that optimizer_for(params, ...) returns, got {type(optimizer).__name__}"
                )
            kwargs[self.own_optimizer.argument] = optimizer
        return Algorithm.init(self.name, **kwargs)


_QADAM_OPTIMIZER = OwnOptimizer(QAdamOptimizer, {"lr": 0.01, "warmup_steps": 2}, "q_adam_optimizer")

# The first row of each name is that algorithm's representative (one_per_algorithm).
# The rows with in_sweep=True are the sweep's defaults, in this order.
ALGORITHM_TABLE: tuple[AlgorithmConfig, ...] = (
    AlgorithmConfig("gradient_allreduce", "gradient_allreduce", exact_alone=True),
    AlgorithmConfig("gradient_allreduce_hierarchical", "gradient_allreduce", {"hierarchical": True},
                    exact_alone=True),
    AlgorithmConfig("allreduce_average", "allreduce_average", exact_alone=True, in_sweep=True),
    # Bagua's defaults: average within each node, gossip ("all") between node leaders.
    AlgorithmConfig("decentralized", "decentralized", replicas="differ", exact_alone=True),
    AlgorithmConfig("decentralized_ring", "decentralized", {"hierarchical": False, "topology": "ring"},
                    replicas="differ", exact_alone=True, in_sweep=True),
    AlgorithmConfig("decentralized_all", "decentralized", {"hierarchical": False, "peer_selection_mode": "all"},
                    replicas="differ", exact_alone=True, in_sweep=True),
    AlgorithmConfig("decentralized_shift_one", "decentralized",
                    {"hierarchical": False, "peer_selection_mode": "shift_one"},
                    min_workers=2, even_workers=True, replicas="differ"),
    AlgorithmConfig("relay_chain", "relay", {"topology": "chain"}, replicas="drift", exact_alone=True, in_sweep=True),
    AlgorithmConfig("relay_binary_tree", "relay", {"topology": "binary_tree"}, replicas="drift", exact_alone=True,
                    in_sweep=True),
    AlgorithmConfig("relay_double_binary_tree", "relay", {"topology": "double_binary_tree"}, replicas="drift",
                    exact_alone=True, in_sweep=True),
    # The RelaySum paper's baselines: D-PSGD with quasi-global momentum, D², gradient
    # tracking on the ring; RelaySum/Grad on a chain; Stochastic Gradient Push over the
    # time-varying exponential graph. The first four gossip after the optimizer step, so
    # two workers (a ring of two mixes with weights 1/2) end every step equal: "drift".
    AlgorithmConfig("decentralized_ring_qgm", "decentralized",
                    {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True}, replicas="drift"),
    AlgorithmConfig("d2_ring", "d2", {"topology": "ring"}, replicas="drift", exact_alone=True),
    AlgorithmConfig("gradient_tracking_ring", "gradient_tracking", {"topology": "ring"}, replicas="drift",
                    exact_alone=True),
    AlgorithmConfig("relaysum_grad_chain", "relaysum_grad", {"topology": "chain"}, replicas="drift"),
    AlgorithmConfig("sgp", "sgp", {"topology": "one_peer_exponential"}, replicas="drift", exact_alone=True),
    # The TernGrad paper's setting: 2 bits, stochastic, clipped at 2.5 σ. Unclipped, the
    # sweep's non-IID runs collapse (0.64 at α = 0.1), it seems because the largest entries set each
    # chunk's range and the 4 levels round the rest to ±range/3 (docs/results.md).
    AlgorithmConfig("terngrad", "terngrad", {"bits": 2, "clip": 2.5}, device_independent=False, tolerance=5e-3,
                    in_sweep=True),
    AlgorithmConfig("terngrad_nearest", "terngrad", {"stochastic": False}, tolerance=5e-3),
    # Bagua's default: exact within a node, 8-bit between node leaders.
    AlgorithmConfig("bytegrad", "bytegrad", tolerance=1e-3, exact_alone=True),
    AlgorithmConfig("bytegrad_flat", "bytegrad", {"hierarchical": False}, tolerance=1e-3, in_sweep=True),
    # Gradient compression, synchronous: every worker holds the same model.
    AlgorithmConfig("powersgd", "powersgd", {"rank": 2}, in_sweep=True),
    # Seed 001's linear compressors (allreduce; the same model everywhere). Random Block and
    # Random K at rank-2 PowerSGD's bytes (Table 4's "high rank 2" regime).
    AlgorithmConfig("unbiased_low_rank", "unbiased_low_rank", {"rank": 2}),
    AlgorithmConfig("random_block", "random_block", {"powersgd_rank": 2}),
    AlgorithmConfig("random_k", "random_k", {"powersgd_rank": 2}),
    # The allgather compressors of seed 001 (Table 4, Table 6): deterministic, every worker
    # applies the same update. Across devices a value's sign, or which entry is K-th largest,
    # can flip on a rounding difference and move that weight by a learning-rate-sized step.
    AlgorithmConfig("top_k", "top_k", {"bytes_fraction": 0.1}, tolerance=5e-3),
    AlgorithmConfig("sign_norm", "sign_norm", tolerance=5e-3),
    AlgorithmConfig("signum", "signum", tolerance=5e-3),
    # Atomo draws its components on the CPU (the same sets on every device); a CUDA SVD
    # rounds otherwise, and a component's σ/p is a large factor.
    AlgorithmConfig("atomo", "atomo", {"rank": 2}, tolerance=5e-3),
    AlgorithmConfig("low_precision_decentralized", "low_precision_decentralized", {"hierarchical": False},
                    replicas="drift", tolerance=1e-3),
    AlgorithmConfig("qadam", "qadam", own_optimizer=_QADAM_OPTIMIZER, tolerance=1e-3),
    # DiLoCo: inner steps apart, an outer Nesterov step every sync_every (short here, so
    # short runs synchronise); the streaming form with two fragments and 8-bit deltas
    AlgorithmConfig("diloco", "diloco", {"sync_every": 2}, replicas="drift"),
    AlgorithmConfig("diloco_streaming_8bit", "diloco", {"sync_every": 4, "fragments": 2, "compression": "minmax8"},
                    replicas="drift", tolerance=1e-3),
    # Streaming DiLoCo's overlap: each fragment's outer step and merge one step after its sync
    AlgorithmConfig("diloco_streaming_overlap", "diloco", {"sync_every": 4, "fragments": 2, "overlap": 1},
                    replicas="drift"),
    # SparseLoCo: DiLoCo's inner steps, then each worker's error-fed chunk-wise Top-k at 2 bits and a plain
    # outer step on their mean (short H and small chunks, so that short runs synchronise, several chunks a
    # tensor). On another device an entry taken otherwise (a near tie, a level boundary) moves one value.
    AlgorithmConfig("sparseloco", "sparseloco", {"sync_every": 2, "chunk": 8, "topk_density": 0.1},
                    replicas="drift", tolerance=5e-3),
    # DeMo: each worker's momentum, its chunks' top DCT coefficients allgathered, the sign of their decoded mean
    # applied by SGD (as signum, a sign decided otherwise on another device moves a weight by a step)
    AlgorithmConfig("demo", "demo", {"chunk": 8, "topk": 8}, tolerance=5e-3),
    # SPARTA: a random 5 % of the parameters (the same places everywhere) averaged after every step; alone an
    # average of one is the identity. Then with DiLoCo's outer step every 2 steps.
    AlgorithmConfig("sparta", "sparta", {"fraction": 0.05}, replicas="drift", exact_alone=True),
    AlgorithmConfig("sparta_diloco", "sparta", {"fraction": 0.05, "sync_every": 2}, replicas="drift"),
    AlgorithmConfig("async", "async", {"sync_interval_ms": 5}, replicas="drift", background_rounds=True,
                    exact_alone=True),
)

_BY_LABEL = {config.label: config for config in ALGORITHM_TABLE}
if len(_BY_LABEL) != len(ALGORITHM_TABLE):
    raise RuntimeError(f"ALGORITHM_TABLE: labels repeat: {sorted(c.label for c in ALGORITHM_TABLE)}")


def config_by_label(label: str) -> AlgorithmConfig:
    """The row labelled ``label``."""
    try:
        return _BY_LABEL[label]
    except (KeyError, TypeError):
        raise ValueError(f"no algorithm configuration labelled {label!r}; labels: {sorted(_BY_LABEL)}") from None


def one_per_algorithm() -> tuple[AlgorithmConfig, ...]:
    """The first row of each algorithm name, in table order: every algorithm once."""
    seen: dict[str, AlgorithmConfig] = {}
    for config in ALGORITHM_TABLE:
        seen.setdefault(config.name, config)
    return tuple(seen.values())
