"""reproduce's rate tuning: the grid grows past an edge best until a worse rate brackets
it (sweeps.bracket_lr, used by every entry that tunes a rate), and the RelaySum paper's
per-row grids as data."""

from __future__ import annotations

import math

import pytest

from bagua_algos.experiments import reproduce
from bagua_algos.experiments.reproduce.sweeps import bracket_lr


def counting(score):
    """An ``evaluate`` over ``score(lr)`` that records every rate it is asked to train."""
    asked = []

    def evaluate(rates):
        asked.extend(rates)
        return {r: score(r) for r in rates}

    return evaluate, asked


def peak_at(peak):
    return lambda lr: -(math.log2(lr) - math.log2(peak)) ** 2


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_peak_k_doublings_above_the_grid_is_bracketed_after_k_plus_one_extensions(k):
    grid = (0.025, 0.05, 0.1)
    peak = 0.1 * 2 ** k
    evaluate, asked = counting(peak_at(peak))
    lr, scores, edge = bracket_lr(grid, evaluate, extend=3)
    assert lr == pytest.approx(peak) and not edge
    assert sorted(scores) == pytest.approx([0.025, 0.05] + [0.1 * 2 ** j for j in range(k + 2)])
    assert sorted(asked) == sorted(scores)  # each rate trained once
    # one extension fewer than needed leaves the peak at the edge, and says so
    if k:
        lr, _, edge = bracket_lr(grid, counting(peak_at(peak))[0], extend=k)
        assert lr == pytest.approx(peak) and edge


def test_an_interior_best_trains_nothing_more():
    evaluate, asked = counting(peak_at(0.05))
    lr, scores, edge = bracket_lr([0.1, 0.025, 0.05], evaluate, extend=3)
    assert (lr, edge) == (0.05, False) and sorted(asked) == [0.025, 0.05, 0.1]


def test_a_peak_below_the_grid_is_found_by_halving():
    evaluate, _ = counting(peak_at(0.0125 / 2))
    lr, scores, edge = bracket_lr((0.025, 0.05, 0.1), evaluate, extend=3)
    assert lr == pytest.approx(0.00625) and not edge
    assert sorted(scores)[:3] == pytest.approx([0.003125, 0.00625, 0.0125])


def test_a_monotone_score_stops_at_the_bound_and_is_marked_at_edge():
    evaluate, asked = counting(lambda lr: lr)
    lr, scores, edge = bracket_lr((0.1, 0.2, 0.4), evaluate, extend=3)
    assert edge and lr == pytest.approx(3.2) and sorted(scores) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])
    lr, scores, edge = bracket_lr((0.1, 0.2, 0.4), counting(lambda lr: lr)[0], extend=0)
    assert edge and lr == 0.4 and len(scores) == 3


def test_a_diverged_rate_counts_as_worst_and_brackets_the_best():
    """Above 0.3 the runs diverge (scored -inf, below any that trained): 0.4 is tried,
    diverges, and brackets 0.2."""
    evaluate, _ = counting(lambda lr: -math.inf if lr > 0.3 else lr)
    lr, scores, edge = bracket_lr((0.05, 0.1, 0.2), evaluate, extend=3)
    assert (lr, edge) == (0.2, False) and sorted(scores) == [0.05, 0.1, 0.2, 0.4]


def test_a_one_rate_grid_grows_both_ways():
    evaluate, asked = counting(peak_at(0.1))
    lr, scores, edge = bracket_lr([0.1], evaluate, extend=1)
    assert (lr, edge) == (0.1, False) and sorted(asked) == [0.05, 0.1, 0.2]


@pytest.mark.parametrize("grid, extend, names", [((), 3, "grid is empty"), ((0.1,), -1, "extend must be"),
                                                  ((0.1,), 1.5, "extend must be")])
def test_bad_arguments_are_named(grid, extend, names):
    with pytest.raises(ValueError, match=names):
        bracket_lr(grid, lambda rates: {r: 0.0 for r in rates}, extend)


def test_lr_extend_is_a_reproduce_argument_and_refuses_a_negative_count(capsys):
    assert reproduce.parse_args(["seed001-table1"]).lr_extend == 3
    assert reproduce.parse_args(["seed001-table1", "--lr-extend", "0"]).lr_extend == 0
    with pytest.raises(SystemExit):
        reproduce.parse_args(["seed001-table1", "--lr-extend", "-1"])
    assert "argument --lr-extend: expected an integer >= 0" in capsys.readouterr().err


def test_every_table2_row_has_its_scripts_grid_and_the_papers_rate_at_every_alpha():
    for half, rows in reproduce.RELAYSUM_TABLE2.items():
        assert set(reproduce.published.RELAYSUM_GRIDS[half]) == set(rows)
        assert set(reproduce.published.RELAYSUM_PAPER_LRS[half]) == set(rows)
        for label, (script, grids) in reproduce.published.RELAYSUM_GRIDS[half].items():
            assert set(grids) == set(reproduce.ALPHAS) and all(len(g) >= 2 for g in grids.values())
            assert all(list(g) == sorted(set(g)) for g in grids.values()), label
    grids = reproduce.published.RELAYSUM_GRIDS
    # RelaySum/Model's rates are RelaySum/Grad's times corr (5 on the chain, 3 on the trees), x0.5..x2 of 0.2
    assert grids["without momentum"]["relay_chain"][1][0.01] == (0.5, 1.0, 2.0)
    assert grids["without momentum"]["relay_double_binary_tree"][1][1.0] == (0.3, 0.6, 1.2)
    assert grids["without momentum"]["allreduce_average"][1][1.0][-1] == 1.6
    assert grids["with momentum"]["sgp"][1][0.01] == (0.025, 0.05, 0.1, 0.2, 0.4)


def test_seed002_sweeps_only_the_rates_its_grid_lacks_and_marks_the_edge(monkeypatch):
    """seed002's figures: the shared sweep's runs over the thesis's grid, then one sweep
    per rate added (for that row and α alone), until a worse rate brackets the best."""
    from types import SimpleNamespace

    from bagua_algos.experiments.reproduce import seed002

    def run(lr, seed):  # the workers' mean accuracy rises with the rate up to 0.2, then falls
        return {"row": "relay_chain", "alpha": 0.1, "lr": lr, "seed": seed,
                "final_mean_worker_accuracy": 1.0 - abs(math.log2(lr / 0.2)) / 10}

    swept = []

    def fake_sweep(ctx, base, swept_rows, labels, prefix):
        rates = [float(g) for g in base[base.index("--lr-grid") + 1].split(",")]
        swept.append(rates)
        return [run(g, s) for g in rates for s in ctx.seeds]

    monkeypatch.setattr(seed002, "sweep_seeds", fake_sweep)
    monkeypatch.setattr(seed002, "sweep_argv", lambda ctx, labels, w, e, grid, protocol, alphas:
                        ["--lr-grid", ",".join(f"{g:g}" for g in grid)])
    ctx = SimpleNamespace(seeds=[0, 1], scale="proxy", args=SimpleNamespace(lr_extend=3))
    shared = [run(g, s) for g in reproduce.LR_GRID for s in ctx.seeds]
    tried, edge = seed002.bracketed(ctx, shared, "relay_chain", 0.1)
    assert swept == [[0.2], [0.4]] and not edge  # 0.1 was the top: 0.2 is better, 0.4 worse
    assert {r["lr"] for r in seed002.best_over_grid(tried, "relay_chain", 0.1)} == {0.2}
    ctx.args.lr_extend = 1
    swept.clear()
    assert seed002.bracketed(ctx, shared, "relay_chain", 0.1)[1] and swept == [[0.2]]  # one doubling: still the top
