"""The one-process engine: n workers of one job stacked along a worker dimension and
trained together on one device, a backend of the runtime: each algorithm's own hooks
and bucket ops run on stacked buckets, behind ``comm`` a stacked communicator
(docs/engine.md).

An experiment engine, not a distributed runtime: it is for jobs that fit one device;
past that, the per-rank path on torchrun scales out."""

from .engine import Engine
from .runtime import EngineRefusal, StackedRuntime, refusal
from .stacked import Layout, StackedModel

# the engine forms of the algorithms that have one, registered on import (forms.py)
from . import relay as _relay_form  # noqa: F401

__all__ = ["Engine", "EngineRefusal", "Layout", "StackedModel", "StackedRuntime", "refusal"]
