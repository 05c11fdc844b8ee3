"""The runtime's contract on stacked workers: an algorithm's own ``AlgorithmImpl``, its
hooks and its bucket ops, run once per step for all n workers of the engine.

What a process's ``with_bagua`` does for one rank, :class:`StackedRuntime` does for
the n rows of :class:`~.stacked.StackedModel` at once:

1. set-up: ``algorithm.reify(group)`` with the engine's :class:`~.transport.
   StackedGroup`, then ``init_tensors``, ``tensors_to_buckets`` on Bagua's
   bucketing suggestion, ``init_operations`` for each bucket, as the runtime does
   (and again whenever ``need_reset()`` says so). A parameter the algorithm sees is
   the ``[n, *shape]`` view of its columns of the stacked parameters, its ``.grad``
   the view of the stacked gradients: so a flattened bucket's ``backend_tensor`` is
   the ``[n, numel]`` view of the bucket's columns, every worker's bucket a row;
2. a step: the forward pre-hook, the stacked forward and backward, each parameter's
   backward hook in bucket order (marking a bucket's tensors ready runs its ops at
   once, on this thread), the post-backward hook, the optimizer's step, the
   post-optimizer-step hook.

While a step runs, ``comm`` answers for the n workers (``comm.using_transport(group)``:
the group is the engine's transport, :mod:`.transport`): its collectives are reductions
and row moves of the stacked tensors, so the ops written for a rank run here unchanged
where they keep a worker's values in the tensors' last dimensions (docs/engine.md says
what that asks of an algorithm).

The layout: the stacked parameters are laid out as the algorithm buckets them (the
tensors of a bucket in consecutive columns, then its padding), which the runtime
learns by asking the algorithm for its buckets once before laying out the model
(``init_tensors`` and ``tensors_to_buckets`` are called again after a reset anyway,
as in Bagua).
"""

from __future__ import annotations

import itertools
import time
import weakref

import torch

from ..runtime import comm
from ..runtime.backend import BaguaBackend, register_backend, unregister_backend
from ..runtime.bucket import split_into_buckets
from .forms import adopt
from .stacked import Layout, StackedModel
from .transport import StackedGroup

__all__ = ["StackedRuntime", "EngineRefusal", "refusal"]

_names = itertools.count()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineRefusal(TypeError):
    """The one-process engine cannot run this algorithm (raised before training)."""


def refusal(algorithm) -> str | None:
    """Why the engine cannot run ``algorithm`` (an ``Algorithm``), or None. An
    algorithm class says so itself with ``ENGINE_REFUSAL`` (a reason), as the
    asynchronous model average does."""
    return getattr(algorithm, "ENGINE_REFUSAL", None)


class _StackedBackend(BaguaBackend):
    """A module's backend on the engine: a bucket's ops run as soon as it is ready,
    on the thread that marked it (there is no communication to overlap)."""

    def dispatch(self, bucket, events) -> None:  # (the lock is held)
        bucket.before_ops()
        try:
            bucket.run_ops()
        except (RuntimeError, ValueError) as err:
            if not _is_transport_call(err):
                raise
            raise EngineRefusal(
                f"an op of bucket {bucket.name!r} calls torch.distributed itself ({err}); the one-process engine "
                "runs ops that communicate through bagua_algos' comm (Bagua's names), whose calls it answers for "
                "its workers: call comm instead, or run the algorithm as processes (--engine processes)") from err


def _is_transport_call(err: BaseException) -> bool:
    """Whether ``err`` is torch.distributed refusing a call for want of a process group
    (the engine's process has none: only ``comm`` is answered for its workers)."""
    text = str(err)
    return "process group has not been initialized" in text or "init_process_group" in text


def _check_not_fused_on_strided_views(optimizer) -> None:
    """Refuse a fused torch optimizer (``fused=True``) on the parameters' views: its
    kernel writes a parameter as if it were contiguous (torch 2.14, CPU: the update of a
    ``[n, *shape]`` view, its rows ``d`` apart, lands in worker 0's next columns and
    no other worker's parameters change), so every worker would train wrongly and
    silently. On the one contiguous ``[n, d]`` matrix (``flat_optimizer=True``) it is
    right."""
    for group in getattr(optimizer, "param_groups", ()):
        if group.get("fused") and any(torch.is_tensor(p) and not p.is_contiguous() for p in group["params"]):
            raise EngineRefusal(
                f"optimizer: {type(optimizer).__name__}(fused=True) steps the engine's parameters, which are strided "
                "[n, *shape] views of one [n, d] matrix, and torch's fused kernels write a strided tensor as if it "
                "were contiguous (the updates would land in the wrong columns); build the engine with "
                "flat_optimizer=True (the fused kernel then steps the contiguous matrix) or the optimizer with "
                "fused=False")


class StackedRuntime:
    """The ``bagua_ddp`` an algorithm's hooks are given on the engine (Bagua's names:
    ``module``, ``bagua_module_name``, ``bagua_optimizers``, ``bagua_algorithm``,
    ``process_group``, ``bagua_train_step_counter``, ``bagua_buckets``,
    ``_bagua_backend``, ``bagua_build_params()``), and the driver of its step."""

    def __init__(self, module: torch.nn.Module, n: int, algorithm, optimizer_factory, device, bucket_size: int,
                 flat_optimizer: bool = False):
        reason = refusal(algorithm)
        if reason is not None:
            raise EngineRefusal(f"the one-process engine does not run {type(algorithm).__name__}: {reason}; "
                                "run it as processes (--engine processes)")
        self.flat_optimizer = flat_optimizer
        self.group = StackedGroup(n, device)
        self.n = n
        self.device = torch.device(device)
        self.bucket_size = bucket_size
        self.algorithm = algorithm
        self.bagua_module_name = f"engine_{type(module).__name__}_{next(_names)}"
        self._bagua_backend = _StackedBackend(self.bagua_module_name)
        register_backend(self.bagua_module_name, self._bagua_backend)
        weakref.finalize(self, unregister_backend, self.bagua_module_name)
        self.process_group = self.group
        self.parameters_to_ignore: list = []
        self.require_backward_grad_sync = True
        self.bagua_train_step_counter = 0
        self.bagua_buckets: list = []
        self.module = module
        with comm.using_transport(self.group):
            self.bagua_algorithm = adopt(algorithm.reify(self.group))  # the engine's form, if any
            if flat_optimizer and getattr(self.bagua_algorithm, "finds_parameters_in_the_optimizer", False):
                raise EngineRefusal(f"flat_optimizer=True: the optimizer then holds the stacked [n, d] parameter "
                                    f"matrix, not the model's parameters, and {type(algorithm).__name__} looks its "
                                    "parameters up in the optimizer; build the engine without flat_optimizer")
            # 1. the algorithm's buckets on a provisional layout, 2. the layout they ask for
            self._stack(Layout.of(module, bucket_size=bucket_size), optimizer_factory)
            self._stack(self._layout_of(self._buckets()), optimizer_factory)
            self._set_up()

    # --- Bagua's set-up -----------------------------------------------------------------
    def bagua_build_params(self) -> list:
        """``(name, parameter)`` in registration order: worker-stacked ``[n, *shape]``
        views of the stacked parameters, each with its gradient's view as ``.grad``."""
        return list(self._params.items())

    def _stack(self, layout: Layout, optimizer_factory) -> None:
        """The stacked model on ``layout``, its parameters' views and the optimizer.

        The optimizer steps the views (``[n, *shape]``, each worker's tensor a row), as
        a rank's optimizer steps its parameters: an elementwise optimizer is then every
        worker's own, and ``optimizer.param_groups`` holds the tensors the algorithm
        registered (a post-step hook that marks them ready finds them there).
        With ``flat_optimizer`` it steps the ``[n, d]`` matrix itself (the same numbers,
        one tensor)."""
        self.model = StackedModel(self.module, self.n, layout, self.device)
        self._views()
        params = [view for _, view in self.bagua_build_params()]
        for_parameters = getattr(self.algorithm, "for_parameters", None)
        if self.flat_optimizer:
            optimizer = optimizer_factory([self.model.params])
        elif for_parameters is not None:  # an algorithm that owns its optimizer (QAdam): its own, on the views
            algorithm, optimizer = for_parameters(self.module, params, optimizer_factory)
            self.bagua_algorithm = adopt(algorithm.reify(self.group))  # (in __init__'s stacked world)
        else:
            optimizer = optimizer_factory(params)
            _check_not_fused_on_strided_views(optimizer)
        self.bagua_optimizers = [optimizer]

    def _views(self) -> None:
        model = self.model
        values = model.param_views(model.params.detach())
        grads = model.param_views(model.params.grad)
        order = [name for name, _ in model.module.named_parameters() if name in values]
        self._params = {}
        for name in order:
            view = values[name]
            view.grad = grads[name]
            self._params[name] = view

    def _buckets(self) -> list:
        impl = self.bagua_algorithm
        tensors = impl.init_tensors(self)
        suggestion = split_into_buckets(tensors, bucket_size=self.bucket_size)
        return impl.tensors_to_buckets(suggestion, True)

    def _layout_of(self, buckets) -> Layout:
        """The layout whose buckets are ``buckets`` (tensors in their order, padding)."""
        name_of = {}
        for name, view in self._params.items():
            name_of[id(view)] = name
        groups = []
        for bucket in buckets:
            names = []
            for tensor in bucket.tensors:
                name = name_of.get(id(tensor))
                if name is None:
                    raise EngineRefusal(
                        f"the one-process engine lays out buckets of the model's parameters; bucket {bucket.name!r} "
                        f"of {type(self.algorithm).__name__} holds {getattr(tensor, 'bagua_tensor_name', '?')!r}, "
                        "which is not one; run it as processes (--engine processes)")
                names.append(name)
            padding = bucket.padding_numel
            groups.append((bucket.name, names, padding))
        return Layout.of_buckets(self.module, groups)

    def _broadcast_from_the_first_worker(self) -> None:
        """What the runtime's set-up broadcasts from the group's first rank: parameters,
        buffers and optimizer state, here row 0 to every row (comm's stacked broadcast)."""
        with torch.no_grad():
            tensors = [self.model.params.detach(), *self.model.buffers.values()]
            for optimizer in self.bagua_optimizers:
                for state in optimizer.state.values():
                    tensors += [v for _, v in sorted(state.items()) if torch.is_tensor(v) and v.dim() > 0]
            for tensor in tensors:
                comm.broadcast(tensor, src=0, group=self.group)

    def _set_up(self, reset: bool = False) -> None:
        """Bagua's ``_bagua_init_algorithm`` on the stacked state (again at a reset,
        which first broadcasts as the runtime does; at the start every row holds the
        same model already)."""
        self._bagua_backend.wait_pending_comm_ops()
        if reset:
            self._broadcast_from_the_first_worker()
        for bucket in self.model.layout.buckets:
            if bucket.end > bucket.start + bucket.numel:
                for stacked in (self.model.params.detach(), self.model.params.grad):
                    self.group.reserve_padding(bucket.name, stacked[:, bucket.start + bucket.numel:bucket.end])
        impl = self.bagua_algorithm
        self.bagua_buckets = self._buckets()
        for bucket in self.bagua_buckets:
            if bucket.flatten and not bucket.check_flatten():
                raise EngineRefusal(
                    f"{type(self.algorithm).__name__} buckets the tensors otherwise than its first set-up did "
                    f"(bucket {bucket.name!r}); the one-process engine lays the model out once: run it as "
                    "processes (--engine processes)")
            impl.init_operations(self, bucket)
        self._bagua_backend.register_ordered_buckets(self.bagua_buckets)
        self._forward_pre_hook = impl.init_forward_pre_hook(self)
        self._backward_hook = impl.init_backward_hook(self)
        self._post_backward_hook = impl.init_post_backward_hook(self)
        self._post_step_hook = impl.init_post_optimizer_step_hook(self)
        self._ready_order = [(slot.name, self._params[slot.name]) for slot in self.model.layout.slots]

    # --- a step -------------------------------------------------------------------------
    PHASES = ("before_forward", "after_backward", "after_step")
    """The algorithm's parts of a step: its forward pre-hook; its backward hooks (which
    run the buckets' ops) and post-backward hook; its post-optimizer-step hook."""

    timings: dict | None = None
    """Set to ``dict.fromkeys(PHASES, 0.0)`` to add up the seconds each phase takes
    (the device synchronised around each: for benchmarks)."""

    clock = staticmethod(time.perf_counter)
    """The clock of :attr:`timings` (a benchmark sets the one it times steps with)."""

    def _phase(self, name: str, run) -> None:
        if self.timings is None:
            run()
            return
        _sync(self.device)
        start = self.clock()
        run()
        _sync(self.device)
        self.timings[name] += self.clock() - start

    def _after_backward(self) -> None:
        for name, param in self._ready_order:
            self._backward_hook(name, param)
        self._post_backward_hook()

    def step(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor:
        """One training step of every worker (``x[i]``, ``y[i]`` worker i's batch)."""
        with comm.using_transport(self.group):
            self.bagua_train_step_counter += 1
            if self.bagua_algorithm.need_reset():
                self._set_up(reset=True)
            self._phase("before_forward", lambda: self._forward_pre_hook((x,)))
            losses = self.model.forward_backward(x, y, loss_fn, accumulate=self.bagua_algorithm.gradients_accumulate)
            self._phase("after_backward", self._after_backward)
            for optimizer in self.bagua_optimizers:
                optimizer.step()
                self._phase("after_step", lambda: self._post_step_hook(optimizer))
        return losses

    def run_bucket_ops(self) -> None:
        """Run every bucket's ops once more on what the buckets hold now (for
        benchmarks: the algorithm's communication step alone)."""
        with comm.using_transport(self.group):
            for bucket in self.bagua_buckets:
                bucket.before_ops()
                bucket.run_ops()

    def wait_pending_comm_ops(self) -> None:
        self._bagua_backend.wait_pending_comm_ops()
