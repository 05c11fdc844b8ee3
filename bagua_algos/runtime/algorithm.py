"""Bagua's algorithm contract: ``Algorithm`` (settings) → ``reify`` → ``AlgorithmImpl``.

An :class:`Algorithm` holds only its settings, so one object can be given to several
modules. ``reify(process_group)`` makes an :class:`AlgorithmImpl` that owns the state
(buffers, counters) and returns the hooks that :func:`~bagua_algos.with_bagua` installs:

1. ``init_forward_pre_hook``: ``hook(input)`` before each training forward;
2. ``init_backward_hook``: ``hook(parameter_name, parameter)`` once a gradient is ready;
3. ``init_post_backward_hook``: ``hook()`` once per backward, after all gradients;
4. ``init_post_optimizer_step_hook``: ``hook(optimizer)`` after each ``optimizer.step()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from . import comm
from .bucket import BaguaBucket, BaguaTensor, split_into_buckets

if TYPE_CHECKING:
    from .ddp import BaguaDistributedDataParallel

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


class Algorithm:
    """Settings of a training algorithm. Subclasses store their arguments and implement
    :meth:`reify`."""

    def reify(self, process_group) -> "AlgorithmImpl":
        raise NotImplementedError(f"{type(self).__name__} must implement reify(process_group)")

    @classmethod
    def init(cls, name: str, **kwargs) -> "Algorithm":
        """The registered algorithm ``name`` built with ``kwargs``, e.g.
        ``Algorithm.init("gradient_allreduce", average=True)``."""
        factory = GlobalAlgorithmRegistry.get(name)
        return factory(**kwargs)

    def __repr__(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"


class AlgorithmImpl:
    """State and hooks of an algorithm bound to a process group.

    The defaults implement "communicate a bucket once all its tensors are ready, wait
    for everything after backward": subclasses override what they need.
    """

    def __init__(self, process_group):
        self.process_group = process_group

    # --- life cycle -----------------------------------------------------------------
    def need_reset(self) -> bool:
        """Return True to have the module rebuild tensors, buckets and operations before
        the next forward."""
        return False

    def init_tensors(self, bagua_ddp: "BaguaDistributedDataParallel") -> list[BaguaTensor]:
        """The tensors this algorithm communicates, in the order their gradients are
        expected to become ready (reverse registration order)."""
        return [BaguaTensor(name, param) for name, param in reversed(bagua_ddp.named_parameters)]

    def tensors_to_buckets(self, tensors: list[BaguaTensor], do_flatten: bool, bucket_size: int | None = None) -> list[BaguaBucket]:
        """Group ``tensors`` into buckets of at most ``bucket_size`` bytes (10 MiB)."""
        kwargs = {} if bucket_size is None else {"bucket_size": bucket_size}
        return split_into_buckets(tensors, do_flatten=do_flatten, **kwargs)

    def init_operations(self, bagua_ddp: "BaguaDistributedDataParallel", bucket: BaguaBucket) -> None:
        """Register on ``bucket`` (``bucket.append_op``) what runs once all its tensors
        are ready. Each op is ``op(bucket) -> CommHandle | None``."""

    # --- hooks ----------------------------------------------------------------------
    def init_forward_pre_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[Any], None]:
        def hook(input):
            pass

        return hook

    def init_backward_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[str, Any], None]:
        def hook(parameter_name, parameter):
            bagua_ddp.mark_ready(parameter)

        return hook

    def init_post_backward_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[], None]:
        def hook():
            bagua_ddp.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: "BaguaDistributedDataParallel") -> Callable[[Any], None]:
        def hook(optimizer):
            pass

        return hook

    # --- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume this algorithm exactly (tensors are cloned)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        unexpected = set(state) - set(self.state_dict())
        if unexpected:
            raise KeyError(f"{type(self).__name__}.load_state_dict: unexpected keys {sorted(unexpected)}")

    # --- helpers for subclasses -----------------------------------------------------
    @property
    def world_size(self) -> int:
        return comm.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        """Rank inside this algorithm's process group."""
        return comm.group_rank(self.process_group)


class _Registry:
    """Name → algorithm factory, as Bagua's ``GlobalAlgorithmRegistry``."""

    def __init__(self):
        self._entries: dict[str, tuple[Callable[..., Algorithm], str]] = {}

    def register(self, name: str, factory: Callable[..., Algorithm], description: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"algorithm name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(
                f"algorithm {name!r} is already registered; registered algorithms: {self.available_algorithms()}"
            )
        if not callable(factory):
            raise TypeError(f"factory for {name!r} must be callable, got {factory!r}")
        self._entries[name] = (factory, description)

    def unregister(self, name: str) -> None:
        self.get(name)
        del self._entries[name]

    def get(self, name: str) -> Callable[..., Algorithm]:
        try:
            return self._entries[name][0]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown algorithm {name!r}; available algorithms: {self.available_algorithms()}"
            ) from None

    def description(self, name: str) -> str:
        self.get(name)
        return self._entries[name][1]

    def available_algorithms(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries


GlobalAlgorithmRegistry = _Registry()
