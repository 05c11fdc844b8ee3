"""The one-process engine: n workers of one job stacked along a worker dimension and
trained together on one device, a backend of the runtime: each algorithm's own hooks
and bucket ops run on stacked buckets, ``comm``'s calls answered by its transport
(:class:`~.transport.StackedGroup`, a ``comm.Transport``), and an algorithm's step
replaced by an equal-valued form where the engine has one (:mod:`.forms`; docs/engine.md).

An experiment engine, not a distributed runtime: it is for jobs that fit one device;
past that, the per-rank path on torchrun scales out."""

from .engine import Engine
from .runtime import EngineRefusal, StackedRuntime, refusal
from .stacked import Layout, StackedModel

# the engine forms of the algorithms that have one, registered on import (forms.py)
from . import relay as _relay_form  # noqa: F401

__all__ = ["Engine", "EngineRefusal", "Layout", "StackedModel", "StackedRuntime", "refusal"]
