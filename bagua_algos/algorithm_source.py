"""An algorithm named by where its code is: ``FILE.py:ClassName`` or
``package.module:ClassName``, as the sweep's ``--configs`` takes it.

A file written for Bagua (``from bagua.torch_api.algorithms import Algorithm``) loads
as it does under the launcher: with the compatibility package ``bagua`` importable
(unless a real Bagua is installed, which is never shadowed). A file is loaded once per
process, under a module name derived from its absolute path, so a file that registers
its algorithm at import (``GlobalAlgorithmRegistry.register``) registers it once.

Example::

    >>> from bagua_algos.algorithm_source import load_algorithm_class
    >>> load_algorithm_class("bagua_algos.algorithms:RelayAlgorithm").__name__
    'RelayAlgorithm'
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

__all__ = ["is_algorithm_source", "load_algorithm_class"]

_loaded_files: dict = {}  # absolute path -> module


def is_algorithm_source(head: str, second: str) -> bool:
    """Whether a config ``head:second[:...]`` names code (a file or a module and a
    class) rather than a registered name with ``key=value`` arguments."""
    return "=" not in second and second.strip().isidentifier() and (head.endswith(".py") or "." in head
                                                                      or "/" in head or os.sep in head)


def _with_compat_on_path() -> None:
    from . import compat

    if compat.find_real_bagua() is None and compat.compat_path() not in sys.path:
        sys.path.insert(0, compat.compat_path())


def _already_imported(path: str):
    """A module of ``sys.modules`` loaded from the file ``path`` (a script that imported
    it by its name: loading it again would run its registrations twice), or None."""
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and os.path.exists(origin) and os.path.samefile(origin, path):
            return module
    return None


def _load_file(path: str):
    given, path = path, os.path.abspath(path)
    module = _loaded_files.get(path) or (_already_imported(path) if os.path.isfile(path) else None)
    if module is not None:
        _loaded_files[path] = module
        return module
    if not os.path.isfile(path):
        hint = ""
        if not os.path.isabs(given) and given.replace(os.sep, "/").startswith(("examples/", "./examples/")):
            # the repository's examples/ are not installed with the package
            hint = "; examples/ is in the repository's checkout: run from its root, or give the file's full path"
        raise ValueError(f"{path}: no such file (an algorithm file is FILE.py:ClassName){hint}")
    _with_compat_on_path()
    name = "bagua_algos_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    directory = os.path.dirname(path)
    added = directory not in sys.path
    if added:  # its sibling modules import as they would when it runs as a script
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _loaded_files[path] = module
    return module


def load_algorithm_class(source: str):
    """The ``Algorithm`` subclass ``source`` names: ``FILE.py:ClassName`` or
    ``package.module:ClassName``. ValueError names what is wrong."""
    from .runtime.algorithm import Algorithm

    where, sep, class_name = source.rpartition(":")
    if not sep or not where or not class_name.isidentifier():
        raise ValueError(f"{source!r}: expected FILE.py:ClassName or package.module:ClassName")
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where)
    else:
        _with_compat_on_path()
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ValueError(f"{source!r}: cannot import module {where!r} ({err}); is it on PYTHONPATH?") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        names = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Algorithm)
                       and v is not Algorithm)
        raise ValueError(f"{source!r}: {where} has no {class_name!r}; its Algorithm classes: {names}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise ValueError(f"{source!r}: {class_name} is not an Algorithm subclass (bagua_algos' or Bagua's "
                         "bagua.torch_api.algorithms.Algorithm)")
    return cls
