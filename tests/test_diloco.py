"""DiLoCo (bagua_algos/algorithms/diloco.py) against an oracle written from the paper's
update rule: n copies of a model in one process, the inner SGD on each, and at every
synchronisation θ_outer stepped by ``torch.optim.SGD(nesterov=True)`` on the averaged
pseudo-gradient Δ = θ_outer − mean_i θ_i, every copy restarting from θ_outer; and
Streaming DiLoCo's overlap (its Algorithm 2): Δ taken at the synchronisation step t, the
outer step and the merge θ_i ← α θ_i + (1 − α) θ_outer after step t + τ. Run on the
one-process engine and as gloo processes (the same impl), fragments included; with
outer_lr=1 and no momentum it is local SGD, ``allreduce_average(communication_interval=H)``
shifted by Bagua's offset; checkpoints resume exactly."""

from __future__ import annotations

import copy

import pytest
import torch

import engine_cases
from bagua_algos.experiments.gloo_workers import run_workers

N, STEPS = 4, 13  # 13: the run ends between synchronisations


def _oracle(sync_every, outer_lr, outer_momentum, nesterov, fragments, overlap=0, merge_alpha=None, steps=STEPS,
            fragment_pattern="strided"):
    """[N, d] parameters (registration order) after ``steps`` steps, from the rule alone.

    With ``overlap`` τ ≥ 1 (Streaming DiLoCo): at fragment p's synchronisation step t the
    averaged Δ is taken (and held: it travels during τ steps); after step t + τ the outer
    SGD steps on it and every copy becomes α θ_i + (1 − α) θ_outer, α = ``merge_alpha``
    (the paper's 0.5 when None). Fragments: layer j (bucket order) in fragment j mod F
    (``"strided"``), or consecutive runs of about equal size (``"sequential"``)."""
    alpha = 0.5 if merge_alpha is None else merge_alpha
    from bagua_algos.algorithms.diloco import fragment_groups, strided_fragment_groups
    from samplers import WorkerShares

    x, y = engine_cases.data()
    models = [engine_cases.model() for _ in range(N)]
    inner = [engine_cases.optimizer(m.parameters()) for m in models]
    names = [name for name, _ in models[0].named_parameters()]
    order = list(reversed(names))  # the runtime's bucket order
    sizes = [dict(models[0].named_parameters())[name].numel() for name in order]
    by_index = (strided_fragment_groups([name.rsplit(".", 1)[0] for name in order], fragments)
                if fragment_pattern == "strided" else fragment_groups(sizes, fragments))
    groups = [[order[i] for i in group] for group in by_index]
    outer = {name: p.detach().clone().requires_grad_() for name, p in models[0].named_parameters()}
    outer_opts = [torch.optim.SGD([outer[name] for name in group], lr=outer_lr, momentum=outer_momentum,
                                  nesterov=nesterov) for group in groups]
    shares = WorkerShares(y, N, engine_cases.ALPHA, engine_cases.SEED)
    held = {}  # fragment -> (the step its outer step lands at, {name: averaged Δ})

    def land(f):
        for name in groups[f]:
            outer[name].grad = held[f][1][name]
        outer_opts[f].step()
        with torch.no_grad():
            for model in models:
                params = dict(model.named_parameters())
                for name in groups[f]:
                    if overlap:
                        params[name].copy_(alpha * params[name] + (1 - alpha) * outer[name])
                    else:
                        params[name].copy_(outer[name])
        del held[f]

    step, epoch = 0, 0
    while step < steps:
        for index in shares.batches(epoch, engine_cases.BATCH):
            if step == steps:
                break
            step += 1
            for i, (model, opt) in enumerate(zip(models, inner)):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[index[i]]), y[index[i]]).backward()
                opt.step()
            for f in range(len(groups)):
                if f in held and held[f][0] == step:
                    land(f)
                shifted = step - f * (sync_every // len(groups))
                if shifted < 0 or shifted % sync_every:
                    continue
                with torch.no_grad():
                    deltas = {name: outer[name].detach()
                              - torch.stack([dict(m.named_parameters())[name] for m in models]).mean(0)
                              for name in groups[f]}
                held[f] = (step + overlap, deltas)
                if not overlap:
                    land(f)
        epoch += 1
    return torch.stack([torch.nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _engine(kwargs, steps=STEPS, still_first_step=False):
    """The engine's [N, d] parameters after ``steps`` steps of the registered ``diloco``
    (or another algorithm: ``kwargs["name"]``); ``still_first_step``: before them, one
    step at learning rate 0 (which changes nothing with plain SGD, but counts)."""
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine
    from samplers import WorkerShares

    kwargs = dict(kwargs)
    name = kwargs.pop("name", "diloco")
    x, y = engine_cases.data()
    net = engine_cases.model()
    engine = Engine(net, N, Algorithm.init(name, **kwargs), engine_cases.optimizer)
    shares = WorkerShares(y, N, engine_cases.ALPHA, engine_cases.SEED)
    if still_first_step:
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.optimizer.param_groups[0]["lr"] = 0.0
        index = next(iter(shares.batches(0, engine_cases.BATCH)))
        engine.step(x[index], y[index], torch.nn.functional.cross_entropy)
        engine.optimizer.param_groups[0]["lr"] = lr
    epoch, done = 0, 0
    while done < steps:
        for index in shares.batches(epoch, engine_cases.BATCH):
            if done == steps:
                break
            engine.step(x[index], y[index], torch.nn.functional.cross_entropy)
            done += 1
        epoch += 1
    names = [name for name, _ in net.named_parameters()]
    return torch.stack([torch.cat([engine.model.worker_state(i)[n].reshape(-1) for n in names]) for i in range(N)])


SETTINGS = [
    ("paper", {"sync_every": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": 1}),
    ("no_nesterov", {"sync_every": 4, "outer_lr": 0.5, "outer_momentum": 0.8, "nesterov": False, "fragments": 1}),
    ("streaming", {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": 2}),
    ("three_fragments", {"sync_every": 3, "outer_lr": 0.9, "outer_momentum": 0.5, "nesterov": True,
                         "fragments": 3}),
    # the sequential cut (consecutive runs of about equal size) instead of the strided default
    ("streaming_sequential", {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                              "fragments": 2, "fragment_pattern": "sequential"}),
    # Streaming DiLoCo's overlap: one fragment τ = 2 steps in flight, the paper's α = 0.5
    ("overlap", {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "fragments": 1,
                 "overlap": 2}),
    # fragments staggered by 3 steps, each landing 2 later, merged at α = 0.25
    ("streaming_overlap", {"sync_every": 6, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                           "fragments": 2, "overlap": 2, "merge_alpha": 0.25}),
]


@pytest.mark.parametrize("label,kwargs", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_the_engine_follows_the_papers_rule(label, kwargs):
    expected = _oracle(**kwargs)
    got = _engine(kwargs)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-5 * scale, label
    assert (got - got[0]).abs().max() > 0  # the copies drift between synchronisations (STEPS % H != 0)


def test_outer_lr_one_without_momentum_is_local_sgd_shifted_by_bagua_s_offset():
    """allreduce_average(communication_interval=H) averages after steps 1, H + 1, …;
    DiLoCo(outer_lr=1, μ=0) after H, 2H, …: with a first step that changes nothing (its
    learning rate 0, plain SGD), allreduce_average's steps 2 … T + 1 are DiLoCo's 1 … T."""
    plain = {"lr": 0.05}

    def sgd(params):
        return torch.optim.SGD(params, **plain)

    original = engine_cases.optimizer
    engine_cases.optimizer = sgd
    try:
        diloco = _engine({"sync_every": 3, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False}, steps=9)
        local = _engine({"name": "allreduce_average", "communication_interval": 3}, steps=9, still_first_step=True)
    finally:
        engine_cases.optimizer = original
    assert (diloco - local).abs().max() <= 1e-6 * local.abs().max()


def _processes(rank, world, cases):
    return engine_cases.per_rank(rank, world, cases)


CASES = [(label, "diloco", kwargs) for label, kwargs in SETTINGS[:3] + SETTINGS[4:]] + [
    ("fp16", "diloco", {"sync_every": 3, "compression": "fp16"}),
    ("bf16", "diloco", {"sync_every": 3, "compression": "bf16"}),
    ("minmax8", "diloco", {"sync_every": 3, "compression": "minmax8"}),
    # in flight as fp16 (the mean lands in the working dtype when waited for), and 8-bit
    ("fp16_overlap", "diloco", {"sync_every": 3, "compression": "fp16", "overlap": 2}),
    ("minmax8_overlap", "diloco", {"sync_every": 4, "fragments": 2, "compression": "minmax8", "overlap": 1}),
]


@pytest.fixture(scope="module")
def per_rank():
    return run_workers(_processes, N, CASES, timeout=120)


# An fp16 allreduce adds in fp16 on the wire (gloo's ring rounds each partial sum to
# fp16), the stacked one sums the fp16 rows in float32 and rounds once: the averaged Δ
# differs by a few fp16 ulps of Δ (2^-11 relative; bf16: 2^-8), which the outer steps carry.
RTOL = {"fp16": 1e-3, "bf16": 1e-2, "fp16_overlap": 1e-3}


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_every_engine_worker_equals_its_process(per_rank, label, name, kwargs):
    expected = torch.stack([per_rank[rank][label] for rank in range(N)])
    got = engine_cases.stacked(N, name, kwargs)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= RTOL.get(label, 1e-5) * scale, label


def test_compression_changes_the_pseudo_gradient_and_counts_fewer_bytes():
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine

    exact = engine_cases.stacked(N, "diloco", {"sync_every": 3})
    scale = exact.abs().max()
    off = {compression: float((engine_cases.stacked(N, "diloco", {"sync_every": 3, "compression": compression})
                               - exact).abs().max()) for compression in ("fp16", "bf16", "minmax8", "minmax4")}
    assert 0 < off["fp16"] < off["minmax8"] < off["minmax4"] < 0.1 * scale, off  # coarser codes stray further
    assert 0 < off["bf16"] < 0.05 * scale, off
    net = engine_cases.model()
    d = sum(p.numel() for p in net.parameters())
    counts = {}
    for compression in (None, "fp16", "minmax8", "minmax4"):
        engine = Engine(engine_cases.model(), N, Algorithm.init("diloco", sync_every=1, compression=compression),
                        engine_cases.optimizer)
        x, y = engine_cases.data()
        engine.step(x[:32].view(N, 8, 12), y[:32].view(N, 8), torch.nn.functional.cross_entropy)
        counts[compression] = engine.impl.bytes_total
    assert counts[None] == 4 * d and counts["fp16"] == 2 * d
    assert counts["minmax4"] < counts["minmax8"] < counts["fp16"]


def _resume_worker(rank, world, kwargs):
    """(equal after resuming, the first fragment's saved keys, the saved step its outer
    step is due at, 0 without overlap): engine_cases.checkpoint_resume."""
    same, saved = engine_cases.checkpoint_resume(rank, world, "diloco", kwargs, "fragment0")
    return same, sorted(saved), saved.get("diloco_due", 0)


def test_a_checkpoint_resumes_exactly():
    for same, keys, _ in run_workers(_resume_worker, 2, {"sync_every": 3, "fragments": 2}, timeout=90):
        assert same
        assert keys == ["diloco_momentum", "diloco_outer", "diloco_outer_steps"]


def test_a_checkpoint_between_an_overlapped_sync_and_its_merge_resumes_exactly():
    """Synchronised after step 3, merged after step 5: the checkpoint after step 4 holds
    the averaged Δ in flight and the step it lands at."""
    for same, keys, due in run_workers(_resume_worker, 2, {"sync_every": 3, "overlap": 2}, timeout=90):
        assert same
        assert keys == ["diloco_due", "diloco_momentum", "diloco_outer", "diloco_outer_steps", "diloco_pending"]
        assert due == 5


@pytest.mark.parametrize("kwargs,match", [
    ({"sync_every": 0}, "sync_every"),
    ({"outer_lr": 0}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
    ({"fragments": 0}, "fragments"),
    ({"sync_every": 2, "fragments": 3}, "fragments=3"),
    ({"compression": "int3"}, "compression"),
    ({"overlap": -1}, "overlap"),
    ({"sync_every": 4, "overlap": 4}, "overlap must be .* < ⌊sync_every/fragments⌋ = 4"),
    ({"sync_every": 8, "fragments": 4, "overlap": 2}, "overlap must be .* = 2"),
    ({"overlap": 1.5}, "overlap"),
    ({"merge_alpha": 0.5}, "merge_alpha=0.5 .* needs overlap >= 1"),
    ({"overlap": 1, "merge_alpha": 1.5}, "merge_alpha must be a number in \\[0, 1\\]"),
    ({"fragments": 2, "fragment_pattern": "interleaved"}, "fragment_pattern must be one of \\['strided', 'sequential'\\]"),
    ({"fragments": 2, "fragment_pattern": None}, "fragment_pattern must be one of"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
    from bagua_algos.algorithms import DiLoCoAlgorithm

    with pytest.raises(ValueError, match=match):
        DiLoCoAlgorithm(**kwargs)


def test_overlap_defaults_to_the_papers_mixing_factor():
    from bagua_algos.algorithms import DiLoCoAlgorithm

    assert DiLoCoAlgorithm(sync_every=10, overlap=3).merge_alpha == 0.5
    assert DiLoCoAlgorithm(sync_every=10).merge_alpha == 0.0  # τ = 0: every worker takes θ_outer


def _resume_without_overlap_worker(rank, world):
    """A checkpoint taken with a fragment in flight (overlap=2: synchronised after step
    3, due after step 5) loaded by a run with overlap=0: its outer step still lands after
    step 5, and the worker takes θ_outer (the merge of plain DiLoCo)."""
    from bagua_algos.algorithms import DiLoCoAlgorithm

    x, y = engine_cases.data()
    xs, ys = x[rank::world][:48].view(6, 8, 12), y[rank::world][:48].view(6, 8)

    def wrapped(**kwargs):
        net = engine_cases.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        return net.with_bagua([opt], DiLoCoAlgorithm(sync_every=3, **kwargs)), opt

    def step(net, opt, k):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xs[k]), ys[k]).backward()
        opt.step()

    net, opt = wrapped(overlap=2)
    for k in range(4):
        step(net, opt, k)
    checkpoint = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "bagua": net.bagua_state_dict()})
    resumed, resumed_opt = wrapped()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    bucket = resumed.bagua_buckets[0]
    before = bucket.state["diloco_outer_steps"]
    step(resumed, resumed_opt, 4)
    return before, bucket.state["diloco_outer_steps"], torch.equal(bucket.flat_view(), bucket.state["diloco_outer"])


def test_an_overlapped_checkpoint_resumed_without_overlap_takes_its_outer_step():
    for before, after, takes_outer in run_workers(_resume_without_overlap_worker, 2, timeout=90):
        assert (before, after) == (0, 1)
        assert takes_outer


def test_strided_fragments_deal_the_layers_round_robin():
    """Streaming DiLoCo's strided pattern: layer j (bucket order) in fragment j mod F, a
    layer's tensors together; F capped at the number of layers; the sequential cut kept."""
    from bagua_algos.algorithms.diloco import fragment_groups, layer_of, strided_fragment_groups

    names = ["4.bias", "4.weight", "2.bias", "2.weight", "0.bias", "0.weight"]
    layers = [layer_of(n) for n in names]
    assert layers == ["4", "4", "2", "2", "0", "0"]
    assert strided_fragment_groups(layers, 2) == [[0, 1, 4, 5], [2, 3]]
    assert strided_fragment_groups(layers, 3) == [[0, 1], [2, 3], [4, 5]]
    assert strided_fragment_groups(layers, 5) == [[0, 1], [2, 3], [4, 5]]  # three layers: three fragments
    assert strided_fragment_groups(["a", "b", "c", "d", "e"], 2) == [[0, 2, 4], [1, 3]]
    assert layer_of("blocks.3.attn.weight") == "blocks.3.attn" and layer_of("scale") == "scale"
    # the sequential cut of the same sizes differs (consecutive runs)
    assert fragment_groups([4, 64, 16, 384, 24, 288], 2) == [[0, 1, 2, 3], [4, 5]]


def test_streaming_defaults_to_the_strided_pattern_on_the_engine():
    from bagua_algos import Algorithm
    from bagua_algos.algorithms import DiLoCoAlgorithm
    from bagua_algos.engine import Engine

    assert DiLoCoAlgorithm(sync_every=4, fragments=2).fragment_pattern == "strided"
    buckets = {}
    for pattern in ("strided", "sequential"):
        engine = Engine(engine_cases.model(), 2, Algorithm.init("diloco", sync_every=4, fragments=2,
                                                                fragment_pattern=pattern), engine_cases.optimizer)
        buckets[pattern] = [[t.bagua_tensor_name for t in b.tensors] for b in engine.runtime.bagua_buckets]
    assert buckets["strided"] == [["4.bias", "4.weight", "0.bias", "0.weight"], ["2.bias", "2.weight"]]
    assert buckets["sequential"] != buckets["strided"]
