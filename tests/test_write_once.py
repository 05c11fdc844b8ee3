"""An algorithm written once runs as processes and on the one-process engine: the
template and two algorithms in Bagua's author style (tests/bagua_style_algorithms.py),
named by their files, with nothing registered for the engine. Every worker of the
engine holds what its gloo process holds (the bound of tests/test_engine_equality.py),
and the sweep's ``--configs FILE.py:ClassName`` trains them on both engines."""

from __future__ import annotations

import json

import pytest
import torch

import engine_cases
from bagua_algos.experiments.gloo_workers import run_workers
from subprocesses import REPO, run_python

RTOL = 1e-5
STYLE = str(REPO / "tests" / "bagua_style_algorithms.py")
TEMPLATE = str(REPO / "examples" / "ef_sign_sgd.py")
CASES = [
    ("sum_then_scale", f"{STYLE}:SumThenScaleAlgorithm", {}),
    ("shift_one_gossip", f"{STYLE}:ShiftOneGossipAlgorithm", {"pull": 0.25}),
    ("template", f"{TEMPLATE}:EFSignSGDAlgorithm", {}),
    ("template_no_ef", f"{TEMPLATE}:EFSignSGDAlgorithm", {"error_feedback": False}),
]


@pytest.fixture(scope="module")
def per_rank():
    return run_workers(engine_cases.per_rank, 4, CASES, timeout=120)


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_every_worker_equals_its_process(per_rank, label, name, kwargs):
    expected = torch.stack([per_rank[rank][label] for rank in range(4)])
    got = engine_cases.stacked(4, name, kwargs)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= RTOL * scale, f"{label}: {(got - expected).abs().max() / scale:.2e}"
    start = engine_cases.model()
    moved = (expected - torch.nn.utils.parameters_to_vector(start.parameters()).detach()).abs().max()
    assert moved > 100 * RTOL * scale  # it trained


def test_the_gossip_differs_per_worker_and_the_sum_then_scale_is_the_mean():
    """The two Bagua-style algorithms do what they say on the engine: gossip leaves the
    workers apart, averaging the gradients keeps them together."""
    gossip = engine_cases.stacked(4, CASES[1][1], CASES[1][2])
    assert (gossip - gossip.mean(0)).abs().max() > 1e-4
    mean = engine_cases.stacked(4, CASES[0][1], {})
    assert (mean - mean[0]).abs().max() == 0


@pytest.mark.parametrize("engine", ["sim", "processes"])
def test_the_sweep_trains_an_algorithm_named_by_its_file(tmp_path, engine):
    configs = "tests/bagua_style_algorithms.py:ShiftOneGossipAlgorithm:pull=0.5;examples/ef_sign_sgd.py:EFSignSGDAlgorithm"
    code, out, err = run_python([REPO / "benchmarks" / "heterogeneity_sweep.py", "--engine", engine, "--workers", "2",
                                 "--configs", configs, "--alphas", "1", "--epochs", "2", "--jobs", "1",
                                 "--out-dir", tmp_path], timeout=240)
    assert code == 0, err[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    assert {row["config"] for row in rows} == set(configs.split(";"))
    for row in rows:
        assert row["final_mean_worker_accuracy"] > 0.3, row  # trained (chance: 0.1)


def test_an_op_that_calls_torch_distributed_itself_is_refused_by_name():
    """The engine answers comm's calls for its workers; an op that calls torch.distributed
    directly (no process group exists in the engine's process) is refused with the way
    out at the first step."""
    import torch.distributed as dist

    from bagua_algos.engine import Engine, EngineRefusal
    from bagua_algos.runtime.algorithm import Algorithm, AlgorithmImpl

    class DirectImpl(AlgorithmImpl):
        def init_operations(self, bagua_ddp, bucket):
            bucket.clear_ops()
            bucket.append_python_op(lambda name: dist.all_reduce(bucket.flat_view()))

    class Direct(Algorithm):
        def reify(self, process_group):
            return DirectImpl(process_group)

    engine = Engine(torch.nn.Linear(3, 2), 2, Direct(), lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(EngineRefusal, match=r"calls torch.distributed itself.*--engine processes"):
        engine.step(torch.randn(2, 4, 3), torch.randint(0, 2, (2, 4)), torch.nn.functional.cross_entropy)
