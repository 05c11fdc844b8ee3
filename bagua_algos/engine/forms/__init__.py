"""Each algorithm's form on the stacked state, one file per algorithm, and the table
from an ``Algorithm`` class to its form (:func:`register_form` adds one from outside)."""

from __future__ import annotations

from .base import StackedForm

__all__ = ["StackedForm", "register_form", "form_for", "registered_forms"]

_FORMS: dict = {}
# Algorithms the engine refuses, with the reason (an algorithm class -> why).
_REFUSED: dict = {}


def register_form(algorithm_class, form_class) -> None:
    """Run ``algorithm_class`` on the one-process engine with ``form_class`` (a
    :class:`StackedForm` subclass). The hook for an algorithm outside the package,
    e.g. the template ``examples/ef_sign_sgd.py``."""
    if not (isinstance(form_class, type) and issubclass(form_class, StackedForm)):
        raise TypeError(f"form_class must be a subclass of bagua_algos.engine.StackedForm, got {form_class!r}")
    _FORMS[algorithm_class] = form_class


def registered_forms() -> dict:
    return dict(_FORMS)


def form_for(algorithm):
    """The form class of ``algorithm`` (an Algorithm instance), or None: the engine
    runs the algorithm's own hooks and ops (engine/runtime.py)."""
    for cls in type(algorithm).__mro__:
        if cls in _FORMS:
            return _FORMS[cls]
        if cls in _REFUSED:
            raise TypeError(f"the one-process engine does not run {type(algorithm).__name__}: {_REFUSED[cls]}")
    return None


def _register_builtin() -> None:
    from ...algorithms import (AllreduceAverageAlgorithm, AsyncModelAverageAlgorithm, AtomoAlgorithm, ByteGradAlgorithm,
                               DecentralizedAlgorithm, GradientAllReduceAlgorithm, LowPrecisionDecentralizedAlgorithm,
                               PowerSGDAlgorithm, QAdamAlgorithm, RandomBlockAlgorithm, RandomKAlgorithm,
                               RelayAlgorithm, SignNormAlgorithm, SignumAlgorithm, TernGradAlgorithm, TopKAlgorithm,
                               UnbiasedLowRankAlgorithm)
    from .powersgd import PowerSGDForm

    register_form(PowerSGDAlgorithm, PowerSGDForm)


_register_builtin()
