"""The algorithms: every module of this package, found and imported here.

Importing a module registers its algorithm and declares its rows of the table (the
``register_algorithm`` call at the module's end, bagua_algos/algorithms/table.py); once
every module is imported the table collects those rows. The package re-exports what
each module exports (its ``__all__``), so a new algorithm file needs no line here.
"""

import importlib as _importlib
import pkgutil as _pkgutil

from . import table as _table

__all__: list = []


def _import_every_module() -> None:
    """Import each module of the package but the table, in module-name order, and
    re-export each one's ``__all__``."""
    owners: dict = {}  # exported name -> the module that exports it
    modules = sorted(_pkgutil.iter_modules(__path__), key=lambda info: info.name)
    module_names = {info.name for info in modules}
    for info in modules:
        if info.name == "table":
            continue  # the collector of the rows, not an algorithm; its names are read from bagua_algos.algorithms.table
        module = _importlib.import_module(f"{__name__}.{info.name}")
        exported = getattr(module, "__all__", None)
        if exported is None:
            raise ImportError(f"{module.__name__} has no __all__: each module of the package lists the names the "
                              f"package re-exports (an empty list if none)")
        for name in exported:
            if name in module_names:  # importing that module sets the package's attribute of the same name
                raise ImportError(f"{module.__name__} exports {name!r}, the name of a module of the package")
            value = getattr(module, name)  # an AttributeError names a listed name the module lacks
            if name in owners and globals()[name] is not value:
                raise ImportError(f"{name!r} is exported by both {owners[name]} and {module.__name__}: "
                                  f"the package re-exports one object per name")
            if name not in owners:
                owners[name] = module.__name__
                globals()[name] = value
                __all__.append(name)


_import_every_module()
_table._collect_package_rows()
