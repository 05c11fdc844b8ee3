"""benchmarks/reproduce.py: the list, one experiment at a reduced size, bad input refused."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest

from bagua_algos.experiments import reproduce
from bagua_algos.experiments.protocol import PROTOCOLS
from bagua_algos.experiments.reproduce_train import Setting, iid_batches


def test_list_names_every_experiment_and_what_is_not_reproducible(capsys):
    assert reproduce.main(["list"]) == 0
    out = capsys.readouterr().out
    for experiment in reproduce.EXPERIMENTS:
        assert experiment.name in out
    assert "not reproducible here" in out and "WikiText-2" in out


@pytest.mark.parametrize("argv, names", [
    (["seed001-table99"], "argument experiment: unknown 'seed001-table99'"),
    (["seed001-table1", "--scale", "seed"], "argument --data-dir"),
    (["seed001-table1", "--scale", "seed", "--data-dir", "/nonexistent"], "argument --data-dir"),
    (["seed001-table1", "--seeds", "0"], "argument --seeds: expected an integer >= 1"),
    (["seed001-table1", "--scale", "big"], "argument --scale: invalid choice"),
    (["estimate", "--gpu-tflops", "0"], "argument --gpu-tflops: expected a positive number"),
])
def test_bad_input_is_refused_before_any_work(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        reproduce.parse_args(argv)
    assert exit_.value.code == 2
    assert names in capsys.readouterr().err


def test_seed_scale_without_data_is_allowed_where_no_data_is_needed():
    assert reproduce.parse_args(["seed001-table10", "--scale", "seed"]).scale == "seed"


def test_schedule_warms_up_from_the_one_worker_rate_and_decays():
    """PowerSGD's protocol at the seed's 300 epochs: from lr/workers over 5 epochs, /10 at 150 and 250."""
    s = Setting("mnist", "mlp", workers=4, batch=8, epochs=300, lr=0.4, protocol=PROTOCOLS["powersgd"])
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(2.5) == pytest.approx(0.25)
    assert s.lr_at(5) == s.lr_at(149.9) == pytest.approx(0.4)
    assert s.lr_at(150) == pytest.approx(0.04) and s.lr_at(299) == pytest.approx(0.004)
    scaled = s.with_(epochs=30)  # the same schedule in proportion on a 30-epoch proxy
    assert scaled.lr_at(0.25) == pytest.approx(0.25) and scaled.lr_at(15) == pytest.approx(0.04)
    assert "protocol powersgd" in s.describe()


def test_iid_shares_deal_each_sample_at_most_once_per_epoch():
    batches = list(iid_batches(103, 4, 5, epoch=0, seed=0, device="cpu"))
    assert len(batches) == 5 and all(b.shape == (4, 5) for b in batches)  # 25 per worker, 5 full batches
    seen = [int(i) for b in batches for i in b.reshape(-1)]
    assert len(seen) == len(set(seen)) == 100
    assert not (batches[0] == next(iid_batches(103, 4, 5, epoch=1, seed=0, device="cpu"))).all()


def test_a_figure_runs_at_a_reduced_size(tmp_path, capsys):
    reproduce.main(["seed001-fig7", "--seeds", "1", "--epochs", "2", "--max-steps", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "seed's setting" in out and "differs:" in out and "94.4%" in out  # the seed's number beside ours
    with open(tmp_path / "seed001-fig7.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["Rank-4 w/ error feedback", "Rank-4 w/o error feedback"]
    assert all(0.0 <= float(r["test_accuracy_mean"]) <= 1.0 for r in rows)
    assert (tmp_path / "seed001-fig7.png").stat().st_size > 0


def test_the_codec_example_gives_the_seeds_header(tmp_path, capsys):
    reproduce.main(["seed004-fig1", "--out", str(tmp_path)])
    with open(tmp_path / "seed004-fig1.csv") as f:
        rows = {r["quantity"]: r for r in csv.DictReader(f)}
    assert rows["header: bits, tail, min, max"]["ours"] == "2, 1, -5, 7"
    assert rows["payload, nearest rounding"]["ours"].startswith("[35, 104]")


def test_relaysum_table2_sets_the_papers_numbers_beside_the_workers_models(tmp_path, capsys):
    """At a reduced size (4 workers, 1 epoch of 2 steps, no grid extension): both halves
    of the paper's table (without momentum, with it), every row at every α, each half
    under its own protocol, each row over its tuning script's grid, the paper's worst
    worker and rate beside ours, all-reduce once on the IID split, RelaySum/Model with
    the paper's world_size normalization and SGP with two gossip steps."""
    reproduce.main(["relaysum-table2", "--seeds", "1", "--epochs", "1", "--max-steps", "2", "--workers", "4",
                    "--lr-extend", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "paper: worst worker" in out and "53.9%" in out and "63.3%" in out  # D-PSGD, and with QGM, at 0.01
    assert "protocol relaysum_no_momentum" in out and "protocol relaysum:" in out
    assert "0.01 (IID)" in out and "(at edge)" in out and "lr: paper | ours" in out
    with open(tmp_path / "relaysum-table2.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * sum(len(half) for half in reproduce.RELAYSUM_TABLE2.values())
    for half, protocol in reproduce.RELAYSUM_HALVES.items():
        mine = [r for r in rows if r["half"] == half]
        assert {r["method"] for r in mine} == {m for m, _ in reproduce.RELAYSUM_TABLE2[half].values()}
        for r in mine:
            grid = reproduce.published.RELAYSUM_GRIDS[half][r["row"]][1][float(r["alpha"])]
            assert float(r["lr"]) in grid and r["lr_grid"] == " ".join(f"{g:g}" for g in grid) and not r["lr_extended"]
            assert r["protocol"] == " ".join(protocol)
            assert r["lr_at_edge"] == str(float(r["lr"]) in (grid[0], grid[-1]))
        reference = [r for r in mine if r["row"] == "allreduce_average"]
        assert len({r["worst_worker_mean"] for r in reference}) == 1 and reference[0]["split"].startswith("iid")
    assert {r["spec"] for r in rows if r["row"] == "relay_chain"} == {"relay:topology=chain,mode=world_size"}
    assert {r["spec"] for r in rows if r["row"] == "sgp"} == {"sgp:topology=one_peer_exponential,push_sum_avg_steps=2"}
    for r in rows:  # the tail mean of one recorded epoch is that epoch's worst worker
        assert 0.0 <= float(r["worst_worker_mean"]) <= float(r["workers_mean_accuracy"]) <= 1.0
    assert (tmp_path / "relaysum-table2.png").stat().st_size > 0


def test_diloco_h_trades_bytes_for_accuracy_at_a_reduced_size(tmp_path, capsys):
    reproduce.main(["diloco-h", "--seeds", "1", "--epochs", "1", "--max-steps", "2", "--workers", "2",
                    "--out", str(tmp_path)])
    with open(tmp_path / "diloco-h.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    sync = float(rows["synchronous (gradient allreduce)"]["bytes_per_step"])
    assert [float(rows[f"DiLoCo H={h}"]["bytes_per_step"]) * h for h in reproduce.DILOCO_H] == [sync] * 4
    assert all(0.0 <= float(r["test_accuracy_mean"]) <= 1.0 for r in rows.values())
    # every row tuned its rate (compare's bracketing): the chosen rate and whether it is still at an edge
    assert all(r["lr_at_edge"] in ("True", "False") and float(r["lr"]) > 0 for r in rows.values())


def test_lowcomm_frontier_puts_the_methods_at_equal_measured_bytes(tmp_path, capsys, monkeypatch):
    """At a reduced size (2 workers, 1 epoch of 2 steps, 1 seed): both tasks, every method
    at each budget beside the baseline, with the bytes each one measured on gloo workers.
    The text task validates on its first 20 validation windows in chunks of 8 (two whole
    chunks and a remainder): its 44 evaluations over all ~700 windows were 4/5 of the
    test's time, and what is asserted of them (a loss, an accuracy in [0, 1]) is the same."""
    from bagua_algos.experiments import lowcomm_frontier, text

    full = text.load_text

    def shortened(*args, **kwargs):
        data = full(*args, **kwargs)
        return replace(data, test_x=data.test_x[:20], test_y=data.test_y[:20])

    monkeypatch.setattr(text, "load_text", shortened)
    monkeypatch.setattr(text, "EVAL_CHUNK", 8)

    reproduce.main(["lowcomm-frontier", "--seeds", "1", "--epochs", "1", "--max-steps", "2", "--workers", "2",
                    "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "SparseLoCo" in out and "DiLoCo" in out and "budget 1/20" in out
    # each task's header: the rates each row tunes over (no default rate), what each task reports
    assert "peak lr" not in out and out.count("lr: tuned per row on seed 0 over") == 2
    assert "reports: the workers' own models' test accuracy" in out
    assert "reports: the workers' own models' validation loss" in out
    assert "workers' val next-char acc" in out and "workers' test acc" in out
    with open(tmp_path / "lowcomm-frontier.csv") as f:
        rows = list(csv.DictReader(f))
    budgets = [f"1/{k}" for k in lowcomm_frontier.BUDGETS]
    assert {r["task"] for r in rows} == set(lowcomm_frontier.TASKS)
    for task in lowcomm_frontier.TASKS:
        mine = [r for r in rows if r["task"] == task]
        assert [r["budget"] for r in mine] == ["own"] + [b for b in budgets for _ in range(5)]
        assert {r["algorithm"] for r in mine} == {"gradient_allreduce", "diloco", "sparseloco", "demo", "sparta"}
        allreduce = float(mine[0]["bytes_per_step"])
        for r in mine[1:]:  # measured, and near the budget (Streaming DiLoCo's H and DeMo's topk are integers)
            assert float(r["bytes_per_step"]) > 0
            assert 0.5 < float(r["bytes_vs_budget"]) < 2.0, r
            assert float(r["budget_bytes_per_step"]) == pytest.approx(allreduce / int(r["budget"].split("/")[1]))
        assert all(0.0 <= float(r["accuracy_mean"]) <= 1.0 for r in mine)
    assert all(float(r["loss_mean"]) > 0 for r in rows if r["task"] == "text")
