"""benchmarks/exogym_compare.py: without EXO Gym it says how to get it; the engine's side runs."""

from __future__ import annotations

import json
import sys

import pytest

from bagua_algos.experiments import exogym_compare


def test_without_exogym_the_command_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "exogym", None)  # an import of it fails, present or not
    assert exogym_compare.main(["--frameworks", "exogym,engine", "--steps", "3", "--warmup", "1"]) == 2
    assert "clone exo-explore/gym" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["--methods", "adam"], "argument --methods"),
    (["--frameworks", "horovod"], "argument --frameworks"),
    (["--steps", "5", "--warmup", "5"], "argument --warmup"),
    (["--seeds", "a"], "argument --seeds"),
    (["--adamw", "lion"], "argument --adamw"),
    (["--exogym-diloco", "fixed"], "argument --exogym-diloco"),
    (["--engine-threads", "0"], "argument --engine-threads"),
    (["--data-order", "random"], "argument --data-order"),
])
def test_bad_input_is_refused(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        exogym_compare.parse_args(argv)
    assert exit_.value.code == 2 and names in capsys.readouterr().err


def test_the_engine_side_runs_and_is_measured(tmp_path, capsys):
    out = tmp_path / "runs.json"
    assert exogym_compare.main(["--frameworks", "engine", "--nodes", "2", "--steps", "4", "--warmup", "1",
                                "--seeds", "0", "--methods", "diloco,demo", "--sync-every", "2",
                                "--engine-threads", "2", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    # the timed runs, then one memory run per method: only the memory runs are sampled
    assert [(r["framework"], r["method"], r["purpose"]) for r in records] == [
        ("engine", "diloco", "time"), ("engine", "demo", "time"), ("engine", "diloco", "memory"),
        ("engine", "demo", "memory")]
    for r in records:
        assert r["steps"] == 4 and r["step_s"] > 0 and r["cpu_step_s"] > 0
        assert (r["peak_pss_mib"] > 0) if r["purpose"] == "memory" else (r["peak_pss_mib"] is None)
        assert 0 <= r["accuracy"] <= 1
        assert r["threads"] == 2 and r["exogym_diloco"] == "matched" and r["data_order"] == "exogym"
    # the same seed trains the same model whether or not it is watched
    assert records[0]["accuracy"] == records[2]["accuracy"] and records[1]["accuracy"] == records[3]["accuracy"]
    assert "peak PSS MiB" in capsys.readouterr().out


def test_no_memory_runs_only_the_timed_ones(tmp_path):
    out = tmp_path / "runs.json"
    assert exogym_compare.main(["--frameworks", "engine", "--nodes", "2", "--steps", "3", "--warmup", "1",
                                "--seeds", "0,1", "--methods", "diloco", "--sync-every", "2",
                                "--engine-threads", "1", "--no-memory", "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["seed"], r["purpose"], r["peak_pss_mib"]) for r in records] == [(0, "time", None), (1, "time", None)]


def test_matched_diloco_takes_each_outer_step_on_its_own_pseudo_gradient():
    """EXO Gym's DiLoCoCommunicator aliases rank 0's parameters with the master model's
    after a synchronisation, so the next pseudo-gradient is zero; the matched one copies."""
    pytest.importorskip("exogym")
    import torch
    from exogym.strategy.diloco import DiLoCoCommunicator

    for cls, aliased in ((DiLoCoCommunicator, True), (exogym_compare.MatchedDiLoCoCommunicator, False)):
        model = torch.nn.Linear(3, 2)
        comm = cls(H=2)
        comm._init_node(model, 0, 2)
        comm._synchronize_master_model(model)
        with torch.no_grad():
            model.weight.add_(1.0)  # an inner step on rank 0
        comm._set_master_grad(model)
        assert (comm.master_model.weight.grad.abs().max().item() == 0) is aliased


def test_matched_diloco_synchronises_after_steps_h_2h_and_the_last():
    pytest.importorskip("exogym")
    steps = []
    comm = exogym_compare.MatchedDiLoCoCommunicator.__new__(exogym_compare.MatchedDiLoCoCommunicator)
    comm.H = 50
    # its parent's communicate with num_nodes 1 does nothing; record the step it is given
    base = exogym_compare.MatchedDiLoCoCommunicator.__mro__[2]
    original = base.communicate
    try:
        base.communicate = lambda self, model, rank, num_nodes, local_step: steps.append(local_step)
        for local_step in range(300):  # EXO Gym's count from 0, before its increment
            comm.communicate(None, 0, 8, local_step)
    finally:
        base.communicate = original
    assert [s for s in steps if s % 50 == 0 and s > 0] == [50, 100, 150, 200, 250, 300]


def test_exogym_batches_are_what_each_node_s_dataloader_reads():
    """--data-order exogym: row r of each batch is node r's next batch in EXO Gym
    (DistributedSampler, shuffled at its seed 0, epoch 0; the last batch short)."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    dataset = TensorDataset(torch.arange(100))
    mine = list(exogym_compare.exogym_batches(100, 4, 8))
    assert [tuple(b.shape) for b in mine] == [(4, 8)] * 3 + [(4, 1)]
    for rank in range(4):
        loader = DataLoader(dataset, batch_size=8,
                            sampler=DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=True))
        assert [b[rank].tolist() for b in mine] == [x.tolist() for (x,) in loader]


def test_the_memory_sampler_keeps_to_a_twentieth_of_a_core():
    """Sampling PSS every 0.1 s took a third of a core from EXO Gym's timed run (a sample
    of its nine processes costs about 55 CPU ms): the sampler waits 20 times a sample's
    cost, and never less than 0.1 s."""
    for cost in (0.0, 0.001, 0.005, 0.055, 0.3):
        wait = exogym_compare._sample_wait(cost)
        assert wait >= 0.1 and cost / (cost + wait) <= 1 / 21 + 1e-12
    assert exogym_compare._sample_wait(0.055) == pytest.approx(1.1)


def test_the_engine_gets_the_cores_exogyms_nodes_share_by_default():
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert exogym_compare.parse_args([]).engine_threads == cores
