"""A compared method of an experiment (:class:`Row`) and the algorithm configuration it
runs on the engine; the byte budgets at rank-r PowerSGD's bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch


@dataclass(frozen=True)
class Row:
    """One compared method: a registry name and its arguments (or a row of the
    algorithm table), and the seed's numbers for it by column."""

    label: str
    name: str = ""
    kwargs: Mapping | Callable = field(default_factory=dict)  # or kwargs(model) -> dict
    seed: Mapping = field(default_factory=dict)  # column -> the seed's number, as text
    table_label: str = ""  # a row of bagua_algos.algorithms.table instead of name/kwargs
    lr_grid: tuple = ()  # tune this row's learning rate on the first seed (its own rates)
    optimizer_momentum: float | None = None  # the SGD momentum of this row's optimizer, if not the setting's


def build_config(row: Row, model: torch.nn.Module):
    """(AlgorithmConfig, "") for a row the package runs on the engine, else (None, why)."""
    import bagua_algos.algorithms  # noqa: F401 - registers every algorithm
    from bagua_algos.algorithms.table import AlgorithmConfig, config_by_label
    from bagua_algos.engine import refusal
    from bagua_algos.runtime.algorithm import Algorithm, GlobalAlgorithmRegistry

    if row.table_label:
        base = config_by_label(row.table_label)
        name, kwargs = base.name, dict(base.kwargs)
    else:
        name = row.name
        if name not in GlobalAlgorithmRegistry:
            return None, f"not yet in the package (no algorithm registered as {name!r})"
        kwargs = row.kwargs(model) if callable(row.kwargs) else dict(row.kwargs)
    try:
        algorithm = Algorithm.init(name, **kwargs)
    except TypeError as err:  # an argument the registered algorithm does not take (yet)
        return None, f"not yet in the package ({name}: {err})"
    why = refusal(algorithm)
    if why is not None:
        return None, f"not run: the one-process engine does not run {type(algorithm).__name__}: {why}"
    return AlgorithmConfig(row.label, name, kwargs), ""


def powersgd_bytes_fraction(model: torch.nn.Module, rank: int) -> float:
    """Rank-``rank`` PowerSGD's bytes per step over the model's gradient bytes: Top K's
    budget in the seed's "same bytes as rank r" rows (Table 4). Random Block and Random K
    take ``powersgd_rank=r`` and send rank-r PowerSGD's counts tensor by tensor."""
    from bagua_algos.compression.powersgd import compression_summary

    summary = compression_summary(model, rank)
    return summary["total_compressed_bytes"] / summary["total_uncompressed_bytes"]


def at_powersgd_bytes(rank: int, **extra) -> Callable:
    return lambda model: {"bytes_fraction": powersgd_bytes_fraction(model, rank), **extra}
