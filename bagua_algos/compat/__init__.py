"""Compatibility with scripts written for Bagua.

The directory of this package, :func:`compat_path`, holds a package named ``bagua``
so that ``import bagua.torch_api as bagua`` works in an unchanged Bagua script once
that directory is on ``sys.path`` (``python -m bagua_algos.launch`` puts it on the
workers' PYTHONPATH). It must never hide a real Bagua: :func:`real_bagua_installed`
tells whether one is importable, found without importing anything.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["compat_path", "find_real_bagua", "real_bagua_installed"]

_NAME = "bagua"


def compat_path() -> str:
    """Absolute path of the directory that holds the compatibility package ``bagua``."""
    return os.path.dirname(os.path.abspath(__file__))


def _same_path(a: str, b: str) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


def _is_real(spec) -> bool:
    """True for a spec of a regular ``bagua`` module or package other than ours.

    A namespace package (a directory ``bagua`` without ``__init__.py``, e.g. a data
    folder in the working directory) is not counted: Bagua is a regular package.
    """
    if spec is None:
        return False
    origin = spec.origin if spec.has_location else None
    if origin is None:
        return False  # namespace package (or a module without a file)
    ours = os.path.join(compat_path(), _NAME)
    return not _same_path(os.path.dirname(origin), ours)


def find_real_bagua():
    """The module spec of a ``bagua`` importable from the current ``sys.path`` (or by a
    meta path finder, e.g. an editable install) that is not the compatibility package;
    ``None`` if there is none. Nothing is imported.

    The compatibility directory may itself be on ``sys.path`` (in a worker, or in a
    launcher started from one); a real Bagua further along the path still counts.
    """
    try:
        spec = importlib.util.find_spec(_NAME)  # what `import bagua` would load now
    except (ImportError, ValueError):  # ValueError: sys.modules["bagua"].__spec__ is None
        spec = None
    if _is_real(spec):
        return spec
    ours = compat_path()
    others = [entry for entry in sys.path
              if isinstance(entry, str) and not _same_path(entry or os.curdir, ours)]
    try:
        spec = importlib.machinery.PathFinder.find_spec(_NAME, others)
    except ImportError:
        spec = None
    if _is_real(spec):
        return spec
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(_NAME, None)
        except Exception:  # noqa: BLE001 - a third-party finder's failure means "not found"
            continue
        if _is_real(spec):
            return spec
    return None


def real_bagua_installed() -> bool:
    """True when a ``bagua`` importable from the current ``sys.path`` is not the
    compatibility package in :func:`compat_path` (see :func:`find_real_bagua`)."""
    return find_real_bagua() is not None
