"""Bagua's algorithm contract: ``Algorithm`` (settings) → ``reify`` → ``AlgorithmImpl``.

An :class:`Algorithm` holds only its settings, so one object can be given to several
modules. ``reify(process_group)`` makes an :class:`AlgorithmImpl` that owns the state
(buffers, counters) and returns the hooks that :func:`~bagua_algos.with_bagua` installs:

1. ``init_forward_pre_hook``: ``hook(input)`` before each training forward;
2. ``init_backward_hook``: ``hook(parameter_name, parameter)`` once a gradient is ready;
3. ``init_post_backward_hook``: ``hook()`` once per backward, after all gradients;
4. ``init_post_optimizer_step_hook``: ``hook(optimizer)`` after each ``optimizer.step()``.

The hooks' types are named below (:data:`ForwardPreHook`, :data:`BackwardHook`,
:data:`PostBackwardHook`, :data:`PostOptimizerStepHook`); subclasses annotate their
factories with them. Whether an algorithm needs the optimizers is declared, not
inferred: :attr:`AlgorithmImpl.needs_optimizer_step`.

Set-up goes through ``init_tensors`` (Bagua tensors), ``tensors_to_buckets`` and
``init_operations`` (ops appended to each bucket), as in Bagua 0.9: an algorithm file
written for Bagua runs on this runtime unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from . import comm
from .bucket import BaguaBucket

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry", "BaguaDDP", "ForwardPreHook", "BackwardHook",
           "PostBackwardHook", "PostOptimizerStepHook"]


class BaguaDDP(Protocol):
    """What an impl's set-up and hooks are given as ``bagua_ddp`` (Bagua's names): in a job
    the ``BaguaDistributedDataParallel`` that ``with_bagua`` makes (runtime/ddp.py, which
    imports this module, so it is described here rather than imported), on the
    one-process engine its ``StackedRuntime``."""

    module: torch.nn.Module
    bagua_module_name: str
    bagua_optimizers: list
    bagua_algorithm: "AlgorithmImpl"
    process_group: Any
    bagua_train_step_counter: int  # forwards in training mode so far, this one included
    bagua_buckets: list  # the BaguaBuckets of the algorithm's tensors_to_buckets
    _bagua_backend: Any  # Bagua's name: the module's backend (runtime/backend.py), wait_pending_comm_ops()

    def bagua_build_params(self) -> list:
        """``(name, parameter)`` of the module's trained parameters, in registration order."""

ForwardPreHook = Callable[[Any], None]
"""``hook(inputs)``: before each training forward, with the forward's positional inputs."""
BackwardHook = Callable[[str, torch.nn.Parameter], None]
"""``hook(parameter_name, parameter)``: once the parameter's gradient is accumulated."""
PostBackwardHook = Callable[[], None]
"""``hook()``: once per backward, after every gradient hook of that backward."""
PostOptimizerStepHook = Callable[[torch.optim.Optimizer], None]
"""``hook(optimizer)``: after each ``step()`` of each optimizer given to ``with_bagua``."""


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
    """State and hooks of an algorithm bound to a process group (Bagua 0.9's contract).

    The defaults are Bagua's: communicate the gradients, a bucket once all its tensors
    are marked ready, and wait for everything after backward. Subclasses override what
    they need.
    """

    needs_optimizer_step: bool = False
    """Whether the algorithm's work is done in its post-optimizer-step hook, which runs
    only after ``step()`` of an optimizer given to ``with_bagua``: then ``with_bagua``
    refuses an empty optimizer list (training would go on without the algorithm's
    communication). A subclass declares it in its class body. One that does not, but
    defines ``init_post_optimizer_step_hook`` itself, is taken to need the step (True):
    that is an algorithm file written for Bagua, which has no such attribute."""

    finds_parameters_in_the_optimizer: bool = False
    """Whether the algorithm looks its parameters up in the optimizer's param groups
    (low-precision decentralized marks them ready from there, quasi-global momentum
    reads each one's learning rate and momentum, QAdam steps its own optimizer's): then the engine's optimizer must be
    built on the parameters, not on the stacked matrix (``flat_optimizer``)."""

    gradients_accumulate: bool = False
    """Whether backward must add to the gradients the algorithm leaves between steps
    (PowerSGD with ``error_in_grad`` keeps λ·e there, and the training loop does not
    zero them): the one-process engine then adds each step's gradients to the stacked
    gradients instead of writing them."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "needs_optimizer_step" not in vars(cls) and "init_post_optimizer_step_hook" in vars(cls):
            cls.needs_optimizer_step = True

    def __init__(self, process_group):
        self.process_group = process_group

    # --- life cycle -----------------------------------------------------------------
    def need_reset(self) -> bool:
        """Return True to have the module rebuild tensors, buckets and operations before
        the next forward (checked once per training forward)."""
        return False

    def init_tensors(self, bagua_ddp: BaguaDDP) -> list:
        """The Bagua tensors to communicate, in the order their gradients are expected
        to become ready (reverse registration order): each parameter, registered with
        its gradient as the effective tensor."""
        parameters = bagua_ddp.bagua_build_params()
        tensors = []
        for name, param in reversed(parameters):
            tensors.append(
                param.bagua_ensure_grad().ensure_bagua_tensor(
                    name,
                    bagua_ddp.bagua_module_name,
                    getter_closure=lambda p: p.grad,
                    setter_closure=lambda p, t: setattr(p, "grad", t),
                )
            )
        self._communication_tensor_names = {name for name, _ in parameters}
        return tensors

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        """Buckets from the runtime's suggestion ``tensors`` (a list of lists of Bagua
        tensors); the default follows it, naming bucket k ``str(k)``."""
        return [BaguaBucket(group, flatten=do_flatten, name=str(index)) for index, group in enumerate(tensors)]

    def init_operations(self, bagua_ddp: BaguaDDP, bucket: BaguaBucket) -> None:
        """Append to ``bucket`` (``bucket.append_*_op``) what runs once it is ready."""

    def on_detach(self, bagua_ddp: BaguaDDP) -> None:
        """End what the algorithm runs outside its hooks (a background thread), called by
        ``bagua_ddp.detach()`` before the hooks are removed. The default has nothing to
        end. Not in Bagua 0.9, whose modules are never detached."""

    # --- hooks ----------------------------------------------------------------------
    def init_forward_pre_hook(self, bagua_ddp: BaguaDDP) -> ForwardPreHook:
        def hook(input):
            pass

        return hook

    def init_backward_hook(self, bagua_ddp: BaguaDDP) -> BackwardHook:
        def hook(parameter_name, parameter):
            if parameter_name in self._communication_tensor_names:
                grad = parameter.grad
                if grad is not None and grad.layout != torch.strided:
                    raise NotImplementedError(
                        f"parameter {parameter_name!r} has a sparse gradient ({grad.layout}); "
                        f"{type(self).__name__} communicates dense gradients only: build the layer with "
                        "sparse=False (e.g. torch.nn.Embedding(..., sparse=False))"
                    )
                parameter.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: BaguaDDP) -> PostBackwardHook:
        def hook():
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDDP) -> PostOptimizerStepHook:
        def hook(optimizer):
            pass

        return hook

    # --- checkpointing --------------------------------------------------------------
    #: The algorithm's rule for state that depends on the world size or the topology:
    #: each piece (by what it is) → "carried over" or "reset" with the reason. A load
    #: of state saved at another world size (``load_bagua_state_dict``) follows it and
    #: says so in one warning; docs/elastic.md lists every algorithm's rule.
    WORLD_SIZE_RULE: dict[str, str] = {
        "step counter and all other state": "carried over (at a new world size, the first rank's)"}
    #: The keys of ``state_dict()`` and of each ``bucket.state`` that the rule resets:
    #: they are not loaded, so they keep what the set-up built for the new world.
    RESET_STATE_KEYS: frozenset = frozenset()
    RESET_BUCKET_KEYS: frozenset = frozenset()

    def resized_state(self, bagua_ddp, state: dict, bucket_states: dict) -> tuple[dict, dict]:
        """What to load of ``state`` / ``bucket_states`` (saved at another world size):
        all but the keys the rule resets. An algorithm whose reset is not "keep the
        set-up's value" overrides this."""
        state = {k: v for k, v in state.items() if k not in self.RESET_STATE_KEYS}
        bucket_states = {name: {k: v for k, v in saved.items() if k not in self.RESET_BUCKET_KEYS}
                         for name, saved in bucket_states.items()}
        return state, bucket_states

    def state_dict(self) -> dict:
        """Everything beyond ``bucket.state`` needed to resume exactly (tensors cloned).

        Per-bucket state kept in ``bucket.state`` is saved by the runtime itself."""
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
        """Rank inside this algorithm's process group (on the one-process engine, every
        worker's: ``torch.arange(n)``)."""
        return comm.group_rank(self.process_group)

    @property
    def row_ranks(self) -> list[int]:
        """The group ranks of the workers this impl runs: ``[rank]`` in a job, every
        worker's ``[0, …, n − 1]`` on the one-process engine (its tensors a row each):
        what per-worker state that is not a tensor (a random stream) is built for."""
        return torch.as_tensor(self.rank).reshape(-1).tolist()


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
