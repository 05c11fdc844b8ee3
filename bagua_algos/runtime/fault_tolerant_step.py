"""The training step under torchft (``init_process_group(fault_tolerance="torchft")``).

``with_bagua`` attaches a :class:`FaultTolerantStep` to the module when the job runs
under torchft. One step:

1. the first training forward of the step: the committed state is snapshotted
   (parameters and buffers, the optimizer's state, ``bagua_state_dict()``), then the
   step's quorum (``manager.start_quorum()``, synchronous: torchft's
   ``use_async_quorum=False``, as its LocalSGD/DiLoCo use). If the quorum changed, the
   default group now spans the new quorum (comm/fault_tolerance.py) and the algorithm is
   built again over it from the committed state: ``reify`` on the new group, buckets,
   hooks, then ``load_bagua_state_dict`` of the committed state, which applies the
   algorithm's ``WORLD_SIZE_RULE`` when the number of replicas changed. A replica that
   is behind (a new or returning one, or every replica but the first at step 0:
   torchft's ``init_sync``) heals first: torchft fetches a live peer's state (the
   healing state below) and it replaces this replica's model, optimizer state and
   algorithm state;
2. forward, backward and the algorithm's collectives, as without torchft; a failed
   collective is reported to the manager and the step's later collectives are skipped;
3. ``optimizer.step()`` (with the algorithm's post-step hook, e.g. model averaging),
   then ``manager.should_commit()``: True on every replica, or False on every replica,
   and then each restores the snapshot: the step is discarded everywhere alike.

The healing state (torchft's state_dict callback, key ``"bagua"``) is the model's
``state_dict()``, the optimizer's and ``bagua_state_dict()``.
"""

from __future__ import annotations

import copy

import torch

from .comm import fault_tolerance as ft

# Algorithms whose guarantees survive a quorum change (docs/elastic.md): the state they
# keep is the same on every replica, or each replica's own, and their collectives are
# all-reduces over the whole group.
SUPPORTED = {
    "GradientAllReduceAlgorithm": "gradient_allreduce",
    "AllreduceAverageAlgorithm": "allreduce_average",
    "DiLoCoAlgorithm": "diloco",
}


def check_supported(algorithm, optimizers, process_group) -> None:
    """Refuse, by name, what does not run under torchft yet."""
    name = type(algorithm).__name__
    if name not in SUPPORTED:
        raise NotImplementedError(
            f"{name} is not supported under torchft fault tolerance yet (docs/elastic.md); "
            f"supported: {', '.join(sorted(SUPPORTED.values()))}; run it without --torchft "
            "(torchrun's restart from the last checkpoint)"
        )
    if len(optimizers) != 1:
        raise ValueError(f"under torchft with_bagua() needs exactly one optimizer (the step it commits or "
                         f"discards), got {len(optimizers)}")
    from . import comm

    if process_group is not None and process_group is not comm._get_default_group():
        raise ValueError("under torchft with_bagua() runs over the quorum's group: leave process_group=None")


def _snapshot(ddp, optimizer) -> dict:
    with torch.no_grad():
        model = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    return {"model": model, "optimizer": copy.deepcopy(optimizer.state_dict()),
            "bagua": copy.deepcopy(ddp.state_dict())}


class FaultTolerantStep:
    """Quorum at the step's start, commit or roll back at its end (see the module)."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.optimizer = ddp.bagua_optimizers[0]
        self.manager = ft._ft["manager"]
        self.in_step = False
        self.last_committed = None  # None before the first step, then whether it committed
        self.discarded = 0  # steps this replica ran and discarded
        self.rebuilds = 0  # quorum changes seen (the algorithm built again)
        self._healed = None
        self._snapshot = None
        if "bagua" not in self.manager._user_state_dicts:
            self.manager.register_state_dict_fn("bagua", self._load_healing_state, self._healing_state)
        else:  # with_bagua() called again: the callbacks now serve this module
            self.manager._user_state_dicts["bagua"] = self._healing_state
            self.manager._load_state_dict_fns["bagua"] = self._load_healing_state
        step = self.optimizer.step

        def step_then_commit(*args, **kwargs):
            out = step(*args, **kwargs)
            self.end_step()
            return out

        self.optimizer.step = step_then_commit
        self._unpatch = lambda: setattr(self.optimizer, "step", step)

    # --- torchft's state_dict callbacks (called inside start_quorum) ------------------
    def _healing_state(self) -> dict:
        return self._snapshot if self._snapshot is not None else _snapshot(self.ddp, self.optimizer)

    def _load_healing_state(self, state: dict) -> None:
        self._healed = state  # applied in begin_step, after the group is formed again

    # --- the step -------------------------------------------------------------------------
    @property
    def committed_steps(self) -> int:
        """Steps committed by the quorum (the manager's step: the same on every replica)."""
        return self.manager.current_step()

    def begin_step(self) -> None:
        if self.in_step:  # a further forward of the same step (gradient accumulation)
            return
        ddp = self.ddp
        ddp._bagua_backend.wait_pending_comm_ops()
        self._snapshot = _snapshot(ddp, self.optimizer)
        changed = ft.start_step()
        if self._healed is not None:
            healed, self._healed = self._healed, None
            self._snapshot = {"model": healed["model"], "optimizer": healed["optimizer"], "bagua": healed["bagua"]}
            ddp.module.load_state_dict(healed["model"])
            self.optimizer.load_state_dict(healed["optimizer"])
            changed = True
        if changed:
            self._rebuild(self._snapshot["bagua"])
        self.in_step = True

    def _rebuild(self, bagua_state: dict) -> None:
        from . import comm

        ddp = self.ddp
        ddp.process_group = comm._get_default_group()
        ddp.bagua_algorithm = ddp.algorithm.reify(ddp.process_group)
        ddp._bagua_init_algorithm(broadcast=False)
        ddp.load_state_dict(copy.deepcopy(bagua_state))
        self.rebuilds += 1

    def end_step(self) -> None:
        if not self.in_step:
            return
        self.in_step = False
        ddp = self.ddp
        try:
            ddp._bagua_backend.wait_pending_comm_ops()
        except Exception as exc:  # noqa: BLE001 - an op of the step failed: discard it
            ft.report_error(exc)
        self.last_committed = ft.should_commit()
        if not self.last_committed:
            snap = self._snapshot
            ddp.module.load_state_dict(snap["model"])
            self.optimizer.load_state_dict(copy.deepcopy(snap["optimizer"]))
            ddp.load_state_dict(copy.deepcopy(snap["bagua"]))
            self.discarded += 1

    def detach(self) -> None:
        self._unpatch()
