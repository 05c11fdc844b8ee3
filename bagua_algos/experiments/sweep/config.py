"""The sweep's settings as one typed, frozen value (:class:`SweepConfig`), built once from
the command line (:func:`bagua_algos.experiments.sweep.cli.parse_args`) or in Python::

    SweepConfig(workers=4, configs="allreduce_average;relay:topology=chain", alphas=(1.0, 0.1),
                protocol_name="relaysum", momentum=0.0)

Every field is checked where the value is built: a bad one raises
:class:`SweepConfigError` naming the argument (and its flag) and what is valid. The
checks that ask the machine (a GPU, the memory a run needs, the run log of ``--resume``)
and the choices made for it (``--engine auto``, how many ``--jobs``) are the command
line's (``cli.configure``), which returns the config with them resolved.

Each module of the sweep reads the fields it needs: ``runs`` the training settings,
``runlog`` those a run's result depends on, ``report`` :meth:`SweepConfig.settings`
(``results.json``'s ``settings``, in the flags' order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bagua_algos.algorithms.table import ALGORITHM_TABLE
from bagua_algos.experiments.common import ConfigError, config_spec, parse_configs
from bagua_algos.experiments.data import DATASETS, DEFAULT_MODEL, MODELS
from bagua_algos.experiments.protocol import PROTOCOLS, QUANTITIES, SCHEDULES, Protocol

__all__ = ["ENGINES", "EXECUTORS", "DEFAULT_CONFIGS", "DEFAULT_LR_GRID", "DEFAULT_PROTOCOL", "PROTOCOL_FLAGS", "SweepConfig",
           "SweepConfigError", "resolve_protocol", "stacked_config_error"]

ENGINES = ("auto", "sim", "processes")
EXECUTORS = ("local", "ray")  # where the runs train (executors.py)
DEVICES = ("cpu", "cuda")
# The table's rows marked in_sweep, in its order (bagua_algos/algorithms/table.py says why each).
DEFAULT_CONFIGS = ";".join(config_spec(config) for config in ALGORITHM_TABLE if config.in_sweep)
# The protocol the sweep trains under unless --protocol says otherwise (docs/results.md,
# "The sweep's protocol", measured both ways).
DEFAULT_PROTOCOL = "heavy_ball"
# The rates the command line tunes each (config, α) over when given neither --lr nor
# --lr-grid: around the sweep's former single rate 0.05, then extended at an edge
# (--lr-extend). A SweepConfig built in Python trains ``lr`` alone unless given a grid.
DEFAULT_LR_GRID = (0.025, 0.05, 0.1)
PROTOCOL_FLAGS = {  # flag -> the Protocol field it sets
    "momentum": "momentum", "nesterov": "nesterov", "dampening": "dampening", "weight_decay": "weight_decay",
    "decay_norm": "decay_norm", "schedule": "schedule", "warmup_epochs": "warmup_epochs",
    "milestones": "milestones", "decay_factor": "decay_factor", "quantity": "quantity",
}
# a field whose flag is not its name with '-' for '_'
FLAG_OF_FIELD = {"protocol_name": "protocol"}


class SweepConfigError(ValueError):
    """A setting of the sweep that cannot be used: ``argument`` is the SweepConfig field,
    ``flag`` its command-line flag, ``reason`` what is wrong and what would be valid."""

    def __init__(self, argument: str, reason: str):
        self.argument, self.reason = argument, reason
        self.flag = "--" + FLAG_OF_FIELD.get(argument, argument).replace("_", "-")
        super().__init__(f"{argument} ({self.flag}): {reason}")


def resolve_protocol(name: str, epochs: int, overrides: dict) -> Protocol:
    """The Protocol named ``name`` at ``epochs``, then each knob in ``overrides`` (a
    PROTOCOL_FLAGS key -> value, None for a knob left as the protocol has it); a
    ValueError names the knob that is out of range."""
    from bagua_algos.experiments.protocol import protocol_named

    protocol = protocol_named(name).at_epochs(epochs)
    changes = {PROTOCOL_FLAGS[flag]: value for flag, value in overrides.items() if value is not None}
    if "momentum" in changes and changes["momentum"] == 0 and "nesterov" not in changes:
        changes["nesterov"] = False  # no momentum, no Nesterov
    if "milestones" in changes and "schedule" not in changes:
        changes["schedule"] = "step"
    if changes:
        name = f"{protocol.name} with {', '.join(f'{k}={v}' for k, v in changes.items())}"
        protocol = protocol.with_(name=name, **changes)
    return protocol


def stacked_config_error(config) -> str | None:
    """Why ``config`` (a parsed configuration) cannot run on the one-process engine (None
    when it can). It lives here, not with the runs, because building a SweepConfig asks
    it: the settings must not import the training code that reads them."""
    from bagua_algos.engine import refusal

    algorithm = config.build_algorithm()
    why = refusal(algorithm)
    return None if why is None else f"the one-process engine does not run {type(algorithm).__name__}: {why}"


def _positive_int(argument: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SweepConfigError(argument, f"expected a positive integer, got {value!r}")


def _positive_numbers(argument: str, values) -> tuple:
    try:
        numbers = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise SweepConfigError(argument, f"expected a sequence of positive finite numbers, got {values!r}") from None
    if not numbers or any(not math.isfinite(v) or v <= 0 for v in numbers):
        raise SweepConfigError(argument, f"expected positive finite numbers, got {values!r}")
    return numbers


def _choice(argument: str, value, choices) -> None:
    if value not in choices:
        raise SweepConfigError(argument, f"expected one of {', '.join(map(str, choices))}, got {value!r}")


@dataclass(frozen=True)
class SweepConfig:
    """Every setting of one sweep, one field per flag of ``bagua-algos sweep`` (the flag is
    the field's name with '-' for '_'; ``protocol_name`` is ``--protocol``), checked when
    built. ``protocol`` (the Protocol every run trains under) and ``parsed_configs`` (the
    configurations of ``configs``) are derived from the fields, never given."""

    workers: int = 8
    engine: str = "auto"  # auto, sim or processes; the command line resolves auto
    dataset: str = "digits"
    data_dir: str | None = None
    model: str | None = None  # None: the dataset's default model (DEFAULT_MODEL)
    configs: str = DEFAULT_CONFIGS  # ';'-separated ALGO[:key=value,...] entries
    alphas: tuple = (1.0, 0.1, 0.01)
    epochs: int = 30
    batch_size: int = 16
    lr: float = 0.05
    lr_grid: tuple | None = None
    protocol_name: str = DEFAULT_PROTOCOL
    # the protocol's knobs, each None to keep the named protocol's (PROTOCOL_FLAGS)
    momentum: float | None = None
    nesterov: bool | None = None
    dampening: float | None = None
    weight_decay: float | None = None
    decay_norm: bool | None = None
    schedule: str | None = None
    warmup_epochs: float | None = None
    milestones: tuple | None = None
    decay_factor: float | None = None
    quantity: str | None = None
    max_steps_per_epoch: int | None = None
    device: str = "cpu"
    jobs: int | None = None  # None: the command line chooses (idle CPUs, memory)
    threads: int = 1
    seed: int = 0
    out_dir: str = "results/sweep"
    resume: bool = False
    no_progress: bool = False
    lr_extend: int = 3  # extensions of the lr grid per (config, α) while its best is at an edge; 0: none
    executor: str = "local"  # local (this process, --jobs forked ones) or ray (a task per run)
    ray_address: str | None = None  # None: start a local Ray (or join the one this process holds); or HOST:PORT, auto
    gpus_per_run: float = 1.0  # with --device cuda: the GPUs each run holds (a fraction shares one)
    engine_reason: str | None = None  # why --engine auto chose the engine it did (set when it resolves auto)
    protocol: Protocol = field(init=False, compare=False, repr=False)
    parsed_configs: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # the order of the flags' checks on the command line: the first bad one is named
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen: set once, here)
        set_("alphas", _positive_numbers("alphas", self.alphas))
        if self.lr_grid is not None:
            set_("lr_grid", _positive_numbers("lr_grid", self.lr_grid))
        if self.milestones is not None:
            set_("milestones", tuple(self.milestones))
        for name in ("workers", "epochs", "batch_size", "threads"):
            _positive_int(name, getattr(self, name))
        for name in ("max_steps_per_epoch", "jobs"):
            _positive_int(name, getattr(self, name), allow_none=True)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            # the split's seed is scikit-learn's random_state, a numpy RandomState seed: 32 bits
            raise SweepConfigError("seed", f"expected an integer in [0, {2**32 - 1}], got {self.seed!r}")
        _choice("engine", self.engine, ENGINES)
        _choice("dataset", self.dataset, DATASETS)
        _choice("device", self.device, DEVICES)
        _choice("protocol_name", self.protocol_name, list(PROTOCOLS))
        if self.schedule is not None:
            _choice("schedule", self.schedule, SCHEDULES)
        if self.quantity is not None:
            _choice("quantity", self.quantity, list(QUANTITIES))
        try:
            set_("protocol", resolve_protocol(self.protocol_name, self.epochs,
                                              {flag: getattr(self, flag) for flag in PROTOCOL_FLAGS}))
        except ValueError as err:  # "Protocol momentum=1.5: expected ..." -> the knob's name
            text = str(err)
            knob = text.split()[1].split("=")[0] if text.startswith("Protocol ") else "protocol"
            flag = next((f for f, field_ in PROTOCOL_FLAGS.items() if field_ == knob), "protocol_name")
            raise SweepConfigError(flag, text) from None
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise SweepConfigError("lr", f"expected a positive number, got {self.lr}")
        from bagua_algos.experiments.data import check_data_dir, check_model

        if self.dataset == "cifar10":
            try:
                check_data_dir(self.data_dir)
            except FileNotFoundError as err:
                raise SweepConfigError("data_dir", str(err)) from None
        if self.model is None:
            set_("model", DEFAULT_MODEL[self.dataset])
        _choice("model", self.model, MODELS)
        try:
            check_model(self.model, self.dataset)
        except ValueError as err:
            raise SweepConfigError("model", str(err)) from None
        try:
            set_("parsed_configs", tuple(parse_configs(self.configs)))
        except ConfigError as err:
            raise SweepConfigError("configs", str(err)) from None
        if any(c.is_ddp for c in self.parsed_configs):
            raise SweepConfigError("configs", "'ddp' trains gradients, not models, and has no place in this sweep")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise SweepConfigError("device", "cuda, but this machine has no visible GPU; use --device cpu")
        if self.engine == "sim":
            refused = {c.spec: stacked_config_error(c) for c in self.parsed_configs}
            spec, why = next(((spec, why) for spec, why in refused.items() if why), (None, None))
            if why:
                raise SweepConfigError("engine", f"sim cannot run config {spec!r}: {why}")
        self._check_executor()
        if self.jobs is not None and self.jobs > 1:
            if self.engine == "processes":
                raise SweepConfigError("jobs", f"{self.jobs} runs at a time is for --engine sim; the processes "
                                               "engine trains one run at a time on all its worker processes (leave "
                                               "--jobs out)")
            if self.executor == "ray":
                raise SweepConfigError("jobs", f"{self.jobs} runs at a time is the local executor's; Ray trains as "
                                               "many at a time as the cluster's CPUs (--threads each) and GPUs "
                                               "(--gpus-per-run each) hold (leave --jobs out)")

    def _check_executor(self) -> None:
        """The executor's fields: a known executor, Ray for the engine's runs only, a
        positive number of GPUs per run and of lr extensions."""
        _choice("executor", self.executor, EXECUTORS)
        if self.executor == "ray" and self.engine == "processes":
            raise SweepConfigError("executor", "ray trains each run as one task on the one-process engine; "
                                               "--engine processes runs its own worker processes: use --engine sim, "
                                               "or --executor local")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise SweepConfigError("ray_address", f"expected HOST:PORT or auto, got {self.ray_address!r}")
        if self.ray_address is not None and self.executor != "ray":
            raise SweepConfigError("ray_address", f"{self.ray_address!r} is where --executor ray sends the runs; "
                                                  "add --executor ray, or leave --ray-address out")
        if isinstance(self.gpus_per_run, bool) or not isinstance(self.gpus_per_run, (int, float)) \
                or not (math.isfinite(self.gpus_per_run) and self.gpus_per_run > 0) \
                or (self.gpus_per_run > 1 and self.gpus_per_run != int(self.gpus_per_run)):
            raise SweepConfigError("gpus_per_run", "expected a fraction of one GPU (e.g. 0.25) or a whole number, "
                                                   f"got {self.gpus_per_run!r}")
        if isinstance(self.lr_extend, bool) or not isinstance(self.lr_extend, int) or self.lr_extend < 0:
            raise SweepConfigError("lr_extend", f"expected an integer >= 0, got {self.lr_extend!r}")

    @property
    def lrs(self) -> tuple:
        """The learning rates every (config, α) is trained with: ``lr_grid``, else ``lr``."""
        return self.lr_grid or (self.lr,)

    @property
    def runs(self) -> int:
        """How many runs the sweep trains: α × configs × learning rates."""
        return len(self.alphas) * len(self.parsed_configs) * len(self.lrs)

    def settings(self) -> dict:
        """``results.json``'s ``settings``: every flag's value in the flags' order (the
        protocol as its every knob), then ``engine_reason`` where ``--engine auto`` chose."""
        values = {"workers": self.workers, "engine": self.engine, "dataset": self.dataset, "data_dir": self.data_dir,
                  "model": self.model, "configs": self.configs, "alphas": list(self.alphas), "epochs": self.epochs,
                  "batch_size": self.batch_size, "lr": self.lr,
                  "lr_grid": None if self.lr_grid is None else list(self.lr_grid),
                  "protocol": self.protocol.to_dict()}
        values.update({flag: getattr(self, flag) for flag in PROTOCOL_FLAGS})
        values.update({"max_steps_per_epoch": self.max_steps_per_epoch, "device": self.device, "jobs": self.jobs,
                       "threads": self.threads, "seed": self.seed, "out_dir": self.out_dir, "resume": self.resume,
                       "no_progress": self.no_progress, "lr_extend": self.lr_extend, "executor": self.executor,
                       "ray_address": self.ray_address, "gpus_per_run": self.gpus_per_run})
        if self.engine_reason is not None:
            values["engine_reason"] = self.engine_reason
        return values
