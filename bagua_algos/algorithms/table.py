"""The algorithm table: every registered algorithm in each topology and mode that
matters, as one row each, with what tests and benchmarks need to know about it.

One list, read by everything that runs "every algorithm": the GPU tests (CUDA against
CPU, NCCL against gloo), the host-staging test, the world-size-one test, the Lightning
test, the heterogeneity sweep's default rows, and the one-process engine. A test
checks that the table names every algorithm the package registers, so an algorithm
added without a row fails the suite.

A row (:class:`AlgorithmConfig`) is a registry name, keyword arguments for its
constructor and traits. Each algorithm file declares its own rows where it registers
the algorithm, with :func:`register_algorithm` (a position orders them among every
file's rows); bagua_algos.algorithms imports each of its modules, then collects their
rows here, so this module imports no algorithm module. To train with a row::

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
from ..runtime.algorithm import Algorithm, GlobalAlgorithmRegistry

__all__ = ["AlgorithmConfig", "OwnOptimizer", "ALGORITHM_TABLE", "REPLICAS", "config_by_label", "one_per_algorithm",
           "register_algorithm"]

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


# Every declared row by label, with its position: the package's (declared while
# bagua_algos.algorithms imports its modules) and those of modules imported since.
_DECLARED: dict[str, tuple[int, AlgorithmConfig]] = {}

# The package's rows by position: assigned by _collect_package_rows once every module of
# the package is imported (until then reading it raises, see __getattr__ below).
ALGORITHM_TABLE: tuple[AlgorithmConfig, ...]


def register_algorithm(name: str, cls, description: str, rows) -> None:
    """Register ``cls`` in ``GlobalAlgorithmRegistry`` as ``name`` and declare its rows
    of the table: the one call an algorithm file makes, at its end.

    ``rows`` is a non-empty sequence of ``(position, AlgorithmConfig)`` pairs, every
    row of algorithm ``name``. The integer position orders the rows: ALGORITHM_TABLE
    lists the package's rows by increasing position (test ids, the sweep's default
    rows and the first row of each name, one_per_algorithm's, follow it), so a row
    chooses its place among every file's rows without a list kept elsewhere.

    The rows are checked before anything is registered: a bad row leaves neither the
    name nor any row behind. A module outside the package (a user's file) declares its
    rows the same way; they are found by :func:`config_by_label` once it is imported,
    while ALGORITHM_TABLE stays the package's rows, fixed when the package is imported,
    so that what the suite and the sweep run does not depend on what else was imported.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(f"{name!r}: rows must be a sequence of (position, AlgorithmConfig) pairs, got {rows!r}")
    rows = tuple(rows)
    if not rows:
        raise ValueError(f"{name!r}: rows must hold at least one (position, AlgorithmConfig) pair: every "
                         f"algorithm has a row of the table")
    labels = set()
    for pair in rows:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise TypeError(f"{name!r}: each of rows must be a (position, AlgorithmConfig) pair, got {pair!r}")
        position, row = pair
        if not isinstance(row, AlgorithmConfig):
            raise TypeError(f"{name!r}: the second of each rows pair must be an AlgorithmConfig, got {row!r}")
        check_int(f"{row.label}: position", position)
        if row.name != name:
            raise ValueError(f"{row.label}: a row of {name!r} must have name={name!r}, got name={row.name!r}")
        if row.label in labels or row.label in _DECLARED:
            raise ValueError(f"{row.label}: the label is declared twice (labels are unique in the table)")
        labels.add(row.label)
    GlobalAlgorithmRegistry.register(name, cls, description)  # refuses a name already taken, before any row is kept
    for position, row in rows:
        _DECLARED[row.label] = (position, row)


def _collect_package_rows() -> None:
    """Fix ALGORITHM_TABLE: every row declared so far, by position. bagua_algos.algorithms
    calls it once, after importing each of its modules (which declared their rows)."""
    global ALGORITHM_TABLE
    ordered = sorted(_DECLARED.values(), key=lambda pair: pair[0])
    for (first, a), (second, b) in zip(ordered, ordered[1:]):
        if first == second:
            raise ValueError(f"rows {a.label!r} and {b.label!r} have the same position {first}: positions order "
                             f"the table, so each is unique")
    ALGORITHM_TABLE = tuple(row for _, row in ordered)


def __getattr__(attribute: str):
    # Read before _collect_package_rows ran, that is from an algorithm module while the
    # package imports its modules: the table is not complete yet.
    if attribute == "ALGORITHM_TABLE":
        raise RuntimeError("ALGORITHM_TABLE is collected once bagua_algos.algorithms has imported every algorithm "
                           "module; read it after that import, not while a module of the package is imported")
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


def config_by_label(label: str) -> AlgorithmConfig:
    """The row labelled ``label``: one of ALGORITHM_TABLE, or of an algorithm registered
    outside the package whose module is imported."""
    try:
        return _DECLARED[label][1]
    except (KeyError, TypeError):
        raise ValueError(f"no algorithm configuration labelled {label!r}; labels: {sorted(_DECLARED)}") from None


def one_per_algorithm() -> tuple[AlgorithmConfig, ...]:
    """The first row of each algorithm name, in table order: every algorithm once."""
    seen: dict[str, AlgorithmConfig] = {}
    for config in ALGORITHM_TABLE:
        seen.setdefault(config.name, config)
    return tuple(seen.values())
