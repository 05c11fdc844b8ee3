"""The one-process engine: n workers of one job stacked along a worker dimension and
trained together on one device, each algorithm in its stacked form (docs/engine.md).

An experiment engine, not a distributed runtime: it is for jobs that fit one device;
past that, the per-rank path on torchrun scales out."""

from .engine import Engine
from .forms import StackedForm, form_for, register_form
from .runtime import EngineRefusal, StackedRuntime, refusal
from .stacked import Layout, StackedModel

__all__ = ["Engine", "EngineRefusal", "Layout", "StackedForm", "StackedModel", "StackedRuntime", "form_for",
           "refusal", "register_form"]
