"""Engine forms: how the one-process engine installs an equal-valued form of an
algorithm's step, chosen by the engine, not by the algorithm.

An algorithm is written once, for a leading worker dimension, against ``comm``; it
never asks which backend runs it. Where the engine can do the same arithmetic with
fewer passes because every worker is a row of one process (a message built straight
into the row it arrives in, say), that faster form lives here in ``bagua_algos/engine/``
and replaces a part of the impl that the algorithm exposes for the purpose (relay's
``delivery``): the algorithm documents the hook, the engine fills it.

A form is a function ``form(impl) -> None``, registered for an impl class with
:func:`register_form`; :class:`~bagua_algos.engine.runtime.StackedRuntime` calls
:func:`adopt` on every impl right after ``reify``, before any set-up call, so the form
sees a fresh impl and the impl's ``init_operations`` already runs through it. A form
must leave every value as the impl's own step would (the tests compare the engine with
processes bit for bit).

The registry matches the impl's exact class, not its bases: a subclass may change the
step the form was written against (its messages, its average), so it runs its own,
equal by construction, until a form is registered for it.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["register_form", "form_of", "adopt"]

_FORMS: dict[type, Callable] = {}


def register_form(impl_class: type) -> Callable:
    """Decorator: ``form`` (a function of a freshly reified impl, returning None) is
    the engine's form of ``impl_class``'s step. One form per class."""
    if not isinstance(impl_class, type):
        raise TypeError(f"register_form: impl_class must be a class (an AlgorithmImpl subclass), "
                        f"not {impl_class!r}")

    def register(form: Callable) -> Callable:
        if not callable(form):
            raise TypeError(f"register_form({impl_class.__name__}): form must be a function of the impl, "
                            f"not {form!r}")
        known = _FORMS.get(impl_class)
        if known is not None and known is not form:
            raise ValueError(f"register_form: {impl_class.__name__} already has an engine form "
                             f"({known.__module__}.{known.__qualname__}); one form per impl class")
        _FORMS[impl_class] = form
        return form

    return register


def form_of(impl) -> Callable | None:
    """The engine form registered for ``impl``'s class (exactly), or None."""
    return _FORMS.get(type(impl))


def adopt(impl):
    """Install the engine's form of ``impl``'s step, if one is registered (else leave
    the impl as it is: its own step runs on the engine through ``comm``). Returns
    ``impl``."""
    form = form_of(impl)
    if form is not None:
        form(impl)
    return impl
