"""Bagua's tensor API, patched onto ``torch.Tensor`` as Bagua 0.9 does.

A *Bagua tensor* is a torch tensor registered for communication under a name and a
module name. It is a proxy: the tensor the backend actually reads and writes, the
*effective tensor*, is ``getter_closure(proxy)`` (the proxy itself when no getter is
given). Gradient algorithms register each parameter with the getter ``p.grad`` and the
setter ``setattr(p, "grad", t)``, so a gradient that autograd replaces is still found
through its parameter; model-averaging algorithms register the parameters themselves.

Methods added to ``torch.Tensor`` (names and meaning as in ``bagua.torch_api.tensor``):
``ensure_bagua_tensor``, ``to_bagua_tensor``, ``is_bagua_tensor``,
``bagua_getter_closure``, ``bagua_setter_closure``, ``bagua_backend_tensor``,
``bagua_ensure_grad``, ``bagua_mark_communication_ready``,
``bagua_mark_communication_ready_without_synchronization``, ``bagua_set_storage``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["BaguaTensor", "install"]


class BaguaTensor:
    """The methods patched onto ``torch.Tensor`` (this class is never instantiated;
    ``BaguaTensor`` is also the name Bagua's type annotations use)."""

    def is_bagua_tensor(self) -> bool:
        """True once :meth:`ensure_bagua_tensor` registered this tensor."""
        return "_bagua_getter" in self.__dict__

    def ensure_bagua_tensor(
        self,
        name: Optional[str] = None,
        module_name: Optional[str] = None,
        getter_closure: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        setter_closure: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
    ):
        """Register this tensor in place as a Bagua tensor and return it.

        ``module_name`` (``model.bagua_module_name``) is needed to mark the tensor
        ready; ``getter_closure(self)`` gives the effective tensor and
        ``setter_closure(self, t)`` replaces it. A registered tensor keeps its name and
        module name: registering it again under other ones is an error.
        """
        if setter_closure is not None and getter_closure is None:
            raise ValueError("ensure_bagua_tensor: a setter_closure needs a getter_closure too")
        for what, value in (("getter_closure", getter_closure), ("setter_closure", setter_closure)):
            if value is not None and not callable(value):
                raise TypeError(f"ensure_bagua_tensor: {what} must be callable, got {type(value).__name__}")
        if self.is_bagua_tensor():
            if name is not None and name != self.bagua_tensor_name:
                raise ValueError(
                    f"tensor is already the Bagua tensor {self.bagua_tensor_name!r}; it cannot be renamed {name!r}"
                )
            if name is not None and module_name != self.bagua_module_name:
                raise ValueError(
                    f"Bagua tensor {self.bagua_tensor_name!r} belongs to module {self.bagua_module_name!r}, "
                    f"not {module_name!r}"
                )
        self.bagua_tensor_name = name if name is not None else ""
        self.bagua_module_name = module_name
        self._bagua_getter = getter_closure
        self._bagua_setter = setter_closure
        self._bagua_bucket = None
        return self

    def to_bagua_tensor(self, name=None, module_name=None, getter_closure=None, setter_closure=None):
        """A new Bagua tensor sharing this tensor's storage (this one is left as it is)."""
        return self.view(self.dtype).ensure_bagua_tensor(name, module_name, getter_closure, setter_closure)

    def bagua_getter_closure(self) -> torch.Tensor:
        """The effective tensor (may be ``None``, e.g. a gradient not created yet)."""
        _require_registered(self, "bagua_getter_closure")
        getter = self._bagua_getter
        return self if getter is None else getter(self)

    def bagua_setter_closure(self, tensor: torch.Tensor) -> None:
        """Make ``tensor`` the effective tensor."""
        _require_registered(self, "bagua_setter_closure")
        if self._bagua_setter is None:
            raise RuntimeError(
                f"Bagua tensor {self.bagua_tensor_name!r} was registered without a setter_closure"
            )
        self._bagua_setter(self, tensor)

    def bagua_backend_tensor(self) -> torch.Tensor:
        """What the backend communicates: the effective tensor."""
        return self.bagua_getter_closure()

    def bagua_ensure_grad(self) -> torch.Tensor:
        """Give a parameter a zero gradient if it has none; return the parameter."""
        if self.grad is not None:
            return self
        if not isinstance(self, torch.nn.Parameter):
            raise TypeError("bagua_ensure_grad() creates gradients for torch.nn.Parameter only")
        with torch.no_grad():
            self.grad = torch.zeros_like(self.data)
        return self

    def bagua_mark_communication_ready(self) -> None:
        """Tell the module's backend that this tensor is ready for its bucket's ops.

        On CUDA an event recorded on the current stream orders the communication after
        the kernels that produced the tensor.
        """
        event = None
        backend = _backend_of(self)
        effective = self.bagua_getter_closure()
        if effective is not None and effective.is_cuda and backend.wants_event(self):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(effective.device))
        backend.mark_communication_ready(self, event)

    def bagua_mark_communication_ready_without_synchronization(self) -> None:
        """Mark ready with no stream ordering (the caller guarantees the data is there)."""
        _backend_of(self).mark_communication_ready(self, None)

    def bagua_set_storage(self, storage, storage_offset: int = 0) -> None:
        """Make the effective tensor live in ``storage`` at ``storage_offset`` (elements).

        Without a setter the effective tensor is re-pointed in place; with one, a new
        tensor over the storage is handed to the setter.
        """
        effective = self.bagua_getter_closure()
        shape = effective.shape
        stride = torch.empty(shape, device="meta").stride()
        with torch.no_grad():
            if self._bagua_setter is None:
                effective.set_(storage, storage_offset, shape, stride)
            else:
                fresh = torch.empty(0, dtype=effective.dtype, device=effective.device)
                fresh.set_(storage, storage_offset, shape, stride)
                self.bagua_setter_closure(fresh)


def _require_registered(tensor, what: str) -> None:
    if not tensor.is_bagua_tensor():
        raise RuntimeError(f"{what}() needs a Bagua tensor: call tensor.ensure_bagua_tensor(name, module_name) first")


def _backend_of(tensor):
    from .backend import get_backend

    _require_registered(tensor, "bagua_mark_communication_ready")
    if tensor.bagua_module_name is None:
        raise RuntimeError(
            f"Bagua tensor {tensor.bagua_tensor_name!r} has no module name; register it with "
            "ensure_bagua_tensor(name, bagua_ddp.bagua_module_name) to mark it ready"
        )
    return get_backend(tensor.bagua_module_name)


_METHODS = [name for name in vars(BaguaTensor) if not name.startswith("__")]


def install() -> None:
    """Patch the methods onto ``torch.Tensor`` (idempotent)."""
    for name in _METHODS:
        setattr(torch.Tensor, name, getattr(BaguaTensor, name))


install()
