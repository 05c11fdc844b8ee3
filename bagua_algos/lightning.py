"""``strategy="bagua"`` for Lightning (2.1 and later): every algorithm of this plugin.

    import lightning as L
    import bagua_algos.lightning                      # registers "bagua" with Lightning
    trainer = L.Trainer(strategy="bagua", accelerator="cpu", devices=2)
    trainer = L.Trainer(strategy=bagua_algos.lightning.BaguaStrategy("relay", topology="chain"))

This is the only module of the project that imports Lightning (an optional dependency:
``pip install 'bagua-algos[lightning]'``). Lightning 2.6 has no entry point through which
a package could add a strategy name, so the name ``"bagua"`` exists once this module is
imported; passing ``BaguaStrategy(...)`` needs the import anyway.

What the strategy does, on top of Lightning's ``DDPStrategy`` (launching, samplers,
cluster environments, precision are Lightning's):

* **Process group.** An initialised ``torch.distributed`` group is reused; otherwise the
  plugin's ``init_process_group`` joins one (gloo on CPU; on GPUs CUDA tensors over NCCL
  and CPU tensors over gloo), with Lightning's ranks, address and timeout.
* **Model.** The optimizers are built first, then the LightningModule is wrapped in
  ``DistributedDataParallel_V1_9_0`` (a torch-DDP-like module around ``with_bagua``);
  gradient accumulation uses its ``no_sync()``. At the end of the fit the hooks are
  removed and Lightning gets its plain module back.
* **Collectives.** ``reduce``, ``barrier``, ``broadcast`` and ``all_gather`` go through
  torch.distributed (the plugin's ``comm`` for barrier and broadcast).
* **Checkpoints.** ``trainer.save_checkpoint`` (and ``ModelCheckpoint``, which calls it on
  every rank) gathers every rank's algorithm state (``bagua_state_dict()``: step counter,
  relay messages, error buffers, generator states, ...) into the checkpoint under
  ``"bagua_algos"``; a rank whose model or optimizer state differs from rank 0's (the
  decentralized algorithms) also stores its own. Resuming (``ckpt_path=``) loads the
  model after wrapping and gives each rank back its own state, so a resumed fit equals
  an uninterrupted one.
* **async.** Background averaging starts with the fit's first training step (or
  ``resume`` on a later fit) and is stopped at the end of the fit with ``abort``, which
  ends with a synchronous average, so the models end equal; after an exception the
  rounds are stopped without the final average (the peers may be gone).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp as LightningReduceOp
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from .runtime import comm
from .runtime.algorithm import Algorithm, GlobalAlgorithmRegistry
from .runtime.bucket import DEFAULT_BUCKET_SIZE
from .runtime.data_parallel import DistributedDataParallel_V1_9_0
from .runtime.fault_tolerant_step import state_digest as _digest

from . import algorithms as _algorithms  # noqa: F401,E402 - registers every algorithm name

__all__ = ["BaguaStrategy", "CHECKPOINT_KEY"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "bagua_algos"

_REDUCE_OPS = {
    "sum": comm.ReduceOp.SUM, "mean": comm.ReduceOp.AVG, "avg": comm.ReduceOp.AVG,
    "product": comm.ReduceOp.PRODUCT, "min": comm.ReduceOp.MIN, "max": comm.ReduceOp.MAX,
    "band": comm.ReduceOp.BAND, "bor": comm.ReduceOp.BOR, "bxor": comm.ReduceOp.BXOR,
}


class BaguaStrategy(DDPStrategy):
    """Train with a bagua-algos algorithm under Lightning.

    Args:
        algorithm: a registered name (``"gradient_allreduce"``, ``"decentralized"``,
            ``"relay"``, ``"powersgd"``, ``"async"``, ``"qadam"``, ...; see
            ``GlobalAlgorithmRegistry.available_algorithms()``) or an ``Algorithm``.
        flatten: put each bucket's tensors in one buffer (``with_bagua``'s ``do_flatten``).
        broadcast_buffers: ``True`` (torch DDP's default: rank 0's buffers before every
            training step), ``False`` (Bagua's: broadcast once) or ``"first_step"``.
        bucket_cap_mb: bucket size in MiB (default: the runtime's 10 MiB).
        **algorithm_kwargs: the algorithm's arguments, for a name (e.g.
            ``BaguaStrategy("relay", topology="chain")``). For ``"qadam"`` the
            ``q_adam_optimizer`` is the ``QAdamOptimizer`` that ``configure_optimizers``
            returns (the only optimizer), unless given here.

    The accelerator, devices, cluster environment, checkpoint IO, precision plugin,
    ``process_group_backend``, ``timeout`` and ``start_method`` are Lightning's DDP
    arguments.
    """

    strategy_name = "bagua"

    def __init__(
        self,
        algorithm: Union[str, Algorithm] = "gradient_allreduce",
        flatten: bool = True,
        broadcast_buffers: Union[bool, str] = True,
        bucket_cap_mb: Optional[float] = None,
        accelerator=None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        **algorithm_kwargs: Any,
    ) -> None:
        if isinstance(algorithm, str):
            available = GlobalAlgorithmRegistry.available_algorithms()
            if algorithm not in available:
                raise ValueError(f"algorithm must be one of {sorted(available)} or an Algorithm, got {algorithm!r}")
        elif isinstance(algorithm, Algorithm):
            if algorithm_kwargs:
                raise ValueError(f"algorithm is an Algorithm instance; its arguments go to its constructor, "
                                 f"not to BaguaStrategy (got {sorted(algorithm_kwargs)})")
        else:
            raise TypeError(f"algorithm must be a registered name or an Algorithm, got {type(algorithm).__name__}")
        if broadcast_buffers not in (True, False, "first_step"):
            raise ValueError(f"broadcast_buffers must be True, False or 'first_step', got {broadcast_buffers!r}")
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or bucket_cap_mb <= 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )
        self._bagua_algorithm = algorithm
        self._bagua_kwargs = dict(algorithm_kwargs)
        self._bagua_flatten = bool(flatten)
        self._bagua_broadcast_buffers = broadcast_buffers
        self._bagua_bucket_cap_mb = bucket_cap_mb

    # --- the process group ----------------------------------------------------------------
    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        if comm.is_initialized():
            if comm.get_world_size() != self.world_size:
                raise RuntimeError(f"the process group already initialised has {comm.get_world_size()} processes, "
                                   f"but Lightning expects {self.world_size} (num_nodes × devices)")
            return
        env = self.cluster_environment
        os.environ.update({
            "MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port), "RANK": str(self.global_rank),
            "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.num_processes), "NODE_RANK": str(self.node_rank),
        })
        comm.init_process_group(backend=self._process_group_backend, timeout=self._timeout)

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    # --- wrapping the model -----------------------------------------------------------------
    def setup(self, trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            # with_bagua needs the optimizers: build them before wrapping (DDP does the reverse).
            self.setup_optimizers(trainer)
            _optimizers_to_device(self.optimizers, self.root_device)
            self.model = self._setup_model(self.model)
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()

    def _make_algorithm(self) -> Algorithm:
        if isinstance(self._bagua_algorithm, Algorithm):
            return self._bagua_algorithm
        kwargs = dict(self._bagua_kwargs)
        if self._bagua_algorithm == "qadam" and "q_adam_optimizer" not in kwargs:
            from .algorithms.q_adam import QAdamOptimizer

            if len(self.optimizers) != 1 or not isinstance(self.optimizers[0], QAdamOptimizer) \
                    or len(self.lr_scheduler_configs) > 1:
                raise ValueError("algorithm 'qadam' needs configure_optimizers to return one QAdamOptimizer "
                                 "(and at most one LR scheduler)")
            kwargs["q_adam_optimizer"] = self.optimizers[0]
        return Algorithm.init(self._bagua_algorithm, **kwargs)

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel_V1_9_0:
        # Without bucket_cap_mb, the runtime's default bucket size (10 MiB), not DDP's 25.
        cap = self._bagua_bucket_cap_mb if self._bagua_bucket_cap_mb is not None else DEFAULT_BUCKET_SIZE / 2**20
        extra = {"bucket_cap_mb": cap}
        wrapped = DistributedDataParallel_V1_9_0(
            module=model, optimizers=self.optimizers, algorithm=self._make_algorithm(),
            gradient_as_bucket_view=self._bagua_flatten, broadcast_buffers=self._bagua_broadcast_buffers is True,
            **extra)
        if self._bagua_broadcast_buffers == "first_step":
            wrapped.inner.broadcast_buffers = "first_step"
        return wrapped

    def configure_ddp(self) -> None:  # DDPStrategy's name for the wrapping step
        self.model = self._setup_model(self.model)

    def _bagua_ddp(self):
        module = self.lightning_module
        return None if module is None else module.__dict__.get("bagua_ddp")

    @contextmanager
    def block_backward_sync(self):
        if isinstance(self.model, DistributedDataParallel_V1_9_0):
            with self.model.no_sync():
                yield None
        else:
            yield None

    # --- async: background rounds follow the fit ------------------------------------------
    def _async_impl(self):
        ddp = self._bagua_ddp()
        impl = None if ddp is None else ddp.bagua_algorithm
        return impl if impl is not None and hasattr(impl, "abort") and hasattr(impl, "resume") else None

    def on_train_start(self) -> None:
        impl = self._async_impl()
        if impl is not None and getattr(impl, "_future", None) is None and not getattr(impl, "_warming_up", True):
            impl.resume(self.model)

    def on_train_end(self) -> None:
        impl = self._async_impl()
        if impl is not None:
            impl.abort(self.model)

    def on_exception(self, exception: BaseException) -> None:
        impl = self._async_impl()
        if impl is not None and getattr(impl, "_future", None) is not None:
            impl._stop_at_exit(self._bagua_ddp(), timeout_s=10.0)
            impl._future = None
        super().on_exception(exception)

    def teardown(self) -> None:
        ddp = self._bagua_ddp()
        if isinstance(self.model, DistributedDataParallel_V1_9_0):
            self.model = self.lightning_module
        if ddp is not None:
            ddp.detach()  # the module is plain again; its state stays for save_checkpoint
        super().teardown()

    # --- collectives ------------------------------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if comm.is_initialized():
            comm.barrier()

    def broadcast(self, obj, src: int = 0):
        if not comm.is_initialized():
            return obj
        return comm.broadcast_object(obj, src)

    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Union[LightningReduceOp, str]] = "mean"):
        if not isinstance(tensor, torch.Tensor) or not comm.is_initialized():
            return tensor
        op = _bagua_reduce_op(reduce_op)
        if op == comm.ReduceOp.AVG and not tensor.is_floating_point():
            tensor = tensor.float()
        comm.allreduce_inplace(tensor, op, group=group)
        return tensor

    # --- checkpoints ------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the wrapped model: with_bagua's broadcast must not overwrite it

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Optional[Any] = None) -> None:
        ddp = self._bagua_ddp()
        if ddp is not None and comm.is_initialized():
            checkpoint = dict(checkpoint)
            checkpoint[CHECKPOINT_KEY] = self._gather_rank_states(ddp, checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather_rank_states(self, ddp, checkpoint: dict) -> dict:
        own: dict = {"bagua": _to_cpu(ddp.state_dict())}
        digests = (_digest(checkpoint.get("state_dict")), _digest(checkpoint.get("optimizer_states")))
        everyone = comm.all_gather_object(digests)
        if digests[0] != everyone[0][0]:
            own["state_dict"] = _to_cpu(checkpoint["state_dict"])
        if digests[1] != everyone[0][1]:
            own["optimizer_states"] = _to_cpu(checkpoint["optimizer_states"])
        ranks = comm.all_gather_object(own)
        return {"world_size": len(ranks), "algorithm": type(ddp.algorithm).__name__, "ranks": ranks}

    def _own_entry(self, checkpoint) -> Optional[dict]:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return None
        if saved["world_size"] != self.world_size:
            raise ValueError(f"the checkpoint holds the algorithm state of {saved['world_size']} processes, this run "
                             f"has {self.world_size}; resume with the same number of processes")
        return saved["ranks"][self.global_rank]

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        own = self._own_entry(checkpoint)
        if own is not None and "state_dict" in own:
            checkpoint = {**checkpoint, "state_dict": own["state_dict"]}
        super().load_model_state_dict(checkpoint, strict=strict)
        ddp = self._bagua_ddp()
        if own is not None and ddp is not None and isinstance(self.model, DistributedDataParallel_V1_9_0):
            ddp.load_state_dict(own["bagua"])

    def load_optimizer_state_dict(self, checkpoint) -> None:
        own = self._own_entry(checkpoint)
        if own is not None and "optimizer_states" in own:
            checkpoint = {**checkpoint, "optimizer_states": own["optimizer_states"]}
        super().load_optimizer_state_dict(checkpoint)

    # --- registration -----------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="bagua-algos: Bagua's algorithms and more",
                                   override=True)


def _bagua_reduce_op(reduce_op) -> comm.ReduceOp:
    if reduce_op is None:
        return comm.ReduceOp.AVG
    if isinstance(reduce_op, str):
        op = _REDUCE_OPS.get(reduce_op.lower())
    else:  # torch.distributed.ReduceOp.X prints as "ReduceOp.X" or "RedOpType.X"
        op = _REDUCE_OPS.get(str(reduce_op).rsplit(".", 1)[-1].lower())
    if op is None:
        raise ValueError(f"reduce_op must be one of {sorted(_REDUCE_OPS)} or a torch ReduceOp, got {reduce_op!r}")
    return op


def _to_cpu(value):
    if torch.is_tensor(value):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _register(registry) -> None:
    if BaguaStrategy.strategy_name not in registry:
        BaguaStrategy.register_strategies(registry)


_register(StrategyRegistry)
