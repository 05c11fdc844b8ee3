"""A torch-DDP-like module around ``with_bagua``: Bagua 0.9's ``DistributedDataParallel_V1_9_0``.

``DistributedDataParallel_V1_9_0(module, ..., optimizers=[...], algorithm=...)`` is an
``nn.Module`` whose only child is ``module`` (so its ``state_dict`` keys start with
``module.``, as torch DDP's do). It installs the algorithm on ``module`` with
:func:`~bagua_algos.runtime.ddp.with_bagua` and calls ``module`` in ``forward``, so
the module's forward pre-hooks (step counter, the algorithm's pre-hook) run on every
call of the wrapper. Bagua's attributes: ``module``, ``inner`` (the
``BaguaDistributedDataParallel``, also ``bagua_ddp``), ``bagua_algorithm``,
``bagua_optimizers``, ``bagua_buckets``, ``require_backward_grad_sync``,
``parameters_to_ignore``, ``no_sync()``.

Where this differs from Bagua 0.9.2 (each a superset of what Bagua accepted):

* ``broadcast_buffers``: Bagua asserted ``True`` and then broadcast parameters only;
  here ``True`` means torch DDP's behaviour (rank 0's buffers before every training
  forward) and ``False`` Bagua's ``with_bagua`` default (buffers broadcast once).
* ``bucket_cap_mb``: Bagua ignored it; here it is the bucket size (MiB), as in DDP.
* ``find_unused_parameters``: accepted; the runtime always copes with parameters that
  get no gradient in a step (they count as ready when the backward ends), so it
  changes nothing.
* ``device_ids`` / ``output_device``: ``None``, or the one device the module is on.
"""

from __future__ import annotations

import contextlib

import torch

from .algorithm import Algorithm
from .ddp import with_bagua

__all__ = ["DistributedDataParallel_V1_9_0"]

MIB = 1024 * 1024


class DistributedDataParallel_V1_9_0(torch.nn.Module):
    """Bagua's torch-DDP-compatible wrapper (torch 1.9's ``DistributedDataParallel``
    arguments plus ``optimizers`` and ``algorithm``; ``algorithm=None`` is gradient
    allreduce, Bagua's default)."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group=None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers=(),
        algorithm: Algorithm | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError("DistributedDataParallel is not needed when a module has no parameter that requires a gradient")
        devices = {p.device for p in module.parameters()}
        if len({d.type for d in devices}) != 1:
            raise ValueError(f"the module's parameters must be on one type of device, found {sorted(map(str, devices))}")
        self.device = next(iter(module.parameters())).device
        self.device_type = self.device.type
        self.is_multi_device_module = len(devices) > 1
        for name, value in (("device_ids", device_ids), ("output_device", output_device)):
            wanted = value if name == "output_device" else (None if value is None else list(value))
            if name == "device_ids" and wanted is not None:
                if len(wanted) != 1:
                    raise ValueError(f"device_ids can only be None or contain a single element, got {value!r}")
                wanted = wanted[0]
            if wanted is not None and as_device(wanted) != self.device:
                raise ValueError(f"{name}={value!r} names another device than the module's ({self.device}); "
                                 f"move the module there first, or pass None")
        if dim != 0:
            raise ValueError(f"dim must be 0 (inputs are not scattered), got {dim!r}")
        if check_reduction:
            raise ValueError("check_reduction=True is not supported (it is deprecated in torch DDP too)")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        if not isinstance(broadcast_buffers, bool):
            raise ValueError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
        self.dim = dim
        self.static_graph = False
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = bool(find_unused_parameters)
        self.module = module
        if algorithm is None:
            algorithm = Algorithm.init("gradient_allreduce")
        with_bagua(module, list(optimizers), algorithm, process_group=process_group,
                   do_flatten=bool(gradient_as_bucket_view), bucket_size=max(1, int(bucket_cap_mb * MIB)),
                   broadcast_buffers=broadcast_buffers)
        # A plain attribute (in __dict__): the Module-level bagua_* helpers
        # (bagua_state_dict, no_sync, ...) and AsyncModelAverage's abort(model) /
        # resume(model) then work on the wrapper as on the module.
        self.bagua_ddp = module.bagua_ddp

    # --- Bagua's attributes -----------------------------------------------------------
    @property
    def inner(self):
        """The ``BaguaDistributedDataParallel`` that runs the algorithm."""
        return self.__dict__["bagua_ddp"]

    bagua_algorithm = property(lambda self: self.inner.bagua_algorithm, doc="The AlgorithmImpl it trains with.")
    bagua_optimizers = property(lambda self: self.inner.bagua_optimizers, doc="The optimizers given to it.")
    bagua_buckets = property(lambda self: self.inner.bagua_buckets, doc="The module's buckets, in order.")
    bagua_module_name = property(lambda self: self.inner.bagua_module_name, doc="The module's name.")
    bagua_train_step_counter = property(lambda self: self.inner.bagua_train_step_counter,
                                        doc="Training forwards so far.")

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.inner.require_backward_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.inner.require_backward_grad_sync = bool(value)

    @property
    def parameters_to_ignore(self):
        return self.inner.parameters_to_ignore

    @property
    def process_group(self):
        return self.inner.process_group

    # --- torch DDP's behaviour ------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate locally inside the context; the first backward after it
        communicates (as torch DDP's ``no_sync``)."""
        with self.inner.no_sync():
            yield

    def train(self, mode: bool = True):
        super().train(mode)
        return self

    def will_sync_module_buffers(self) -> bool:
        return self.broadcast_buffers and any(True for _ in self.module.buffers())

    def bagua_state_dict(self) -> dict:
        """The algorithm's state (see ``with_bagua``): per rank, for checkpoints."""
        return self.inner.state_dict()

    def load_bagua_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def scatter(self, inputs, kwargs, device_ids):
        raise NotImplementedError("scatter: a single-device module gets its inputs as they are")

    def gather(self, outputs, output_device):
        raise NotImplementedError("gather: a single-device module returns its outputs as they are")

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        raise NotImplementedError("join (uneven inputs) is not supported, as in Bagua")

    def register_comm_hook(self, state, hook):
        raise NotImplementedError("register_comm_hook: the algorithm decides the communication (as in Bagua); "
                                  "for torch DDP's hooks see bagua_algos.ddp_hooks")


def as_device(value) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    return torch.device(value)

