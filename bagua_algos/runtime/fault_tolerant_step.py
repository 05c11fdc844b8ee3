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
   algorithm's ``WORLD_SIZE_RULE`` when the number of replicas changed (``for_quorum``:
   shift_one gossips with all peers over an odd quorum; ``AVERAGE_ON_CHANGE``: the
   models averaged first where the rule assumes one model). A replica that is behind
   (a new or returning one, one that discarded a step others committed, or every
   replica but the first at step 0: torchft's ``init_sync``) heals first: torchft
   fetches a live peer's state (the healing state below); it replaces this replica's
   model and optimizer state, and its algorithm state is loaded as another worker's
   (the rule applied at any size: per-worker state reset, ``PEER_RESET_BUCKET_KEYS``
   zeroed);
2. forward, backward and the algorithm's collectives, as without torchft; a failed
   collective is reported to the manager and the step's later collectives are skipped;
   an error the algorithm then raises is absorbed (``absorb``) and the algorithm is
   built again before the next step;
3. ``optimizer.step()`` (with the algorithm's post-step hook, e.g. model averaging),
   then ``manager.should_commit()``; False on a replica whose collectives failed, which
   restores the snapshot: the step is discarded there (over an all-reduce on every
   replica alike; over a gossip graph or relay tree on the lost peer's neighbours,
   which then heal from a replica that committed it).

The healing state (torchft's state_dict callback, key ``"bagua"``) is the model's
``state_dict()``, the optimizer's and ``bagua_state_dict()``, and the states of the LR
schedulers given to ``with_bagua(..., lr_schedulers=...)``: they are snapshotted too, and
after a discarded step (their step, which the script calls after ``optimizer.step()``,
comes after the roll-back) they are put back at the next step's start, so that they
count committed steps only.
"""

from __future__ import annotations

import copy
import hashlib
import time
import types
import warnings

import torch

from .comm import fault_tolerance as ft

# Algorithms refused under torchft, with the reason (docs/elastic.md). Every other
# algorithm runs: its collectives are those of the step (so a failed one discards it),
# and a quorum change rebuilds it over the new group and applies its WORLD_SIZE_RULE.
REFUSED = {
    "AsyncModelAverageAlgorithm": (
        "its averaging rounds run on a background thread, outside the training step, so a "
        "step's commit or roll-back cannot bound them: a round in flight across a quorum "
        "change would mix weights of a discarded step into committed ones, and a round that "
        "fails cannot be attributed to a step; use allreduce_average or diloco instead"
    ),
}


# Algorithms whose WORLD_SIZE_RULE assumes every replica holds the same model when the
# size changes (as after a restart from one checkpoint): low_precision_decentralized sets
# its copies of its own and its ring neighbours' weights to its loaded weights, which is
# right only if the neighbours loaded the same. Live, the replicas' models differ, so at
# a quorum change they are first averaged over the new quorum (one all-reduce: a mixing
# step with the uniform doubly stochastic matrix, which D-PSGD's analysis admits).
AVERAGE_ON_CHANGE = {"LowPrecisionDecentralizedAlgorithm"}


# Per-worker state that a healed replica must not take from its peer whatever the
# algorithm's WORLD_SIZE_RULE says: an error-feedback residual is what the peer owes to
# the sum, and the peer keeps sending it; a copy would send it twice. The rules of
# powersgd, terngrad, sparseloco and demo reset theirs already; the allgather
# compressors (top_k, sign_norm, signum, atomo with error_feedback) carry theirs over
# at a new size (every rank's own, after a restart), so a heal resets it here.
PEER_RESET_BUCKET_KEYS = ("error",)


def check_supported(algorithm, optimizers, process_group) -> None:
    """Refuse, by name and reason, what cannot run under torchft."""
    name = type(algorithm).__name__
    if name in REFUSED:
        raise NotImplementedError(
            f"{name} is not supported under torchft fault tolerance: {REFUSED[name]} (docs/elastic.md); "
            "run it without --torchft (torchrun's restart from the last checkpoint)"
        )
    if len(optimizers) != 1:
        raise ValueError(f"under torchft with_bagua() needs exactly one optimizer (the step it commits or "
                         f"discards), got {len(optimizers)}")
    from . import comm

    if process_group is not None and process_group is not comm._get_default_group():
        raise ValueError("under torchft with_bagua() runs over the quorum's group: leave process_group=None")


def for_quorum(algorithm, world_size: int):
    """The algorithm to build over a quorum of ``world_size`` replicas: ``algorithm``
    itself, except D-PSGD's ``shift_one`` pairing, which needs an even number of
    workers: over an odd quorum it gossips with every peer (``peer_selection_mode
    "all"``, the exact average) until the quorum is even again. Both mixings are doubly
    stochastic, so D-PSGD's guarantee holds over the time-varying sequence (docs/elastic.md)."""
    if (getattr(algorithm, "peer_selection_mode", None) == "shift_one" and getattr(algorithm, "topology", None) is None
            and world_size % 2):
        algorithm = copy.copy(algorithm)
        algorithm.peer_selection_mode = "all"
    return algorithm


def check_lr_schedulers(lr_schedulers, optimizers) -> list:
    """The LR schedulers given to ``with_bagua(..., lr_schedulers=...)`` as a list, each
    checked: an object with ``step``, ``state_dict`` and ``load_state_dict`` whose
    ``optimizer`` is one of ``optimizers`` (torch's schedulers hold the optimizer they
    schedule). Under torchft their state follows the committed steps (FaultTolerantStep)."""
    if lr_schedulers is None:
        return []
    if not isinstance(lr_schedulers, (list, tuple)):
        raise TypeError(f"lr_schedulers must be a list of LR schedulers (torch.optim.lr_scheduler), "
                        f"got {type(lr_schedulers).__name__}")
    for i, scheduler in enumerate(lr_schedulers):
        if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
            raise TypeError(f"lr_schedulers[{i}] is a {type(scheduler).__name__}, not an LR scheduler "
                            "(an object with step, state_dict and load_state_dict, as torch.optim.lr_scheduler's)")
        if not any(getattr(scheduler, "optimizer", None) is optimizer for optimizer in optimizers):
            raise ValueError(f"lr_schedulers[{i}] ({type(scheduler).__name__}) schedules an optimizer that was not "
                             "given to with_bagua; pass the schedulers of the optimizers given")
    return list(lr_schedulers)


def _snapshot(ddp, optimizer, schedulers=()) -> dict:
    with torch.no_grad():
        model = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    state = {"model": model, "optimizer": copy.deepcopy(optimizer.state_dict()),
             "bagua": copy.deepcopy(ddp.state_dict())}
    if schedulers:  # only then: a job without schedulers serves the same state as before
        state["schedulers"] = [copy.deepcopy(s.state_dict()) for s in schedulers]
    return state


def state_digest(state) -> str:
    """A SHA-256 of a (nested) state: dicts by sorted key, tensors by dtype, shape and
    bytes, other values by repr. Equal states give equal digests across processes."""
    h = hashlib.sha256()

    def walk(value):
        if torch.is_tensor(value):
            t = value.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, dict):
            h.update(b"{")
            for k in sorted(value, key=repr):
                h.update(repr(k).encode())
                walk(value[k])
            h.update(b"}")
        elif isinstance(value, (list, tuple)):
            h.update(b"[")
            for v in value:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()


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
        # the LR schedulers whose state follows the committed steps (with_bagua's
        # lr_schedulers), and the state to put back at the next step's start after a
        # discarded step: theirs and the optimizer's hyperparameters at its start
        self.schedulers = []
        self._undo = None
        # (manager step, state_digest) of each healing state this replica received and
        # of each it served to a peer: a healed replica holds what its peer served
        self.heals = []
        self.served = []
        self.absorbed = 0  # algorithm errors absorbed in steps whose collectives had failed
        self._broken = False  # an absorbed error: build the algorithm again before the next step
        # seconds the last begin_step spent in the quorum (start_quorum: the lighthouse, a
        # group re-formed, a heal's transfer), the heal's load and the algorithm's rebuild
        self.last_begin = {"quorum": 0.0, "heal": 0.0, "rebuild": 0.0}
        # a peer's healing state is checked against this replica's own before it is taken
        ft._ft.setdefault("checks", {})["bagua"] = self._healing_problem
        if "bagua" not in self.manager._user_state_dicts:
            self.manager.register_state_dict_fn("bagua", self._load_healing_state, self._healing_state)
        else:  # with_bagua() called again: the callbacks now serve this module
            self.manager._user_state_dicts["bagua"] = self._healing_state
            self.manager._load_state_dict_fns["bagua"] = self._load_healing_state
        step = self.optimizer.step

        def step_then_commit(optimizer, *args, **kwargs):
            out = step(*args, **kwargs)
            self.end_step()
            return out

        if hasattr(step, "_wrapped_by_lr_sched"):  # a scheduler made before with_bagua: it still sees its
            step_then_commit._wrapped_by_lr_sched = True  # wrapper called (no "overridden" warning)
        # a bound method, as torch's LR schedulers expect of optimizer.step (they wrap its __func__)
        self.optimizer.step = types.MethodType(step_then_commit, self.optimizer)
        self._unpatch = lambda: setattr(self.optimizer, "step", step)

    def track_lr_schedulers(self, schedulers) -> None:
        """Make ``schedulers`` (checked by :func:`check_lr_schedulers`) follow the
        committed steps: their state is part of the snapshot, of the roll-back and of the
        healing state. Each must be stepped once per training step (a scheduler stepped
        per epoch would have its epoch's step undone with a discarded last step)."""
        self.schedulers = list(schedulers)

    # --- torchft's state_dict callbacks (called inside start_quorum) ------------------
    def _healing_state(self) -> dict:
        state = self._snapshot if self._snapshot is not None else _snapshot(self.ddp, self.optimizer,
                                                                             self.schedulers)
        self.served.append((self.manager.current_step(), state_digest(state)))
        return state

    def _healing_problem(self, state) -> str | None:
        """What makes a peer's healing state unfit for this replica, or None: it must be
        ``{"model", "optimizer", "bagua"}``; the model's keys, shapes and dtypes this
        module's; the optimizer's groups this optimizer's, each state tensor a scalar or of
        its parameter's shape and dtype kind; the algorithm state a dict (its sizes follow
        the quorum, and ``load_state_dict`` applies the algorithm's rule to them)."""
        schedulers = getattr(self, "schedulers", [])
        keys = ("model", "optimizer", "bagua") + (("schedulers",) if schedulers else ())
        if not isinstance(state, dict) or set(state) != set(keys):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            return f"expected {{{', '.join(map(repr, keys))}}}, got {got}"
        model, local = state["model"], self.ddp.module.state_dict()
        if not isinstance(model, dict) or set(model) != set(local):
            differ = sorted(set(model) ^ set(local)) if isinstance(model, dict) else type(model).__name__
            return f"the model's keys differ from this module's: {differ}"[:300]
        for key, mine in local.items():
            theirs = model[key]
            if not torch.is_tensor(theirs) or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
                got = f"{theirs.dtype} {tuple(theirs.shape)}" if torch.is_tensor(theirs) else type(theirs).__name__
                return f"model[{key!r}] is {got}, this module's is {mine.dtype} {tuple(mine.shape)}"
        return self._optimizer_problem(state["optimizer"]) or self._schedulers_problem(state.get("schedulers")) or (
            None if isinstance(state["bagua"], dict) else "the algorithm state is not a dict")

    def _schedulers_problem(self, theirs) -> str | None:
        """A peer's scheduler states must be one per scheduler, each with this scheduler's
        keys (``load_state_dict`` sets every key as an attribute: no other may come in)."""
        mine = getattr(self, "schedulers", [])
        if not mine:
            return None
        if not isinstance(theirs, list) or len(theirs) != len(mine):
            return f"expected the states of {len(mine)} LR schedulers, got {type(theirs).__name__}"
        for i, (scheduler, state) in enumerate(zip(mine, theirs)):
            own = scheduler.state_dict()
            if not isinstance(state, dict) or set(state) != set(own):
                got = sorted(state) if isinstance(state, dict) else type(state).__name__
                return f"LR scheduler {i} ({type(scheduler).__name__}): its state's keys are {got}, " \
                       f"this one's {sorted(own)}"[:300]
        return None

    def _optimizer_problem(self, theirs) -> str | None:
        mine = self.optimizer.state_dict()
        if not isinstance(theirs, dict) or set(theirs) != set(mine):
            return "the optimizer state is not torch's {'state', 'param_groups'}"
        groups = theirs["param_groups"]
        if not isinstance(groups, list) or [g.get("params") if isinstance(g, dict) else None for g in groups] != \
                [g["params"] for g in mine["param_groups"]]:
            return "the optimizer's parameter groups differ from this optimizer's"
        params = dict(zip((i for g in mine["param_groups"] for i in g["params"]),
                          (p for g in self.optimizer.param_groups for p in g["params"])))
        if not isinstance(theirs["state"], dict) or not set(theirs["state"]) <= set(params):
            return "the optimizer state names parameters this optimizer does not have"
        for index, entry in theirs["state"].items():
            for name, value in (entry.items() if isinstance(entry, dict) else [(None, entry)]):
                if name is None:
                    return f"the optimizer state of parameter {index} is not a dict"
                if torch.is_tensor(value) and value.numel() != 1 and value.shape != params[index].shape:
                    return (f"the optimizer's {name!r} of parameter {index} is {tuple(value.shape)}, "
                            f"the parameter {tuple(params[index].shape)}")
        return None

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
        self._undo_discarded_schedule()
        self._snapshot = _snapshot(ddp, self.optimizer, self.schedulers)
        t0 = time.perf_counter()
        changed = quorum_changed = ft.start_step()  # (quorum_changed: the same on every member)
        t1 = time.perf_counter()
        if self._broken:  # the last step's algorithm errors left it half-way: build it again
            changed = True
        healed_now = self._healed is not None
        if healed_now:
            healed, self._healed = self._healed, None
            self.heals.append((self.manager.current_step(), state_digest(healed)))
            self._snapshot = {key: healed[key] for key in ("model", "optimizer", "bagua", "schedulers") if key in healed}
            ddp.module.load_state_dict(healed["model"])
            self.optimizer.load_state_dict(healed["optimizer"])
            for scheduler, state in zip(self.schedulers, healed.get("schedulers", ())):
                scheduler.load_state_dict(copy.deepcopy(state))
            changed = True
        t2 = time.perf_counter()
        if changed and not ft._ft.get("unformed"):  # (unformed: no group, the step is discarded)
            self._broken = False
            self._rebuild(self._snapshot["bagua"], from_peer=healed_now)
            # the committed state is now the rebuilt one (the rule applied): a discarded
            # step restores it, a later heal serves it
            self._snapshot["bagua"] = copy.deepcopy(ddp.state_dict())
            with torch.no_grad():
                self._snapshot["model"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
            from . import comm

            if quorum_changed and comm.get_world_size() > 1:
                # A replica that served its state to a healing peer stops serving it at its
                # next commit (torchft's should_commit). Over a sparse topology (relay's
                # trees, a gossip) it can reach that commit without exchanging with the
                # healing peer at all, before the peer has fetched the state, which then
                # waits for it in vain. A barrier of the new quorum, which a healing peer
                # joins only once it holds its state, keeps the state served until then.
                # Only at a new quorum, which every member sees: a heal or a rebuild of
                # this replica alone (same quorum) must not wait for peers that do not.
                comm.barrier()
        self.last_begin = {"quorum": t1 - t0, "heal": t2 - t1, "rebuild": time.perf_counter() - t2}
        self.in_step = True

    def _rebuild(self, bagua_state: dict, from_peer: bool = False) -> None:
        from . import comm

        ddp = self.ddp
        ddp.process_group = comm._get_default_group()
        ddp.bagua_algorithm = for_quorum(ddp.algorithm, comm.get_world_size()).reify(ddp.process_group)
        ddp._bagua_init_algorithm(broadcast=False)
        if type(ddp.algorithm).__name__ in AVERAGE_ON_CHANGE and comm.get_world_size() > 1:
            self._average_parameters()
        with warnings.catch_warnings():
            if self.rebuilds == 0:  # the first quorum: the state was built before it, in a group of one
                warnings.simplefilter("ignore", RuntimeWarning)
            ddp.load_state_dict(copy.deepcopy(bagua_state), from_peer=from_peer)
        if from_peer:
            for bucket in ddp.bagua_buckets:
                for key in PEER_RESET_BUCKET_KEYS:
                    if torch.is_tensor(bucket.state.get(key)):
                        bucket.state[key].zero_()
        self.rebuilds += 1

    def _average_parameters(self) -> None:
        from . import comm

        params = [p for p in self.ddp.module.parameters()]
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).double() for p in params])
            out = torch.empty_like(flat)
            comm.allreduce(flat, out, op=comm.ReduceOp.SUM)
            if ft.step_errored():  # the step is discarded; build again before the next
                self._broken = True
                return
            out /= comm.get_world_size()
            offset = 0
            for p in params:
                p.copy_(out[offset:offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()

    def absorb(self, exc: BaseException) -> bool:
        """Whether an error raised by the algorithm during the step is absorbed: only in
        a step whose collective already failed (the algorithm then computed on messages
        that never came: skipped collectives leave their outputs unwritten). The step is
        discarded (should_commit says False) and the algorithm is built again from the
        committed state before the next step."""
        if not ft.step_errored():
            return False
        self.absorbed += 1
        self._broken = True
        return True

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
            if self.schedulers:
                # The caller steps its schedulers after optimizer.step(), that is after this
                # roll-back: their step (and the lr it sets) is undone at the next step's start.
                self._undo = (snap["schedulers"], copy.deepcopy(snap["optimizer"]["param_groups"]))

    def _undo_discarded_schedule(self) -> None:
        """After a discarded step: the schedulers back to their state at its start, and
        the optimizer's hyperparameters (lr, momentum, ... what a scheduler sets) to theirs
        then, so that a scheduler counts committed steps only (``last_epoch`` and the lr
        are those of a replica that did not run the discarded step)."""
        if self._undo is None:
            return
        states, groups = self._undo
        self._undo = None
        for scheduler, state in zip(self.schedulers, states):
            scheduler.load_state_dict(copy.deepcopy(state))
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({key: value for key, value in saved.items() if key != "params"})

    def detach(self) -> None:
        self._unpatch()
