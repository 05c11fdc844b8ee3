"""The bad-input probes as data: what a user can get wrong, and what bagua_algos answers.

Each probe is one thing a user might do wrong (a misspelt name, an argument of the
wrong type or range, a model that differs across ranks, NaN gradients, ...), the
exception it must raise and a piece of text its message must contain (the argument's
name, or what would be valid). A probe whose ``expected`` is ``None`` documents
behaviour that is not an error (e.g. NaN gradients propagate, as under torch DDP):
its ``match`` must then appear in what the probe observed.

A probe's ``fn`` takes no argument when it needs no process group; a ``distributed``
probe's takes ``(rank, world_size)`` and runs on every rank of ``WORLD_SIZE`` gloo
workers. A probe written as a function is named after its id. Running and judging
them is ``bad_input_runner``'s job; ``test_bad_input_answers.py`` makes each probe a
test of its own.

A probe that shows a real problem keeps the expectation it should meet and carries a
``known_issue`` note: it fails (an expected failure in the tests) until the problem
is fixed.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

WORLD_SIZE = 2  # gloo workers of the distributed probes


@dataclass(frozen=True)
class Probe:
    id: str
    action: str  # what the user does
    expected: Optional[type]  # the exception it must raise; None: no error
    match: str  # text the message (or, with no error, the observation) must contain
    fn: Callable
    distributed: bool = False  # fn(rank, world_size) in each gloo worker, else fn()
    known_issue: str = ""  # set while the probe shows a real problem


PROBES: list[Probe] = []


def add(id, action, expected, match, fn=None, *, distributed=False, known_issue=""):
    """Register a probe; usable as ``add(..., fn)`` or as a decorator ``@add(...)`` on a
    function named after the probe's id."""

    def register(f):
        if any(p.id == id for p in PROBES):
            raise ValueError(f"duplicate probe id {id!r}")
        PROBES.append(Probe(id, action, expected, match, f, distributed, known_issue))
        return f

    def decorate(f):
        if f.__name__ != id:
            raise ValueError(f"the function of probe {id!r} is named {f.__name__!r}: name it after the probe")
        return register(f)

    return register(fn) if fn is not None else decorate


# ---------------------------------------------------------------------------- helpers


def _model(seed: int = 0, out: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, out))


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _wrap(algorithm, model=None, **kwargs):
    model = _model() if model is None else model
    opt = _sgd(model)
    model.with_bagua([opt], algorithm, **kwargs)
    return model, opt


def _step(model, opt, rank: int, step: int = 0):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 4, generator=g, dtype=next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _tensor(name="t", module="probe-module", n=4, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype).ensure_bagua_tensor(name, module)


def _bucket(*tensors, name="probe", **kwargs):
    from bagua_algos.runtime.bucket import BaguaBucket

    return BaguaBucket(list(tensors) or [_tensor(module=f"probe-{name}")], name=name, flatten=True, **kwargs)


def _launch(*argv):
    """``launch.main(argv)`` in this process; its usage error comes back as SystemExit
    whose message is "[exit CODE] <the error line on stderr>"."""
    from bagua_algos.launcher import launch

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            launch.main([str(a) for a in argv])
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if "error:" in line] or err.getvalue().splitlines() or [""]
        raise SystemExit(f"[exit {exc.code}] {lines[-1].strip()}") from None
    return "the launcher started a job"


def _finite_report(model, rank: int) -> str:
    values = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    bad = int((~torch.isfinite(values)).sum())
    if bad == 0:
        return f"all {values.numel()} parameter values finite on rank {rank}"
    kind = "NaN" if torch.isnan(values).any() else "inf"
    return f"{bad} of {values.numel()} parameter values non-finite ({kind}) on rank {rank}"


# ======================================================================= single-process
# ----------------------------------------------------------------- algorithm settings

from bagua_algos.algorithms import (  # noqa: E402
    AllreduceAverageAlgorithm,
    AsyncModelAverageAlgorithm,
    DecentralizedAlgorithm,
    GradientAllReduceAlgorithm,
    RelayAlgorithm,
)

add("ga_average_string", 'GradientAllReduceAlgorithm(average="false") (a flag read from a config file)',
    TypeError, "average must be True or False", lambda: GradientAllReduceAlgorithm(average="false"))
add("aa_interval_zero", "AllreduceAverageAlgorithm(communication_interval=0)",
    ValueError, "communication_interval must be an int >= 1", lambda: AllreduceAverageAlgorithm(communication_interval=0))
add("aa_interval_bool", "AllreduceAverageAlgorithm(communication_interval=True)",
    ValueError, "communication_interval must be an int >= 1", lambda: AllreduceAverageAlgorithm(communication_interval=True))
add("aa_interval_float", "AllreduceAverageAlgorithm(communication_interval=1.5)",
    ValueError, "communication_interval must be an int >= 1", lambda: AllreduceAverageAlgorithm(communication_interval=1.5))
add("dec_peer_mode", 'DecentralizedAlgorithm(peer_selection_mode="ring")',
    ValueError, "peer_selection_mode must be one of ['all', 'shift_one']",
    lambda: DecentralizedAlgorithm(peer_selection_mode="ring"))
add("dec_hierarchical_string", 'DecentralizedAlgorithm(hierarchical="false")',
    TypeError, "hierarchical must be True or False", lambda: DecentralizedAlgorithm(hierarchical="false"))
add("dec_unknown_topology", 'DecentralizedAlgorithm(hierarchical=False, topology="torus")',
    ValueError, "unknown topology 'torus'; valid names", lambda: DecentralizedAlgorithm(hierarchical=False, topology="torus"))
add("dec_topology_and_hierarchical", 'DecentralizedAlgorithm(hierarchical=True, topology="ring")',
    ValueError, "hierarchical=False with a topology", lambda: DecentralizedAlgorithm(hierarchical=True, topology="ring"))
add("relay_topology_typo", 'RelayAlgorithm(topology="double_binary_tre")',
    ValueError, "unknown topology 'double_binary_tre'; valid names: ['chain', 'binary_tree', 'double_binary_tree']",
    lambda: RelayAlgorithm(topology="double_binary_tre"))
add("relay_topology_ring", 'RelayAlgorithm(topology="ring")',
    ValueError, "topology 'ring' is not a tree; RelaySGD needs a tree: one of ['chain', 'binary_tree', 'double_binary_tree']",
    lambda: RelayAlgorithm(topology="ring"))
add("relay_mode", 'RelayAlgorithm(mode="mean")',
    ValueError, "mode must be one of ['count', 'world_size']", lambda: RelayAlgorithm(mode="mean"))
add("relay_drop_nan", 'RelayAlgorithm(drop_rate=float("nan"))',
    ValueError, "drop_rate must be a probability in [0, 1)", lambda: RelayAlgorithm(drop_rate=float("nan")))
add("relay_drop_one", "RelayAlgorithm(drop_rate=1.0)",
    ValueError, "drop_rate must be a probability in [0, 1)", lambda: RelayAlgorithm(drop_rate=1.0))
add("relay_seed_string", 'RelayAlgorithm(seed="x")',
    ValueError, "seed must be an int", lambda: RelayAlgorithm(seed="x"))
add("async_interval_negative", "AsyncModelAverageAlgorithm(sync_interval_ms=-1)",
    ValueError, "sync_interval_ms must be an int >= 0", lambda: AsyncModelAverageAlgorithm(sync_interval_ms=-1))
add("async_warmup_string", 'AsyncModelAverageAlgorithm(warmup_steps="x")',
    ValueError, "warmup_steps must be an int >= 0", lambda: AsyncModelAverageAlgorithm(warmup_steps="x"))


# -------------------------------------------------------------------- tensors, buckets


@add("tensor_rename", 'ensure_bagua_tensor("a", "m") then ensure_bagua_tensor("b", "m") on the same tensor',
     ValueError, "cannot be renamed 'b'")
def tensor_rename():
    t = _tensor("a", "m")
    t.ensure_bagua_tensor("b", "m")


add("tensor_setter_without_getter", "ensure_bagua_tensor(name, module, setter_closure=f) with no getter_closure",
    ValueError, "setter_closure needs a getter_closure",
    lambda: torch.zeros(2).ensure_bagua_tensor("t", "m", setter_closure=lambda p, t: None))
add("bucket_plain_tensor", "BaguaBucket([torch.zeros(4)], ...) (not registered as a Bagua tensor)",
    TypeError, "is not a Bagua tensor; register it with", lambda: _bucket(torch.zeros(4)))
add("bucket_alignment_zero", "BaguaBucket(tensors, ..., alignment=0)",
    ValueError, "alignment must be an int >= 1", lambda: _bucket(alignment=0))
add("bucket_mixed_dtypes", "BaguaBucket([float32 tensor, float64 tensor], ...)",
    ValueError, "must share dtype and device",
    lambda: _bucket(_tensor("a", "mx"), _tensor("b", "mx", dtype=torch.float64)))
add("op_compression_unknown", 'bucket.append_centralized_synchronous_op(compression="MinMaxUInt4") (other bits)',
    ValueError, "compression must be one of [None, 'MinMaxUInt8']",
    lambda: _bucket().append_centralized_synchronous_op(compression="MinMaxUInt4"))
add("op_peer_weight_size", "bucket.append_decentralized_synchronous_op(peer_weight=<tensor of the wrong size>)",
    ValueError, "peer_weight must be a tensor of the bucket's 4 elements",
    lambda: _bucket().append_decentralized_synchronous_op(peer_weight=torch.zeros(3).ensure_bagua_tensor("pw")))
add("op_peer_mode", 'bucket.append_decentralized_synchronous_op(peer_weight, peer_selection_mode="ring")',
    ValueError, "peer_selection_mode must be one of ['all', 'shift_one']",
    lambda: (lambda b: b.append_decentralized_synchronous_op(b.flattened_tensor(), peer_selection_mode="ring"))(_bucket()))


# ------------------------------------------------------------------------- topologies

from topologies import ChainTopology, Topology, get_topology  # noqa: E402

add("topology_unknown_name", 'get_topology("torus", 4)',
    ValueError, "unknown topology 'torus'; valid names are: chain", lambda: get_topology("torus", 4))
add("topology_world_size_zero", 'get_topology("ring", 0)',
    ValueError, "world_size must be an int >= 1, got 0", lambda: get_topology("ring", 0))

# --------------------------------------------------------------------------- samplers

from samplers import DistributedHeterogeneousSampler  # noqa: E402

_LABELS = [i % 4 for i in range(40)]


def _sampler(**kwargs):
    settings = dict(dataset=list(range(len(_LABELS))), labels=_LABELS, num_replicas=2, rank=0)
    settings.update(kwargs)
    return DistributedHeterogeneousSampler(**settings)


add("sampler_alpha_zero", "DistributedHeterogeneousSampler(dataset, alpha=0)",
    ValueError, "alpha must be a finite number > 0", lambda: _sampler(alpha=0))
add("sampler_alpha_nan", 'DistributedHeterogeneousSampler(dataset, alpha=float("nan"))',
    ValueError, "alpha must be a finite number > 0, got alpha=nan", lambda: _sampler(alpha=float("nan")))
add("sampler_alpha_inf", 'DistributedHeterogeneousSampler(dataset, alpha=float("inf"))',
    ValueError, "infinite concentration is not supported", lambda: _sampler(alpha=float("inf")))
add("sampler_empty_dataset", "DistributedHeterogeneousSampler([], labels=[], num_replicas=2, rank=0)",
    ValueError, "the dataset has 0 samples, fewer than num_replicas=2", lambda: _sampler(dataset=[], labels=[]))
add("sampler_rank_out_of_range", "DistributedHeterogeneousSampler(dataset, num_replicas=2, rank=2)",
    ValueError, "rank must be in [0, num_replicas) = [0, 2), got rank=2", lambda: _sampler(rank=2))
add("sampler_no_process_group", "DistributedHeterogeneousSampler(dataset) without num_replicas/rank, no process group",
    RuntimeError, "Pass num_replicas= and rank= explicitly",
    lambda: DistributedHeterogeneousSampler(list(range(40)), labels=_LABELS))

# --------------------------------------------------------------------------- launcher

add("launch_nproc_zero", "python -m bagua_algos.launch --nproc_per_node 0 train.py",
    SystemExit, "[exit 2] python -m bagua_algos.launch: error: argument --nproc_per_node: must be >= 1",
    lambda: _launch("--nproc_per_node", 0, "train.py"))
add("launch_nproc_not_int", "python -m bagua_algos.launch --nproc_per_node two train.py",
    SystemExit, "[exit 2] python -m bagua_algos.launch: error: argument --nproc_per_node: invalid value 'two': give a number >= 1 or one of auto, cpu, gpu",
    lambda: _launch("--nproc_per_node", "two", "train.py"))
add("launch_node_rank", "python -m bagua_algos.launch --nnodes 2 --node_rank 2 train.py",
    SystemExit, "argument --node_rank: must be in [0, 2)", lambda: _launch("--nnodes", 2, "--node_rank", 2, "train.py"))
add("launch_no_such_script", "python -m bagua_algos.launch --nproc_per_node 2 nosuch.py",
    SystemExit, "[exit 2] python -m bagua_algos.launch: error: argument training_script: no file 'nosuch.py'",
    lambda: _launch("--nproc_per_node", 2, "nosuch.py"))
add("launch_torchrun_spelling", "python -m bagua_algos.launch --nproc-per-node 0 train.py (torchrun's spelling)",
    SystemExit, "[exit 2] python -m bagua_algos.launch: error: argument --nproc-per-node: must be >= 1 (or one of "
    "auto, cpu, gpu), got 0", lambda: _launch("--nproc-per-node", 0, "train.py"))
add("launch_nccl_more_workers_than_gpus", "python -m bagua_algos.launch --backend nccl --nproc_per_node 1000 <a script>",
    SystemExit, "[exit 2] python -m bagua_algos.launch: error: argument --backend: nccl puts each worker on its own "
    "GPU (device cuda:LOCAL_RANK), but this node ", lambda: _launch("--backend", "nccl", "--nproc_per_node", 1000, __file__))

# ------------------------------------------------------------ process group, checkpoint

import bagua_algos  # noqa: E402
from bagua_algos.runtime import checkpoint  # noqa: E402

add("with_bagua_before_init", "model.with_bagua([opt], GradientAllReduceAlgorithm()) before init_process_group()",
    RuntimeError, "call bagua_algos.init_process_group() first",
    lambda: (lambda m: m.with_bagua([_sgd(m)], GradientAllReduceAlgorithm()))(_model()))


@add("checkpoint_bad_tracker", "load_checkpoint(dir) where latest_checkpointed_iteration.txt holds 'last'",
     ValueError, "must hold an iteration number, got 'last'")
def checkpoint_bad_tracker():
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, checkpoint.TRACKER).write_text("last")
        checkpoint.load_checkpoint(tmp, _model())


class _Payload:
    """Unpickling it would run a shell command (a file that is code, not data)."""

    def __reduce__(self):
        import os

        return os.system, ("echo this should never run",)


def _checkpoints(tmp: str, iterations=(1,)) -> None:
    for it in iterations:
        checkpoint.save_checkpoint(it, tmp, _model(it))


@add("checkpoint_pickled_payload", "load_checkpoint(dir) whose file (with a matching .sha256) holds a pickled "
     "object that runs a shell command", checkpoint.UntrustedCheckpointError, "pass trust_pickle=True or set "
     "BAGUA_ALGOS_TRUST_PICKLE=1")
def checkpoint_pickled_payload():
    import hashlib
    import json

    with tempfile.TemporaryDirectory() as tmp:
        _checkpoints(tmp)
        path = checkpoint._rank_file(tmp, 1, 0)
        buffer = io.BytesIO()
        torch.save({"model": _model().state_dict(), "extra": _Payload()}, buffer)
        Path(path).unlink()
        Path(path).write_bytes(buffer.getvalue())
        Path(path + ".sha256").unlink()
        Path(path + ".sha256").write_text(json.dumps({"sha256": hashlib.sha256(buffer.getvalue()).hexdigest(),
                                                      "bytes": len(buffer.getvalue()), "world_size": 1}))
        checkpoint.load_checkpoint(tmp, _model())


@add("checkpoint_tracker_negative", "resume_from_checkpoint(dir) where the tracker holds '-5' and iteration 1 is "
     "valid on disk", None, "resumed from iteration 1 after a warning: ")
def checkpoint_tracker_negative():
    import warnings

    with tempfile.TemporaryDirectory() as tmp:
        _checkpoints(tmp)
        Path(tmp, checkpoint.TRACKER).write_text("-5")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iteration = checkpoint.resume_from_checkpoint(tmp, _model())
        return f"resumed from iteration {iteration} after a warning: {caught[0].message}" if caught else \
            f"resumed from iteration {iteration}, no warning"


@add("checkpoint_checksum_not_an_object", "load_checkpoint(dir) where the file's .sha256 holds '[1, 2]'",
     checkpoint.CheckpointError, "no valid checksum file bagua_rank_00000_states.pt.sha256")
def checkpoint_checksum_not_an_object():
    with tempfile.TemporaryDirectory() as tmp:
        _checkpoints(tmp)
        Path(checkpoint._rank_file(tmp, 1, 0) + ".sha256").unlink()
        Path(checkpoint._rank_file(tmp, 1, 0) + ".sha256").write_text("[1, 2]")
        checkpoint.load_checkpoint(tmp, _model())


@add("checkpoint_other_model", "load_checkpoint(dir) into a model whose last layer has 5 outputs, not 2",
     checkpoint.CheckpointMismatchError, "does not fit (nothing was loaded): its model '2.weight' has shape (2, 3), "
     "this model's (5, 3)")
def checkpoint_other_model():
    with tempfile.TemporaryDirectory() as tmp:
        _checkpoints(tmp)
        checkpoint.load_checkpoint(tmp, _model(out=5))


@add("checkpoint_path_is_a_file", "resume_from_checkpoint(the tracker file) instead of its folder",
     checkpoint.CheckpointError, "is a file; pass the folder that holds latest_checkpointed_iteration.txt")
def checkpoint_path_is_a_file():
    with tempfile.TemporaryDirectory() as tmp:
        _checkpoints(tmp)
        checkpoint.resume_from_checkpoint(str(Path(tmp, checkpoint.TRACKER)), _model())


# ------------------------------------------------------------ the sweep's and reproduce's commands


def _command(main, *argv):
    """``main(argv)`` of a command in this process (torch's thread count kept); its usage
    error comes back as SystemExit whose message is "[exit CODE] <the error line>"."""
    threads = torch.get_num_threads()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main([str(a) for a in argv])
    except SystemExit as exc:
        lines = [line for line in err.getvalue().splitlines() if "error:" in line] or err.getvalue().splitlines() or [""]
        raise SystemExit(f"[exit {exc.code}] {lines[-1].strip()}") from None
    finally:
        torch.set_num_threads(threads)
    return "the command ran"


def _sweep(*argv):
    from bagua_algos.experiments.sweep.cli import main

    return _command(main, "--workers", 2, "--configs", "allreduce_average", "--alphas", 0.1, "--epochs", 1, *argv)


add("sweep_seed_negative", "bagua-algos sweep --seed -1", SystemExit,
    "[exit 2] bagua-algos sweep: error: argument --seed: expected an integer in [0, 4294967295]",
    lambda: _sweep("--seed", -1))


@add("sweep_out_dir_unwritable", "bagua-algos sweep --out-dir FILE/sub (a folder under a file)", SystemExit,
     "argument --out-dir: cannot write in")
def sweep_out_dir_unwritable():
    with tempfile.NamedTemporaryFile() as f:
        _sweep("--out-dir", f"{f.name}/sub")


@add("sweep_resume_line_not_a_record", "bagua-algos sweep --resume where runs.jsonl's line 2 is '[1, 2]'", SystemExit,
     "line 2 is not a run's record (a JSON object with config, alpha and lr), got '[1, 2]'; delete that line")
def sweep_resume_line_not_a_record():
    import json

    from bagua_algos.experiments.sweep.cli import build_parser, config_from_arguments
    from bagua_algos.experiments.sweep.runlog import RUNS_FILE, settings_of

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--workers", "2", "--configs", "allreduce_average", "--alphas", "0.1", "--epochs", "1", "--out-dir", tmp]
        settings = settings_of(config_from_arguments(build_parser().parse_args(argv)))
        Path(tmp, RUNS_FILE).write_text(json.dumps({"sweep_settings": settings}) + "\n[1, 2]\n")
        _sweep("--out-dir", tmp, "--resume")


@add("reproduce_out_unwritable", "bagua-algos reproduce seed001-table4 --out FILE/sub", SystemExit,
     "[exit 2] reproduce: error: argument --out: cannot write in")
def reproduce_out_unwritable():
    from bagua_algos.experiments.reproduce.cli import main

    with tempfile.NamedTemporaryFile() as f:
        _command(main, "seed001-table4", "--out", f"{f.name}/sub")


# ======================================================================= two gloo workers


def dist_probe(id, action, expected, match, known_issue=""):
    return add(id, action, expected, match, distributed=True, known_issue=known_issue)


@dist_probe("wrap_optimizers_none", "model.with_bagua(None, GradientAllReduceAlgorithm())",
            TypeError, "optimizers must be a list of torch.optim.Optimizer, got NoneType")
def wrap_optimizers_none(rank, n):
    _model().with_bagua(None, GradientAllReduceAlgorithm())


@dist_probe("wrap_foreign_optimizer", "model.with_bagua([optimizer of another model], ...)",
            ValueError, "is not a parameter of the module given to with_bagua")
def wrap_foreign_optimizer(rank, n):
    _model().with_bagua([_sgd(_model())], GradientAllReduceAlgorithm())


@dist_probe("wrap_unknown_algorithm_name", 'model.with_bagua([opt], "signsgd")',
            ValueError, "unknown algorithm 'signsgd'; available algorithms:")
def wrap_unknown_algorithm_name(rank, n):
    model = _model()
    model.with_bagua([_sgd(model)], "signsgd")


@dist_probe("wrap_do_flatten_string", 'model.with_bagua([opt], algorithm, do_flatten="false")',
            TypeError, "do_flatten must be True or False, got 'false'")
def wrap_do_flatten_string(rank, n):
    _wrap(GradientAllReduceAlgorithm(), do_flatten="false")


@dist_probe("wrap_bucket_size_zero", "model.with_bagua([opt], algorithm, bucket_size=0)",
            ValueError, "bucket_size must be a positive number of bytes, got 0")
def wrap_bucket_size_zero(rank, n):
    _wrap(GradientAllReduceAlgorithm(), bucket_size=0)


@dist_probe("wrap_broadcast_buffers", 'model.with_bagua([opt], algorithm, broadcast_buffers="always")',
            ValueError, "broadcast_buffers must be one of [False, True, 'first_step'], got 'always'")
def wrap_broadcast_buffers(rank, n):
    _wrap(GradientAllReduceAlgorithm(), broadcast_buffers="always")


@dist_probe("wrap_group_without_me", "each rank passes process_group=new_group([other rank]), a group it is not in",
            ValueError, "process_group does not contain this process")
def wrap_group_without_me(rank, n):
    groups = [bagua_algos.new_group([r]) for r in range(n)]
    _wrap(GradientAllReduceAlgorithm(), process_group=groups[(rank + 1) % n])


@dist_probe("wrap_group_not_a_group", 'model.with_bagua([opt], algorithm, process_group="world")',
            TypeError, "group must be")
def wrap_group_not_a_group(rank, n):
    _wrap(GradientAllReduceAlgorithm(), process_group="world")


@dist_probe("wrap_shapes_differ", "rank 1 builds Linear(3, 5) as last layer, rank 0 Linear(3, 2)",
            ValueError, "the module differs across ranks")
def wrap_shapes_differ(rank, n):
    _wrap(GradientAllReduceAlgorithm(), model=_model(out=2 + 3 * rank))


@dist_probe("dtype_change_after_wrap", "model.double() after with_bagua, then a training step",
            RuntimeError, "is now torch.float64 on cpu but was torch.float32")
def dtype_change_after_wrap(rank, n):
    model, opt = _wrap(GradientAllReduceAlgorithm())
    model.double()
    _step(model, opt, rank)


@dist_probe("bfloat16_model", "model.bfloat16() before with_bagua, gradient_allreduce, one step",
            None, "all 23 parameter values finite")
def bfloat16_model(rank, n):
    model, opt = _wrap(GradientAllReduceAlgorithm(), model=_model().bfloat16())
    _step(model, opt, rank)
    return _finite_report(model, rank)


@dist_probe("dec_mixed_dtypes", "a model with float32 and float64 layers under DecentralizedAlgorithm()",
            ValueError, "must share dtype and device")
def dec_mixed_dtypes(rank, n):
    model = _model()
    model[2].double()
    _wrap(DecentralizedAlgorithm(), model=model)


@dist_probe("dec_all_frozen", "every parameter requires_grad=False, with_bagua([], DecentralizedAlgorithm())",
            ValueError, "no parameter that requires grad")
def dec_all_frozen(rank, n):
    model = _model().requires_grad_(False)
    model.with_bagua([], DecentralizedAlgorithm())


@dist_probe("wrap_sparse_embedding", "Embedding(10, 3, sparse=True) under gradient_allreduce, one training step",
            NotImplementedError, "parameter 'weight' has a sparse gradient")
def wrap_sparse_embedding(rank, n):
    model = torch.nn.Embedding(10, 3, sparse=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    opt.zero_grad()  # set_to_none: the next gradient is a new, sparse tensor
    model(torch.tensor([1, 2 + rank])).sum().backward()
    opt.step()


@dist_probe("aa_without_optimizer", "model.with_bagua([], AllreduceAverageAlgorithm()) (no optimizer)",
            ValueError, "pass the module's optimizers to with_bagua")
def aa_without_optimizer(rank, n):
    _model().with_bagua([], AllreduceAverageAlgorithm())


class NoEdges(Topology):
    """A user's own topology that forgot the edges (every rank alone)."""

    name = "no_edges"

    def _candidate_neighbors(self, rank):
        return []


@dist_probe("relay_not_a_tree", "RelayAlgorithm(topology=<own Topology with no edges>) on 2 workers",
            ValueError, "is not a tree; RelaySGD needs a tree")
def relay_not_a_tree(rank, n):
    _wrap(RelayAlgorithm(topology=NoEdges(n)))


@dist_probe("dec_disconnected_topology", "DecentralizedAlgorithm(hierarchical=False, topology=<own Topology with no edges>)",
            ValueError, "is not connected")
def dec_disconnected_topology(rank, n):
    model, opt = _wrap(DecentralizedAlgorithm(hierarchical=False, topology=NoEdges(n)))
    _step(model, opt, rank)


@dist_probe("relay_topology_size", "RelayAlgorithm(topology=ChainTopology(3)) on 2 workers",
            ValueError, "has 3 ranks but the process group has 2")
def relay_topology_size(rank, n):
    _wrap(RelayAlgorithm(topology=ChainTopology(n + 1)))


@dist_probe("dec_topology_size", "DecentralizedAlgorithm(hierarchical=False, topology=ChainTopology(3)) on 2 workers",
            ValueError, "has 3 ranks but the process group has 2")
def dec_topology_size(rank, n):
    _wrap(DecentralizedAlgorithm(hierarchical=False, topology=ChainTopology(n + 1)))


@dist_probe("dec_shift_one_one_node", 'DecentralizedAlgorithm(peer_selection_mode="shift_one") on one node '
            "(hierarchical by default: one node gossips with no one)",
            ValueError, "peer_selection_mode='shift_one' needs an even number of nodes, got 1")
def dec_shift_one_one_node(rank, n):
    _wrap(DecentralizedAlgorithm(peer_selection_mode="shift_one"))


@dist_probe("async_no_flatten", "model.with_bagua([opt], AsyncModelAverageAlgorithm(), do_flatten=False)",
            ValueError, "AsyncModelAverageAlgorithm needs do_flatten=True")
def async_no_flatten(rank, n):
    _wrap(AsyncModelAverageAlgorithm(), do_flatten=False)


@dist_probe("ga_hierarchical_subgroup", "GradientAllReduceAlgorithm(hierarchical=True) over a one-rank process_group",
            ValueError, "hierarchical=True reduces over all workers")
def ga_hierarchical_subgroup(rank, n):
    groups = [bagua_algos.new_group([r]) for r in range(n)]
    _wrap(GradientAllReduceAlgorithm(hierarchical=True), process_group=groups[rank])


@dist_probe("async_abort_not_module", 'model.bagua_algorithm.abort("model") (a string, not the module)',
            TypeError, "abort()/resume() take the module given to with_bagua")
def async_abort_not_module(rank, n):
    model, _ = _wrap(AsyncModelAverageAlgorithm(sync_interval_ms=0))
    model.bagua_algorithm.abort("model")


@dist_probe("load_state_other_algorithm", "load_bagua_state_dict(state saved under relay) into a gradient_allreduce model",
            ValueError, "checkpoint holds state of algorithm 'RelayAlgorithm', this module runs 'GradientAllReduceAlgorithm'")
def load_state_other_algorithm(rank, n):
    relay, _ = _wrap(RelayAlgorithm(topology="chain"))
    model, _ = _wrap(GradientAllReduceAlgorithm())
    model.load_bagua_state_dict(relay.bagua_state_dict())


@dist_probe("broadcast_src_out_of_range", "bagua_algos.broadcast(tensor, src=2) with 2 workers",
            ValueError, "src")
def broadcast_src_out_of_range(rank, n):
    bagua_algos.broadcast(torch.zeros(3), src=n)


# --- NaN / inf gradients: observed behaviour, not errors (torch DDP propagates them too)


def _poison_rank_one(model, rank: int, value: float):
    """Rank 1's gradient of the first weight becomes ``value`` everywhere."""
    if rank == 1:
        model[0].weight.register_hook(lambda g: torch.full_like(g, value))


def _nan_probe(algorithm_factory, value, steps=2, abort=False):
    def fn(rank, n):
        model = _model()
        _poison_rank_one(model, rank, value)
        opt = _sgd(model)
        model.with_bagua([opt], algorithm_factory())
        for step in range(steps):
            _step(model, opt, rank, step)
        if abort:
            model.bagua_algorithm.abort(model)
        return _finite_report(model, rank)

    return fn


_NAN_NOTE = "rank 1's gradient of the first weight set to NaN (a tensor hook), 2 training steps"
for _name, _factory, _extra in (
    ("gradient_allreduce", GradientAllReduceAlgorithm, {}),
    ("allreduce_average", AllreduceAverageAlgorithm, {}),
    ("decentralized", DecentralizedAlgorithm, {}),
    ("relay", lambda: RelayAlgorithm(topology="chain"), {}),
    ("async", lambda: AsyncModelAverageAlgorithm(sync_interval_ms=5), {"abort": True}),
):
    add(f"nan_grad_{_name}", f"{_NAN_NOTE} under {_name}" + (" (then abort())" if _extra else ""),
        None, "values non-finite (NaN) on rank", _nan_probe(_factory, float("nan"), **_extra), distributed=True)
add("inf_grad_gradient_allreduce", "the same with +inf under gradient_allreduce",
    None, "values non-finite", _nan_probe(GradientAllReduceAlgorithm, float("inf")), distributed=True)


# --- low-bit ---

from bagua_algos.runtime.backend import CommOpError  # noqa: E402
from bagua_algos.algorithms import (  # noqa: E402
    ByteGradAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
    QAdamAlgorithm,
    QAdamOptimizer,
    TernGradAlgorithm,
)

add("terngrad_bits_three", "TernGradAlgorithm(bits=3)",
    ValueError, "bits must be one of [1, 2, 4, 8], got 3", lambda: TernGradAlgorithm(bits=3))
add("terngrad_bits_bool", "TernGradAlgorithm(bits=True)",
    ValueError, "bits must be one of [1, 2, 4, 8], got True", lambda: TernGradAlgorithm(bits=True))
add("terngrad_clip_negative", "TernGradAlgorithm(clip=-2.5)",
    ValueError, "clip must be None (no clipping) or a finite number > 0", lambda: TernGradAlgorithm(clip=-2.5))
add("terngrad_clip_nan", 'TernGradAlgorithm(clip=float("nan"))',
    ValueError, "clip must be None (no clipping) or a finite number > 0", lambda: TernGradAlgorithm(clip=float("nan")))
add("terngrad_stochastic_string", 'TernGradAlgorithm(stochastic="yes")',
    TypeError, "stochastic must be True or False", lambda: TernGradAlgorithm(stochastic="yes"))
add("terngrad_seed_negative", "TernGradAlgorithm(seed=-1)",
    ValueError, "seed must be an int >= 0", lambda: TernGradAlgorithm(seed=-1))
add("bytegrad_hierarchical_string", 'ByteGradAlgorithm(hierarchical="false")',
    TypeError, "hierarchical must be True or False", lambda: ByteGradAlgorithm(hierarchical="false"))
add("lpd_interval_zero", "LowPrecisionDecentralizedAlgorithm(communication_interval=0)",
    ValueError, "communication_interval must be an int >= 1",
    lambda: LowPrecisionDecentralizedAlgorithm(communication_interval=0))
add("qadam_warmup_negative", "QAdamOptimizer(model.parameters(), warmup_steps=-1)",
    ValueError, "warmup_steps must be an int >= 2", lambda: QAdamOptimizer(_model().parameters(), warmup_steps=-1))
add("qadam_beta_one", "QAdamOptimizer(model.parameters(), betas=(0.9, 1.0))",
    ValueError, "betas[1] must be a finite number in [0.0, 1.0)",
    lambda: QAdamOptimizer(_model().parameters(), betas=(0.9, 1.0)))
add("qadam_plain_adam", "QAdamAlgorithm(torch.optim.Adam(model.parameters()))",
    TypeError, "q_adam_optimizer must be a QAdamOptimizer",
    lambda: QAdamAlgorithm(torch.optim.Adam(_model().parameters())))
add("op_compression_minmax_uint4", 'bucket.append_centralized_synchronous_op(compression="MinMaxUInt4")',
    ValueError, "compression must be one of [None, 'MinMaxUInt8']",
    lambda: _bucket().append_centralized_synchronous_op(compression="MinMaxUInt4"))
add("op_low_precision_sizes", "bucket.append_low_precision_decentralized_synchronous_op(weight, None, None)",
    ValueError, "left_peer_weight must be a tensor of the bucket's 4 elements",
    lambda: (lambda b: b.append_low_precision_decentralized_synchronous_op(
        b.flattened_tensor().ensure_bagua_tensor("w"), None, None, hierarchical=False))(_bucket()))


@dist_probe("nan_grad_terngrad", "every rank's gradient of the first weight set to NaN, one step under TernGradAlgorithm()",
            CommOpError, "has NaN/inf values")
def nan_grad_terngrad(rank, n):
    model = _model()
    model[0].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    opt = _sgd(model)
    model.with_bagua([opt], TernGradAlgorithm())
    _step(model, opt, rank)

# NaN on one rank only: the rank that cannot encode tells the others through the
# collective itself (a marked header), so every rank raises at once instead of the
# others waiting for the process group's timeout.
def _one_rank_nan_steps(algorithm_factory, steps=2):
    def fn(rank, n):
        model = _model()
        _poison_rank_one(model, rank, float("nan"))
        opt = _sgd(model)
        model.with_bagua([opt], algorithm_factory())
        for step in range(steps):
            _step(model, opt, rank, step)
        return _finite_report(model, rank)

    return fn


for _name, _factory in (
    ("terngrad", TernGradAlgorithm),
    ("bytegrad", lambda: ByteGradAlgorithm(hierarchical=False)),
    ("low_precision_decentralized", lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False)),
):
    add(f"nan_grad_one_rank_{_name}", f"{_NAN_NOTE} under {_name}: every rank raises, none waits for the timeout",
        CommOpError, "of rank(s) [1] has NaN/inf values", _one_rank_nan_steps(_factory), distributed=True)


# --- powersgd ---


def _powersgd(**kwargs):
    from bagua_algos.algorithms import PowerSGDAlgorithm

    return lambda: PowerSGDAlgorithm(**kwargs)


for _id, _kwargs, _error, _match in (
    ("powersgd_rank_zero", {"rank": 0}, ValueError, "rank must be an int >= 1, got 0"),
    ("powersgd_rank_float", {"rank": 2.0}, ValueError, "rank must be an int >= 1, got 2.0"),
    ("powersgd_orthogonalization", {"orthogonalization": "qr"}, ValueError,
     "orthogonalization must be one of ['auto', 'gram_schmidt', 'cholesky_qr2', 'torch_qr', 'householder'], got 'qr'"),
    ("powersgd_min_rate_below_one", {"min_compression_rate": 0.5}, ValueError,
     "min_compression_rate must be a finite number >= 1.0, got 0.5"),
    ("powersgd_min_rate_string", {"min_compression_rate": "2"}, ValueError, "min_compression_rate must be"),
    ("powersgd_decay_above_one", {"error_decay": 1.5}, ValueError, "error_decay must be a finite number in [0.0, 1.0], got 1.5"),
    ("powersgd_start_iter_negative", {"start_iter": -1}, ValueError, "start_iter must be an int >= 0, got -1"),
    ("powersgd_epsilon_negative", {"epsilon": -1e-8}, ValueError, "epsilon must be a finite number >= 0.0, got -1e-08"),
    ("powersgd_error_in_grad_async", {"error_in_grad": True, "async_error": "full"}, ValueError,
     "error_in_grad=True and async_error cannot be combined"),
):
    add(_id, "PowerSGDAlgorithm(" + ", ".join(f"{k}={v!r}" for k, v in _kwargs.items()) + ")",
        _error, _match, _powersgd(**_kwargs))


@dist_probe("powersgd_error_in_grad_zero_grad", "PowerSGDAlgorithm(error_in_grad=True), then optimizer.zero_grad() "
            "in the loop (it would erase the error kept in p.grad)", RuntimeError, "remove optimizer.zero_grad()")
def powersgd_error_in_grad_zero_grad(rank, n):
    from bagua_algos.algorithms import PowerSGDAlgorithm

    model, opt = _wrap(PowerSGDAlgorithm(error_in_grad=True, min_compression_rate=1.0))
    for step in range(3):
        _step(model, opt, rank, step)  # _step calls opt.zero_grad() first

@dist_probe("nan_grad_powersgd", f"{_NAN_NOTE} under PowerSGDAlgorithm(rank=2)", None,
            "values non-finite (NaN) on rank")
def nan_grad_powersgd(rank, n):
    from bagua_algos.algorithms import PowerSGDAlgorithm

    return _nan_probe(lambda: PowerSGDAlgorithm(rank=2, min_compression_rate=1.0), float("nan"))(rank, n)


# --- seed 001's linear compressors: best-approximation PowerSGD and the random sketches ---


def _registered(name, **kwargs):
    def build():
        from bagua_algos import Algorithm

        return Algorithm.init(name, **kwargs)

    return build


for _id, _name, _kwargs, _error, _match in (
    ("powersgd_power_iterations_zero", "powersgd", {"power_iterations": 0}, ValueError,
     "power_iterations must be an int >= 1, got 0"),
    ("powersgd_power_iterations_float", "powersgd", {"power_iterations": 4.0}, ValueError,
     "power_iterations must be an int >= 1, got 4.0"),
    ("unbiased_low_rank_rank_zero", "unbiased_low_rank", {"rank": 0}, ValueError, "rank must be an int >= 1, got 0"),
    ("unbiased_low_rank_error_feedback", "unbiased_low_rank", {"error_feedback": True}, TypeError,
     "unexpected keyword argument 'error_feedback'"),
    ("random_block_both_sizes", "random_block", {"powersgd_rank": 2, "compression_ratio": 8}, ValueError,
     "give one of powersgd_rank (send what rank-r PowerSGD sends) and compression_ratio"),
    ("random_block_ratio_below_one", "random_block", {"compression_ratio": 0.5}, ValueError,
     "compression_ratio must be None or a finite number >= 1 (values sent: ceil(numel / ratio) per tensor), got 0.5"),
    ("random_block_seed_negative", "random_block", {"seed": -1}, ValueError, "seed must be an int >= 0 and < 2**63"),
    ("random_k_powersgd_rank_zero", "random_k", {"powersgd_rank": 0}, ValueError,
     "powersgd_rank must be None or an int >= 1, got 0"),
    ("random_k_error_feedback_string", "random_k", {"error_feedback": "yes"}, TypeError,
     "error_feedback must be True or False, got 'yes'"),
    ("random_k_min_rate_below_one", "random_k", {"min_compression_rate": 0.9}, ValueError,
     "min_compression_rate must be a finite number >= 1.0, got 0.9"),
):
    add(_id, f"Algorithm.init({_name!r}, " + ", ".join(f"{k}={v!r}" for k, v in _kwargs.items()) + ")",
        _error, _match, _registered(_name, **_kwargs))


@add("random_sketch_hook_powersgd", "RandomSketchHookState(PowerSGDAlgorithm()) (PowerSGD has its own hook)",
     TypeError, "algorithm must be an UnbiasedLowRankAlgorithm, RandomBlockAlgorithm or RandomKAlgorithm")
def random_sketch_hook_powersgd():
    from bagua_algos.algorithms import PowerSGDAlgorithm
    from bagua_algos.ddp_hooks import RandomSketchHookState

    RandomSketchHookState(PowerSGDAlgorithm())


add("powersgd_hook_power_iterations_zero", "PowerSGDHookState(power_iterations=0)", ValueError,
    "power_iterations must be an int >= 1, got 0",
    lambda: __import__("bagua_algos.ddp_hooks", fromlist=["PowerSGDHookState"]).PowerSGDHookState(power_iterations=0))
