"""The open name -> topology registry: a topology registers itself where it is defined.

A class becomes reachable by name (``DecentralizedAlgorithm(topology="ring")``, a sweep's
``decentralized:topology=ring``) through :func:`register_topology`, written as a decorator
on the class in its own file; ``tree=True`` marks a family that is a tree on every number
of ranks (a double binary tree: each of its trees), the ones a tree algorithm such as
RelaySGD accepts by name. Names are listed in registration order, which is the order the
defining modules are imported (the package imports its trees, then its gossip graphs). A
user's topology registers the same way from the user's file (examples/torus_topology.py);
this module imports nothing, so any file may import it."""

__all__ = ["register_topology", "available_topologies", "get_topology"]

_REGISTRY = {}  # name -> class, in registration order
_TREE_NAMES = []  # the names registered with tree=True, in order


def register_topology(cls=None, *, tree=False):
    """Register ``cls`` (a ``Topology`` subclass with a class attribute ``name``, built as
    ``cls(world_size)``) under ``cls.name``; returns ``cls``, so it serves as a decorator
    (``@register_topology`` or ``@register_topology(tree=True)``). The same class, or a
    class of the same module and name (its module executed again), takes the name again;
    any other class under a taken name is refused, naming both."""

    def register(cls):
        from .base import Topology

        if not (isinstance(cls, type) and issubclass(cls, Topology)):
            raise TypeError(f"register_topology takes a Topology subclass, got {cls!r}")
        name = cls.__dict__.get("name")
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{cls.__name__} needs a class attribute name, an identifier such as 'torus', "
                             f"to be registered; got {name!r}")
        taken = _REGISTRY.get(name)
        if taken is not None and taken is not cls:
            if (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"topology name {name!r} is taken by {taken.__module__}.{taken.__qualname__}; "
                                 f"give {cls.__module__}.{cls.__qualname__} another name")
        _REGISTRY[name] = cls  # a module run again (a script re-imported) replaces its own class
        if tree and name not in _TREE_NAMES:
            _TREE_NAMES.append(name)
        return cls

    return register if cls is None else register(cls)


def available_topologies(trees_only=False):
    """Names accepted by ``get_topology``, in registration order; with ``trees_only``,
    only those registered as a tree on every number of ranks."""
    return list(_TREE_NAMES) if trees_only else list(_REGISTRY)


def get_topology(name, world_size):
    """Build the topology registered as ``name`` on ``world_size`` ranks."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown topology {name!r}; valid names are: {', '.join(_REGISTRY)}"
        )
    return cls(world_size)
