"""The training protocols (bagua_algos/experiments/protocol.py): each named protocol's
rate against its paper's own formula (ported here from the paper's code, not from ours),
its optimizer, the reported quantity, a user's own schedule, and the sweep's flags."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bagua_algos.experiments.protocol import (PROTOCOLS, PaperNesterovSGD, Protocol, norm_parameter_names,
                                              protocol_named, tail_accuracy)


def relaysum_code_factor(epoch: float) -> float:
    """epfml/relaysgd algorithms.py learning_rate_schedule with the Table 2 config
    (num_lr_warmup_epochs 5, lr_schedule_milestones [(150, 0.1), (180, 0.1)]), world size > 1."""
    lr = 1.0 * min(epoch / 5, 1.0)
    for milestone, factor in [(150, 0.1), (180, 0.1)]:
        if epoch >= milestone:
            lr *= factor
        else:
            return lr
    return lr


def powersgd_code_lr(epoch: float, base: float, workers: int) -> float:
    """epfml/powersgd paper-code/train.py get_learning_rate: the one-worker rate scaled
    linearly to ``workers`` times it over 5 epochs, /10 at 150 and 250."""
    lr = base * (1.0 + (workers - 1.0) * min(epoch / 5, 1.0))
    for decay_epoch in [150, 250]:
        if epoch >= decay_epoch:
            lr /= 10.0
        else:
            return lr
    return lr


@pytest.mark.parametrize("epoch", [0.0, 0.4, 2.5, 4.99, 5.0, 100.0, 149.99, 150.0, 179.0, 180.0, 199.9])
def test_relaysum_rate_is_the_papers_formula(epoch):
    assert PROTOCOLS["relaysum"].lr_factor(epoch, 200, 16) == pytest.approx(relaysum_code_factor(epoch))
    assert PROTOCOLS["relaysum_no_momentum"].lr_factor(epoch, 200, 16) == pytest.approx(relaysum_code_factor(epoch))


@pytest.mark.parametrize("epoch", [0.0, 1.0, 2.5, 5.0, 149.0, 150.0, 250.0, 299.0])
def test_powersgd_rate_is_the_papers_formula(epoch):
    base, workers = 0.1, 16  # the seed's rate, tuned for one worker, peak 0.1 x 16
    ours = base * workers * PROTOCOLS["powersgd"].lr_factor(epoch, 300, workers)
    assert ours == pytest.approx(powersgd_code_lr(epoch, base, workers))


def test_a_named_schedule_scales_with_the_run_in_proportion():
    relaysum = PROTOCOLS["relaysum"]
    for epoch in (0.3, 0.75, 10.0, 22.5, 27.0, 29.9):  # 30 epochs: warm-up 0.75, x0.1 at 22.5 and 27
        assert relaysum.lr_factor(epoch, 30, 16) == pytest.approx(relaysum_code_factor(epoch * 200 / 30))
    assert relaysum.at_epochs(30).milestones == pytest.approx((22.5, 27.0))


def test_diloco_warms_up_then_decays_on_a_cosine_to_zero():
    p = PROTOCOLS["diloco"]  # warm-up 1 of 88 epochs: at 88 epochs, 1 epoch
    assert p.lr_factor(0.5, 88, 8) == pytest.approx(0.5)
    assert p.lr_factor(1.0, 88, 8) == pytest.approx(1.0)
    assert p.lr_factor(1 + 87 / 2, 88, 8) == pytest.approx(0.5)
    assert p.lr_factor(88, 88, 8) == pytest.approx(0.0, abs=1e-12)
    assert p.lr_factor(1 + 87 / 4, 88, 8) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))


def test_heavy_ball_is_constant():
    assert {PROTOCOLS["heavy_ball"].lr_factor(e, 30, 8) for e in (0, 1, 15, 29.9)} == {1.0}


def _net():
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def test_the_papers_keep_weight_decay_off_batch_norm_and_use_nesterov():
    net = _net()
    assert norm_parameter_names(net) == {"1.weight", "1.bias"}
    opt = PROTOCOLS["relaysum"].optimizer_for(net, 0.1)(net.parameters())
    assert isinstance(opt, torch.optim.SGD)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 1e-4 and plain["weight_decay"] == 0.0
    assert decayed["nesterov"] and decayed["momentum"] == 0.9 and decayed["dampening"] == 0.0
    assert {id(p) for p in plain["params"]} == {id(net[1].weight), id(net[1].bias)}
    heavy = PROTOCOLS["heavy_ball"].optimizer_for(net, 0.1)(net.parameters())
    assert len(heavy.param_groups) == 1 and not heavy.param_groups[0]["nesterov"]
    assert isinstance(PROTOCOLS["diloco"].optimizer_for(net, 1e-3)(net.parameters()), torch.optim.AdamW)


def test_powersgd_momentum_is_its_codes_g_plus_m():
    """epfml/powersgd paper-code/train.py, momentum type "nesterov": m = 0.9 m + g (m = g at
    the first step), then grad += m, then p -= lr * grad; weight decay added before."""
    torch.manual_seed(0)
    p = torch.randn(5, dtype=torch.float64, requires_grad=True)
    q = p.detach().clone()
    net = torch.nn.Linear(1, 1)
    assert isinstance(PROTOCOLS["powersgd"].optimizer_for(net, 0.05)(net.parameters()), PaperNesterovSGD)
    ours = PaperNesterovSGD([p], lr=0.05, momentum=0.9, weight_decay=1e-4)
    m = None
    for step in range(4):
        g = torch.randn(5, dtype=torch.float64)
        p.grad = g.clone()
        ours.step()
        g = g + 1e-4 * q
        m = g.clone() if m is None else 0.9 * m + g
        q = q - 0.05 * (g + m)
        assert torch.allclose(p.detach(), q, rtol=0, atol=1e-15)


def test_the_worst_worker_is_each_workers_tail_mean_then_the_minimum():
    # 200 epochs: the epochs after 195 (196..200) averaged per worker, then the minimum
    curve = [[0.0, 0.0]] * 195 + [[0.5, 0.9], [0.6, 0.9], [0.7, 0.1], [0.8, 0.1], [0.9, 0.5]]
    assert tail_accuracy(curve, 0.025) == pytest.approx(min(0.7, 0.5))
    assert tail_accuracy([[0.2, 0.4], [0.6, 0.3]], 0.025) == pytest.approx(0.3)  # short runs: the last epoch
    assert tail_accuracy([[0.2, 0.4], [0.6, 0.3]], 0.0) == pytest.approx(0.3)


@pytest.mark.parametrize("kwargs, argument", [
    ({"momentum": 1.0}, "momentum"), ({"schedule": "linear"}, "schedule"), ({"optimizer": "lamb"}, "optimizer"),
    ({"momentum": 0.0, "nesterov": True}, "nesterov"), ({"milestones": (5, 2)}, "milestones"),
    ({"quantity": "best"}, "quantity"), ({"decay_factor": 0}, "decay_factor"), ({"lr_at": 3}, "lr_at"),
])
def test_bad_knobs_are_refused_by_name(kwargs, argument):
    with pytest.raises(ValueError, match=f"Protocol {argument}="):
        Protocol(**kwargs)
    with pytest.raises(ValueError, match="valid: heavy_ball, relaysum"):
        protocol_named("relaysum2")


def test_a_users_own_schedule_drives_the_engine_run():
    """``Protocol(lr_at=...)``: the training loop sets that rate before every step."""
    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments import reproduce_train as rt

    calls = []

    def my_schedule(epoch, step):
        calls.append((epoch, step))
        return 0.01 * (epoch + 1) + 0.001 * step

    data = rt.load("digits", None, 0, "cpu")
    setting = rt.Setting("digits", "mlp", 2, 8, 2, lr=0.5, protocol=Protocol("mine", lr_at=my_schedule),
                         max_steps_per_epoch=3)
    run = rt.train(setting, data, config_by_label("allreduce_average"), seed=0)
    assert calls == [(e, s) for e in range(2) for s in range(3)]
    assert not run.diverged and "the user's lr_at" in setting.describe()


def test_the_sweep_records_its_protocol_and_refuses_to_resume_under_another(tmp_path, capsys):
    from bagua_algos.experiments.sweep import cli

    base = ["--workers", "2", "--epochs", "2", "--max-steps-per-epoch", "2", "--alphas", "1", "--configs",
            "allreduce_average", "--no-progress", "--jobs", "1", "--out-dir", str(tmp_path)]
    cli.main(base + ["--protocol", "relaysum", "--momentum", "0"])
    err = capsys.readouterr().err
    assert "protocol relaysum with momentum=0.0, nesterov=False: SGD without momentum" in err
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["settings"]["protocol"]["nesterov"] is False and report["headline"] == \
        "final_worst_worker_tail_accuracy"
    assert report["settings"]["protocol"]["milestones"] == [1.5, 1.8]  # 150, 180 of 200, at 2 epochs
    logged = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[0])["sweep_settings"]["protocol"]
    assert logged == report["settings"]["protocol"]
    with pytest.raises(SystemExit):
        cli.main(base + ["--protocol", "relaysum", "--resume"])
    err = capsys.readouterr().err
    assert "argument --resume" in err and "protocol" in err


@pytest.mark.parametrize("flags, named", [
    (["--momentum", "1.5"], "argument --momentum"),
    (["--milestones", "5,2"], "argument --milestones"),
    (["--protocol", "adam"], "argument --protocol: invalid choice"),
    (["--decay-factor", "0"], "argument --decay-factor"),
])
def test_the_sweep_refuses_a_bad_protocol_flag_by_name(flags, named, capsys):
    from bagua_algos.experiments.sweep import cli

    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--configs", "allreduce_average"] + flags)
    assert exit_.value.code == 2 and named in capsys.readouterr().err
