"""``with_bagua``: install an algorithm on a module, with Bagua 0.9's semantics.

Set-up (``_bagua_init_algorithm``, again whenever ``need_reset()`` says so): broadcast
parameters, buffers and optimizer state from the group's first rank; ``init_tensors``;
``tensors_to_buckets`` on the runtime's bucketing suggestion; ``init_operations`` for
each bucket; the buckets' order registered with the module's backend.

One training step:

1. forward pre-hooks (training mode only, as in Bagua): ``bagua_train_step_counter``
   += 1; rebuild if ``need_reset()``; the algorithm's ``init_forward_pre_hook``;
2. each parameter's gradient, once accumulated (keyed on autograd, not on
   ``module.training``, as in Bagua and torch DDP): the algorithm's backward hook (by
   default it marks the gradient ready; the backend runs a bucket's ops on its
   communication thread once the bucket and all before it are ready);
3. once per backward, after all gradients: the algorithm's post-backward hook (by
   default it waits for every pending op);
4. after each ``optimizer.step()``: the algorithm's post-optimizer-step hook.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Iterable

import torch

from ..arguments import check_choice, check_flag, check_int
from . import comm
from .algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .backend import get_backend
from .bucket import DEFAULT_BUCKET_SIZE, default_bucket_size, split_into_buckets

__all__ = ["BaguaDistributedDataParallel", "with_bagua"]

IGNORE_ATTRIBUTES = ("_bagua_params_and_buffers_to_ignore", "_ddp_params_and_buffers_to_ignore")
BROADCAST_BUFFERS_CHOICES = (False, True, "first_step")


class BaguaDistributedDataParallel:
    """What ``with_bagua`` attaches to a module as ``module.bagua_ddp``.

    Bagua's attributes: ``module``, ``bagua_module_name``, ``bagua_optimizers``,
    ``bagua_algorithm`` (the AlgorithmImpl), ``process_group``, ``parameters_to_ignore``,
    ``bagua_train_step_counter``, ``bagua_buckets``, ``_bagua_backend``,
    ``require_backward_grad_sync``; ``bagua_build_params()``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        algorithm: Algorithm,
        process_group,
        bagua_module_name: str,
        gradient_as_bucket_view: bool = True,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        broadcast_buffers: bool | str = False,
        impl: AlgorithmImpl | None = None,
    ):
        self.module = module
        self.bagua_module_name = bagua_module_name
        self.bagua_optimizers = optimizers
        self.process_group = process_group
        self.bagua_algorithm: AlgorithmImpl = impl if impl is not None else algorithm.reify(process_group)
        self.algorithm = algorithm
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_size = bucket_size
        self.broadcast_buffers = broadcast_buffers
        self.parameters_to_ignore: list[str] = []
        for attribute in IGNORE_ATTRIBUTES:
            self.parameters_to_ignore.extend(getattr(module, attribute, ()))
        self.bagua_train_step_counter = 0
        self.bagua_buckets: list = []
        self.require_backward_grad_sync = True
        self._bagua_backend = get_backend(bagua_module_name)
        self._post_backward_queued = False
        self._framework_hooks: list = []
        self._algorithm_hooks: list = []
        # Under torchft a replica's state comes from healing, not from a broadcast.
        self._bagua_init_algorithm(broadcast=not comm.fault_tolerance.active())
        self.fault_tolerance = None
        if comm.fault_tolerance.active():
            from .fault_tolerant_step import FaultTolerantStep

            self.fault_tolerance = FaultTolerantStep(self)
        self._register_framework_hooks()

    # --- Bagua's set-up -------------------------------------------------------------
    def bagua_build_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` for every parameter that requires grad and is not
        ignored, each once (shared parameters keep their first name)."""
        ignored = set(self.parameters_to_ignore)
        seen = set()
        params = []
        for name, param in self.module.named_parameters():
            if not param.requires_grad or name in ignored or f".{name}" in ignored or id(param) in seen:
                continue
            if param.is_sparse:
                raise NotImplementedError(f"parameter {name!r} is sparse; sparse gradients are not supported")
            seen.add(id(param))
            params.append((name, param))
        return params

    def _bagua_init_algorithm(self, broadcast: bool = True) -> None:
        self._bagua_backend.wait_pending_comm_ops()
        if broadcast:
            self._bagua_broadcast_parameters()
        impl = self.bagua_algorithm
        tensors = impl.init_tensors(self)
        suggestion = split_into_buckets(tensors, bucket_size=self.bucket_size)
        self.bagua_buckets = impl.tensors_to_buckets(suggestion, self.gradient_as_bucket_view)
        for bucket in self.bagua_buckets:
            impl.init_operations(self, bucket)
        self._bagua_backend.register_ordered_buckets(self.bagua_buckets)
        self._register_algorithm_hooks()
        self._shapes = {name: (p.dtype, p.device) for name, p in self.bagua_build_params()}

    def _broadcast_tensors(self) -> list[torch.Tensor]:
        ignored = set(self.parameters_to_ignore)
        tensors = [p for name, p in self.module.named_parameters() if name not in ignored]
        tensors += [b for name, b in self.module.named_buffers() if name not in ignored]
        return tensors

    def _bagua_broadcast_parameters(self) -> None:
        """Parameters, buffers and optimizer state ← those of the group's first rank."""
        src = comm.group_ranks(self.process_group)[0]
        handles = []
        with torch.no_grad():
            for tensor in self._broadcast_tensors():
                handles.append(comm.broadcast(tensor.data, src=src, group=self.process_group, async_op=True))
            for optimizer in self.bagua_optimizers:
                for param in sorted_state_params(optimizer):
                    for _, value in sorted(optimizer.state[param].items()):
                        if torch.is_tensor(value):
                            handles.append(comm.broadcast(value, src=src, group=self.process_group, async_op=True))
            for handle in handles:
                handle.wait()

    def _broadcast_buffers_now(self) -> None:
        src = comm.group_ranks(self.process_group)[0]
        ignored = set(self.parameters_to_ignore)
        with torch.no_grad():
            handles = [comm.broadcast(b.data, src=src, group=self.process_group, async_op=True)
                       for name, b in self.module.named_buffers() if name not in ignored]
            for handle in handles:
                handle.wait()

    # --- hooks ----------------------------------------------------------------------
    def _register_framework_hooks(self) -> None:
        """Forward pre-hooks (training mode only, as Bagua's)."""
        self._framework_hooks.append(self.module.register_forward_pre_hook(self._on_forward))

    def _register_algorithm_hooks(self) -> None:
        for handle in self._algorithm_hooks:
            handle.remove()
        self._algorithm_hooks = []
        for name, param in self.module.named_parameters():
            if param.requires_grad:
                self._algorithm_hooks.append(param.register_post_accumulate_grad_hook(self._gradient_hook(name)))
        step_hook = self.bagua_algorithm.init_post_optimizer_step_hook(self)
        for optimizer in self.bagua_optimizers:
            self._algorithm_hooks.append(optimizer.register_step_post_hook(
                lambda optimizer, args, kwargs: self._under_ft(step_hook, optimizer)
                if self.require_backward_grad_sync else None))

    def _on_forward(self, module, inputs) -> None:
        # A backward that raised never ran its queued callback: start clean.
        self._post_backward_queued = False
        if not module.training:
            return
        self._check_unchanged()
        if self.fault_tolerance is not None and self.require_backward_grad_sync:
            self.fault_tolerance.begin_step()  # the step's quorum; a rebuild if it changed
        self.bagua_train_step_counter += 1
        if self.bagua_algorithm.need_reset():
            self._bagua_init_algorithm(broadcast=self.fault_tolerance is None)
        if self.broadcast_buffers is True or (self.broadcast_buffers == "first_step" and self.bagua_train_step_counter == 1):
            self._broadcast_buffers_now()
        if self.require_backward_grad_sync:
            self._under_ft(self.bagua_algorithm.init_forward_pre_hook(self), inputs)

    def _gradient_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self.require_backward_grad_sync:
                return
            if not self._post_backward_queued:
                self._post_backward_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._under_ft(self.bagua_algorithm.init_backward_hook(self), name, param)

        return hook

    def _on_backward_end(self) -> None:
        try:
            self._under_ft(self.bagua_algorithm.init_post_backward_hook(self))
        finally:
            self._post_backward_queued = False

    def _under_ft(self, hook, *args):
        """Run an algorithm hook; under torchft, an error of a step whose collective
        already failed (the algorithm read a message that never came) is absorbed: the
        step is discarded anyway, and the algorithm is built again before the next."""
        if self.fault_tolerance is None:
            return hook(*args)
        try:
            return hook(*args)
        except Exception as exc:  # noqa: BLE001 - see fault_tolerant_step.FaultTolerantStep.absorb
            if not self.fault_tolerance.absorb(exc):
                raise
            return None

    def _check_unchanged(self) -> None:
        """A dtype or device change after wrapping breaks the buckets: say so clearly."""
        for name, p in self.module.named_parameters():
            expected = self._shapes.get(name)
            if expected is not None and (p.dtype, p.device) != expected:
                raise RuntimeError(
                    f"parameter {name!r} is now {p.dtype} on {p.device} but was {expected[0]} on "
                    f"{expected[1]} when with_bagua() wrapped the module; call .to(), .double(), .half() "
                    f"or .cuda() before with_bagua(), or call with_bagua() again after it"
                )

    def detach(self) -> None:
        """Remove every hook (parameters keep their current values). An algorithm that
        works in the background (``async``) stops first (``AlgorithmImpl.on_detach``):
        detach on every worker then, as the round that carries the stop is collective."""
        self.bagua_algorithm.on_detach(self)
        self._bagua_backend.wait_pending_comm_ops()
        if self.fault_tolerance is not None:
            self.fault_tolerance.detach()
        for handle in self._framework_hooks + self._algorithm_hooks:
            handle.remove()
        self._framework_hooks, self._algorithm_hooks = [], []

    # --- conveniences ---------------------------------------------------------------
    def wait_pending_comm_ops(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()

    @contextlib.contextmanager
    def no_sync(self):
        """Skip the algorithm's hooks (gradients accumulate locally), like DDP's no_sync."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # --- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """Step counter, the algorithm's state and every bucket's ``state`` (cloned)."""
        return {
            "algorithm": type(self.algorithm).__name__,
            "world_size": comm.get_world_size(self.process_group),
            "bagua_train_step_counter": self.bagua_train_step_counter,
            "algorithm_state": self.bagua_algorithm.state_dict(),
            "bucket_state": {b.name: _clone(b.state) for b in self.bagua_buckets},
        }

    def load_state_dict(self, state: dict, from_peer: bool = False) -> None:
        """Restore :meth:`state_dict`'s ``state``. Saved at another world size (a job
        restarted with more or fewer workers), the algorithm's ``WORLD_SIZE_RULE``
        decides what is carried over and what is reset, and one warning says so; load
        the model's parameters first (the rule may start state from them).
        ``from_peer``: the state is another worker's (torchft's healing), so the rule
        applies at any world size: what is each worker's own is reset, not copied."""
        expected = type(self.algorithm).__name__
        if state.get("algorithm") != expected:
            raise ValueError(
                f"checkpoint holds state of algorithm {state.get('algorithm')!r}, this module runs {expected!r}"
            )
        buckets = {b.name: b for b in self.bagua_buckets}
        saved = state.get("bucket_state", {})
        if set(saved) != set(buckets):
            raise ValueError(f"checkpoint has buckets {sorted(saved)}, this module has {sorted(buckets)}")
        self._bagua_backend.wait_pending_comm_ops()
        algorithm_state = state["algorithm_state"]
        saved_size, size = state.get("world_size"), comm.get_world_size(self.process_group)
        if (saved_size is not None and saved_size != size) or from_peer:
            algorithm_state, saved = self.bagua_algorithm.resized_state(self, algorithm_state, saved)
            rule = "; ".join(f"{piece}: {what}" for piece, what in self.bagua_algorithm.WORLD_SIZE_RULE.items())
            warnings.warn(f"{expected}: state saved at world size {saved_size} is loaded at world size {size}"
                          f"{' from another worker' if from_peer else ''}. "
                          f"{rule} (docs/elastic.md)", RuntimeWarning, stacklevel=3)
        self.bagua_algorithm.load_state_dict(algorithm_state)
        for name, bucket_state in saved.items():
            _load_into(buckets[name].state, bucket_state, f"bucket {name!r}")
        self.bagua_train_step_counter = int(state["bagua_train_step_counter"])


def _clone(value):
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _load_into(target: dict, saved: dict, where: str) -> None:
    """Restore ``saved`` into ``target`` in place (tensors copied into existing ones)."""
    for key, value in saved.items():
        current = target.get(key)
        if torch.is_tensor(current) and torch.is_tensor(value):
            if current.shape[:1] == (1,) and current.shape[1:] == value.shape:
                value = value.unsqueeze(0)  # a job's per-worker state saved before it was [W, ...] (W = 1)
            if current.shape != value.shape:
                raise ValueError(f"{where}: state {key!r} has shape {tuple(value.shape)}, expected {tuple(current.shape)}")
            current.copy_(value)
        elif isinstance(current, dict) and isinstance(value, dict):
            _load_into(current, value, f"{where}/{key}")
        else:
            target[key] = _clone(value)


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


def _check_same_shapes(module: torch.nn.Module, process_group) -> None:
    """Every rank must hold the same parameter and buffer shapes: compare a fingerprint
    and name the first difference (instead of a size mismatch deep inside gloo)."""
    entries = [(name, tuple(t.shape), str(t.dtype)) for name, t in itertools.chain(module.named_parameters(), module.named_buffers())]
    gathered = comm.all_gather_object(entries, group=process_group)
    reference = gathered[0]
    for rank_index, theirs in enumerate(gathered):
        if theirs == reference:
            continue
        for mine, other in itertools.zip_longest(reference, theirs):
            if mine != other:
                raise ValueError(
                    f"the module differs across ranks: the group's first rank has {mine}, its rank "
                    f"{rank_index} has {other} (name, shape, dtype); every rank must build the same model"
                )


_module_ids = itertools.count()


def with_bagua(
    module: torch.nn.Module,
    optimizers,
    algorithm,
    process_group=None,
    do_flatten: bool = True,
    bucket_size: int | None = None,
    broadcast_buffers: bool | str = False,
    lr_schedulers=None,
) -> torch.nn.Module:
    """Train ``module`` with ``algorithm`` over ``process_group`` (all workers by default).

    Parameters, buffers and optimizer state are broadcast from the group's first rank,
    so load a checkpoint *after* wrapping (``module.load_state_dict`` and
    ``load_bagua_state_dict``): loaded before, rank 0's copy replaces every rank's.
    ``broadcast_buffers``: ``False`` (Bagua's behaviour, the default: buffers such as
    batch-norm statistics stay local after the first broadcast), ``True`` (torch DDP's
    default: rank 0's buffers are broadcast before every training forward) or
    ``"first_step"``. ``bucket_size`` (bytes): by default ``$BAGUA_DEFAULT_BUCKET_SIZE``
    (the launchers' ``--default_bucket_size``), else 10 MiB. Returns ``module`` itself, which gains ``bagua_ddp``,
    ``bagua_algorithm`` (the AlgorithmImpl), ``bagua_module_name``,
    ``bagua_train_step_counter``, ``bagua_buckets``, ``bagua_optimizers``,
    ``no_sync()``, ``bagua_state_dict()`` and ``load_bagua_state_dict()``. Calling it
    again re-wraps the module with another algorithm. Inputs are checked before the
    module is touched, so an error leaves it as it was. ``lr_schedulers``: the LR
    schedulers of ``optimizers`` stepped once per training step; under torchft their
    state follows the committed steps (rolled back with a discarded step, healed from a
    peer); otherwise they are only checked.
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
    from .fault_tolerant_step import check_lr_schedulers

    lr_schedulers = check_lr_schedulers(lr_schedulers, optimizers)
    _check_devices(module)
    check_flag("do_flatten", do_flatten)
    if bucket_size is None:
        bucket_size = default_bucket_size()
    bucket_size = check_int("bucket_size", bucket_size, 1, what="a positive number of bytes")
    broadcast_buffers = check_choice("broadcast_buffers", broadcast_buffers, BROADCAST_BUFFERS_CHOICES)
    if process_group is None:
        process_group = comm._get_default_group()
    if comm.group_rank(process_group) < 0:
        raise ValueError(
            f"process_group does not contain this process (global rank {comm.get_rank()}); "
            f"its ranks are {comm.group_ranks(process_group)}"
        )
    if not comm.fault_tolerance.active():  # under torchft no collective outside a step: healing makes them equal
        _check_same_shapes(module, process_group)
    if (module.__dict__.pop("_bagua_loaded_before_wrap", False) and comm.get_world_size(process_group) > 1
            and not comm.fault_tolerance.active()):
        warnings.warn(
            "module.load_state_dict() ran before with_bagua(): with_bagua broadcasts the group's first "
            "rank's parameters, so every rank now holds rank 0's; load checkpoints after with_bagua()",
            stacklevel=2,
        )

    if comm.fault_tolerance.active():
        from .fault_tolerant_step import check_supported

        check_supported(algorithm, optimizers, process_group)
        from .fault_tolerant_step import for_quorum

        impl = for_quorum(algorithm, comm.get_world_size(process_group)).reify(process_group)
    else:
        impl = algorithm.reify(process_group)
    if impl.needs_optimizer_step and not optimizers:
        raise ValueError(
            f"{type(algorithm).__name__} communicates after optimizer.step(): pass the module's "
            "optimizers to with_bagua(optimizers, algorithm); with none it would train without any averaging"
        )

    previous = module.__dict__.get("bagua_ddp")
    if previous is not None:
        previous.detach()
    if "_bagua_module_name" not in module.__dict__:
        module._bagua_module_name = f"{type(module).__name__}_{next(_module_ids)}"
    ddp = BaguaDistributedDataParallel(
        module, optimizers, algorithm, process_group, module._bagua_module_name,
        gradient_as_bucket_view=do_flatten, bucket_size=bucket_size, broadcast_buffers=broadcast_buffers,
        impl=impl,
    )
    if ddp.fault_tolerance is not None:
        ddp.fault_tolerance.track_lr_schedulers(lr_schedulers)
    module.bagua_ddp = ddp
    return module


# As Bagua does, every module gains ``with_bagua`` and Bagua's properties.
def _module_with_bagua(self, optimizers, algorithm, process_group=None, do_flatten=True, **kwargs):
    return with_bagua(self, optimizers, algorithm, process_group=process_group, do_flatten=do_flatten, **kwargs)


def _ddp_of(module) -> BaguaDistributedDataParallel:
    ddp = module.__dict__.get("bagua_ddp")
    if ddp is None:
        raise AttributeError(f"{type(module).__name__} is not wrapped: call module.with_bagua(optimizers, algorithm) first")
    return ddp


def _forward_to_ddp(name: str, doc: str):
    return property(lambda self: getattr(_ddp_of(self), name), doc=doc)


def _bagua_train_step_counter(self):
    return _ddp_of(self).bagua_train_step_counter


torch.nn.Module.with_bagua = _module_with_bagua
torch.nn.Module.bagua_module_name = property(
    lambda self: self.__dict__.get("_bagua_module_name") or _ddp_of(self).bagua_module_name,
    lambda self, name: self.__dict__.__setitem__("_bagua_module_name", name),
    doc="The module's name, which tells modules' backends apart.")
torch.nn.Module.bagua_algorithm = _forward_to_ddp("bagua_algorithm", "The AlgorithmImpl the module trains with.")
torch.nn.Module.bagua_optimizers = _forward_to_ddp("bagua_optimizers", "The optimizers given to with_bagua.")
torch.nn.Module.bagua_buckets = _forward_to_ddp("bagua_buckets", "The module's buckets, in order.")
torch.nn.Module.bagua_train_step_counter = property(_bagua_train_step_counter, doc="Training forwards so far.")
torch.nn.Module.no_sync = lambda self: _ddp_of(self).no_sync()
torch.nn.Module.bagua_state_dict = lambda self: _ddp_of(self).state_dict()
torch.nn.Module.load_bagua_state_dict = lambda self, state: _ddp_of(self).load_state_dict(state)


_original_load_state_dict = torch.nn.Module.load_state_dict


def _load_state_dict(self, state_dict, *args, **kwargs):
    """``nn.Module.load_state_dict``, noting a load into a module not wrapped yet (with_bagua
    then warns: its broadcast would replace what every rank but the first loaded)."""
    result = _original_load_state_dict(self, state_dict, *args, **kwargs)
    if "bagua_ddp" not in self.__dict__:
        self.__dict__["_bagua_loaded_before_wrap"] = True
    return result


torch.nn.Module.load_state_dict = _load_state_dict
