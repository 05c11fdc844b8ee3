"""``with_bagua``: install an algorithm's hooks on a module, as Bagua does.

One training step (see docs/DESIGN.md):

1. forward pre-hook: ``bagua_train_step_counter += 1``, rebuild if the algorithm asks
   (``need_reset``), then the algorithm's forward pre-hook;
2. each parameter's gradient, once accumulated: the algorithm's backward hook (by
   default it marks the tensor ready; a bucket whose tensors are all ready runs its
   operations, buckets in order so every rank issues collectives in the same order);
3. once per backward, after all gradients: the algorithm's post-backward hook (by
   default it launches any bucket not launched yet and waits for all of them);
4. after each ``optimizer.step()``: the algorithm's post-optimizer-step hook.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from . import comm
from .algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .bucket import DEFAULT_BUCKET_SIZE, BaguaBucket

__all__ = ["BaguaDistributedDataParallel", "with_bagua"]

IGNORE_ATTRIBUTE = "_bagua_params_and_buffers_to_ignore"


class BaguaDistributedDataParallel:
    """The state ``with_bagua`` attaches to a module as ``module.bagua_ddp``."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        algorithm: Algorithm,
        impl: AlgorithmImpl,
        process_group,
        do_flatten: bool,
        bucket_size: int,
    ):
        self.module = module
        self.optimizers = optimizers
        self.bagua_algorithm = algorithm
        self.algorithm_impl = impl
        self.process_group = process_group
        self.do_flatten = do_flatten
        self.bucket_size = bucket_size
        self.bagua_train_step_counter = 0
        ignored = set(getattr(module, IGNORE_ATTRIBUTE, ()))
        self.named_parameters = [
            (name, p) for name, p in module.named_parameters() if name not in ignored and p.requires_grad
        ]
        self._broadcast_tensors = [p for name, p in module.named_parameters() if name not in ignored]
        self._broadcast_tensors += [b for name, b in module.named_buffers() if name not in ignored]
        self._hook_handles: list = []
        self._sync_enabled = True
        self._pending: list = []
        self._next_bucket = 0
        self._post_backward_queued = False
        self.buckets: list[BaguaBucket] = []

        # Broadcast first, so the algorithm sees the common initial model (RelaySGD keeps it).
        self._broadcast_from_first_rank()
        self._init_algorithm()
        self._register_hooks()

    # --- set-up ----------------------------------------------------------------------
    def _init_algorithm(self) -> None:
        impl = self.algorithm_impl
        tensors = impl.init_tensors(self)
        self.buckets = impl.tensors_to_buckets(tensors, self.do_flatten, self.bucket_size)
        self._bucket_of = {}
        for b_index, bucket in enumerate(self.buckets):
            for t_index, t in enumerate(bucket.tensors):
                self._bucket_of[id(t.param)] = (b_index, t_index)
        for bucket in self.buckets:
            impl.init_operations(self, bucket)
        self._forward_pre_hook = impl.init_forward_pre_hook(self)
        self._backward_hook = impl.init_backward_hook(self)
        self._post_backward_hook = impl.init_post_backward_hook(self)
        self._post_step_hook = impl.init_post_optimizer_step_hook(self)
        self._reset_step_state()

    def _broadcast_from_first_rank(self) -> None:
        """Parameters, buffers and optimizer state ← those of the group's first rank."""
        src = comm.group_ranks(self.process_group)[0]
        handles = []
        with torch.no_grad():
            for tensor in self._broadcast_tensors:
                handles.append(comm.broadcast(tensor.data, src=src, group=self.process_group, async_op=True))
            for optimizer in self.optimizers:
                for param in sorted_state_params(optimizer):
                    for _, value in sorted(optimizer.state[param].items()):
                        if torch.is_tensor(value):
                            handles.append(comm.broadcast(value, src=src, group=self.process_group, async_op=True))
            for handle in handles:
                handle.wait()

    def _register_hooks(self) -> None:
        self._hook_handles.append(self.module.register_forward_pre_hook(self._on_forward))
        for name, param in self.named_parameters:
            self._hook_handles.append(param.register_post_accumulate_grad_hook(self._gradient_hook(name)))
        for optimizer in self.optimizers:
            self._hook_handles.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    def detach(self) -> None:
        """Remove every hook; parameters keep their current values."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self.wait_pending_comm_ops()

    # --- hooks ----------------------------------------------------------------------
    def _on_forward(self, module, inputs) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.bagua_train_step_counter += 1
        module.bagua_train_step_counter = self.bagua_train_step_counter
        if self.algorithm_impl.need_reset():
            self.wait_pending_comm_ops()
            self._init_algorithm()
        self._reset_step_state()
        for bucket in self.buckets:
            bucket.attach_grads()
        if self._sync_enabled:
            self._forward_pre_hook(inputs)

    def _gradient_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_enabled:
                return
            if not self._post_backward_queued:
                self._post_backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._backward_hook(name, param)

        return hook

    def _on_backward_end(self) -> None:
        try:
            self._post_backward_hook()
        finally:
            self._post_backward_queued = False

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._sync_enabled:
            self._post_step_hook(optimizer)

    # --- what hooks call ------------------------------------------------------------
    def mark_ready(self, param: torch.Tensor) -> None:
        """Mark ``param``'s gradient ready; launch every bucket that is ready, in order."""
        where = self._bucket_of.get(id(param))
        if where is None:
            return
        b_index, t_index = where
        bucket = self.buckets[b_index]
        t = bucket.tensors[t_index]
        if t.grad_view is not None and param.grad is not t.grad_view:
            bucket.attach_grads()
        if bucket.mark_ready(t_index):
            self._launch_buckets(until=len(self.buckets), only_ready=True)

    def _launch_buckets(self, until: int, only_ready: bool) -> None:
        while self._next_bucket < until:
            bucket = self.buckets[self._next_bucket]
            if only_ready and not bucket.is_ready:
                return
            self._pending.extend(bucket.run_ops())
            self._next_bucket += 1

    def wait_pending_comm_ops(self) -> None:
        """After a backward, launch the buckets not launched yet (tensors that got no
        gradient count as ready); then wait for all communication of this step."""
        if self._post_backward_queued:
            self._launch_buckets(until=len(self.buckets), only_ready=False)
        for handle in self._pending:
            handle.wait()
        self._pending.clear()

    def _reset_step_state(self) -> None:
        self._pending = []
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.reset_ready()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the algorithm's hooks (gradients accumulate locally), like DDP's no_sync."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # --- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "algorithm": type(self.bagua_algorithm).__name__,
            "bagua_train_step_counter": self.bagua_train_step_counter,
            "algorithm_state": self.algorithm_impl.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        expected = type(self.bagua_algorithm).__name__
        if state.get("algorithm") != expected:
            raise ValueError(
                f"checkpoint holds state of algorithm {state.get('algorithm')!r}, this module runs {expected!r}"
            )
        self.algorithm_impl.load_state_dict(state["algorithm_state"])
        self.bagua_train_step_counter = int(state["bagua_train_step_counter"])
        self.module.bagua_train_step_counter = self.bagua_train_step_counter


def sorted_state_params(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's parameters that have state, in param-group order (the same on
    every rank, unlike the state dict's insertion order)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p in optimizer.state]


# --------------------------------------------------------------------------- validation


def _check_optimizers(module: torch.nn.Module, optimizers) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    if not isinstance(optimizers, Iterable):
        raise TypeError(f"optimizers must be a list of torch.optim.Optimizer, got {type(optimizers).__name__}")
    optimizers = list(optimizers)
    module_params = {id(p) for p in module.parameters()}
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{index}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in module_params:
                    raise ValueError(
                        f"optimizers[{index}] holds a parameter of shape {tuple(p.shape)} that is not a "
                        f"parameter of the module given to with_bagua; build the optimizer from "
                        f"module.parameters() of this module"
                    )
    return optimizers


def _check_devices(module: torch.nn.Module) -> None:
    devices = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        found = ", ".join(f"{d} (e.g. {n})" for d, n in devices.items())
        raise ValueError(f"all parameters of the module must be on one device for with_bagua; found {found}")


def _check_algorithm(algorithm) -> Algorithm:
    if isinstance(algorithm, str):
        return Algorithm.init(algorithm)
    if not isinstance(algorithm, Algorithm):
        raise TypeError(
            f"algorithm must be an Algorithm or a registered name, got {type(algorithm).__name__}; "
            f"registered names: {GlobalAlgorithmRegistry.available_algorithms()}"
        )
    return algorithm


def with_bagua(
    module: torch.nn.Module,
    optimizers,
    algorithm,
    process_group=None,
    do_flatten: bool = True,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
) -> torch.nn.Module:
    """Train ``module`` with ``algorithm`` over ``process_group`` (all workers by default).

    Parameters, buffers and optimizer state are broadcast from the group's first rank.
    Returns ``module`` itself, which gains ``bagua_ddp``, ``bagua_algorithm``,
    ``bagua_train_step_counter``, ``no_sync()``, ``bagua_state_dict()`` and
    ``load_bagua_state_dict()``. Calling it again re-wraps the module with another
    algorithm. Inputs are checked before the module is touched, so an error leaves it
    as it was.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if not comm.is_initialized():
        raise RuntimeError(
            "with_bagua() needs the process group: call bagua_algos.init_process_group() first "
            "(in workers started by `python -m bagua_algos.launch` or torchrun)"
        )
    algorithm = _check_algorithm(algorithm)
    optimizers = _check_optimizers(module, optimizers)
    _check_devices(module)
    if not isinstance(do_flatten, bool):
        raise TypeError(f"do_flatten must be True or False, got {do_flatten!r}")
    if not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size!r}")
    if process_group is not None and comm.group_rank(process_group) < 0:
        raise ValueError(
            f"process_group does not contain this process (global rank {comm.get_rank()}); "
            f"its ranks are {comm.group_ranks(process_group)}"
        )
    impl = algorithm.reify(process_group)

    previous = module.__dict__.get("bagua_ddp")
    if previous is not None:
        previous.detach()
    ddp = BaguaDistributedDataParallel(module, optimizers, algorithm, impl, process_group, do_flatten, bucket_size)
    module.bagua_ddp = ddp
    module.bagua_algorithm = algorithm
    module.bagua_train_step_counter = ddp.bagua_train_step_counter
    module.no_sync = ddp.no_sync
    module.bagua_state_dict = ddp.state_dict
    module.load_bagua_state_dict = ddp.load_state_dict
    return module


def _module_with_bagua(self, optimizers, algorithm, process_group=None, do_flatten=True, **kwargs):
    return with_bagua(self, optimizers, algorithm, process_group=process_group, do_flatten=do_flatten, **kwargs)


# As Bagua does, every module gains ``module.with_bagua(optimizers, algorithm)``.
torch.nn.Module.with_bagua = _module_with_bagua
