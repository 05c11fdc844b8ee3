"""The RelaySum paper's baselines (D², gradient tracking, D-PSGD with quasi-global
momentum, RelaySum/Grad, Stochastic Gradient Push, and RelaySum/Model under both of
its normalizations) against oracles written from each
paper's update rule: n copies of a model in one process, the rule's vectors kept
explicitly (Tang et al.'s x_{t−1} and g_{t−1}; Pu & Nedić's tracker y; Lin et al.'s m̂;
the delayed sum of every worker's update at its tree distance; push-sum's numerators
and weights), the ring's mixing matrix written out (1/3 on each worker and its two
neighbours). Then the same impl as gloo processes and on the one-process engine,
checkpoints, and the arguments and topologies each refuses. Last, D², quasi-global
momentum, RelaySum/Grad and SGP at 16 workers with Nesterov SGD and weight decay as the
local optimizer: oracle against engine, and 16 gloo processes against the engine."""

from __future__ import annotations


import pytest
import torch

import engine_cases
from bagua_algos.experiments.gloo_workers import run_workers

N, STEPS, LR = 4, 12, 0.05


def _flat(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def _set(model, vector) -> None:
    torch.nn.utils.vector_to_parameters(vector, model.parameters())


def _batches(steps=STEPS, n=N, alpha=engine_cases.ALPHA):
    """[n, BATCH] indices per step: each worker's share (as the engine draws them)."""
    from samplers import WorkerShares

    _, y = engine_cases.data()
    shares = WorkerShares(y, n, alpha, engine_cases.SEED)
    out, epoch = [], 0
    while len(out) < steps:
        out += list(shares.batches(epoch, engine_cases.BATCH))[:steps - len(out)]
        epoch += 1
    return out


def _gradients(models, index) -> torch.Tensor:
    """[n, d]: each copy's gradient on its own batch."""
    x, y = engine_cases.data()
    rows = []
    for i, model in enumerate(models):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[index[i]]), y[index[i]]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def _ring_matrix(n=N) -> torch.Tensor:
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in (i - 1, i, i + 1):
            w[i, j % n] = 1.0 / 3.0
    return w


def _mix(w, x):
    return (w @ x.double()).to(x.dtype)


def _oracle(rule, steps=STEPS):
    """[N, d] after ``steps`` steps of plain SGD (lr LR) under ``rule``."""
    models = [engine_cases.model() for _ in range(N)]
    x = torch.stack([_flat(m) for m in models])
    w = _ring_matrix()
    state = {}
    for t, index in enumerate(_batches(steps)):
        for model, row in zip(models, x):
            _set(model, row)
        g = _gradients(models, index)
        x = rule(t, x, g, w, state)
    return x


def _d2(t, x, g, w, state):
    """Tang et al.: x_1 = W(x_0 − γ g_0); x_{t+1} = W(2x_t − x_{t−1} − γ g_t + γ g_{t−1})."""
    if t == 0:
        new = _mix(w, x - LR * g)
    else:
        new = _mix(w, 2 * x - state["x"] - LR * g + LR * state["g"])
    state["x"], state["g"] = x, g
    return new


def _tracking(t, x, g, w, state):
    """Pu & Nedić: x_{t+1} = W(x_t − α y_t), y_{t+1} = W y_t + g_{t+1} − g_t, y_0 = g_0."""
    y = g if t == 0 else _mix(w, state["y"]) + g - state["g"]
    state["y"], state["g"] = y, g
    return _mix(w, x - LR * y)


def _quasi_global(beta):
    def rule(t, x, g, w, state):
        """Lin et al. Alg. 1: m = β m̂ + g; x½ = x − η m; x' = W x½; m̂ ← β m̂ + (1 − β)(x − x')/η."""
        m_hat = state.get("m_hat", torch.zeros_like(x))
        half = x - LR * (beta * m_hat + g)
        new = _mix(w, half)
        state["m_hat"] = beta * m_hat + (1 - beta) * (x - new) / LR
        return new

    return rule


def _chain_distance(i, j):
    return abs(i - j)


def _relaysum_grad(t, x, g, w, state):
    """x_i^{t+1} = x_i^t + (1/n) Σ_j u_j^{t − τ_ij}, u = −γ g, τ_ij = max(d(i,j) − 1, 0)
    on the chain (a neighbour's message of step t carries its update of step t, a worker
    two links away its update of step t − 1, …), an update not yet arrived zero."""
    history = state.setdefault("u", [])
    history.append(-LR * g)
    new = x.clone()
    for i in range(N):
        for j in range(N):
            s = t - max(_chain_distance(i, j) - 1, 0)
            if s >= 0:
                new[i] += history[s][j] / N
    return new


def _relaysum_model(mode):
    """Vogels et al.'s RelaySum/Model on the chain 0-1-…-(N−1), as epfml/relaysgd's
    RelayMechanism runs it: after the local step x½ = x − γ g, worker j sends i the
    message m_{j→i} = x½_j + Σ_{k ∈ N(j)∖i} m_{k→j} (last step's, none at t = 0) with the
    count c_{j→i} = 1 + Σ c_{k→j}; then n̄_i = 1 + Σ_j c_{j→i} and
    "world_size": x_i = (x½_i + Σ_j m_{j→i} + (N − n̄_i) x0) / N (x0 the initial model),
    "count":      x_i = (x½_i + Σ_j m_{j→i}) / n̄_i."""
    def neighbours(i):
        return [j for j in (i - 1, i + 1) if 0 <= j < N]

    def rule(t, x, g, w, state):
        x0 = state.setdefault("x0", x.clone())
        half = x - LR * g
        last = state.get("m", {})
        messages = {}
        for j in range(N):
            for i in neighbours(j):
                relayed = [last[(k, j)] for k in neighbours(j) if k != i and (k, j) in last]
                messages[(j, i)] = (half[j] + sum(m for m, _ in relayed), 1 + sum(c for _, c in relayed))
        state["m"] = messages
        new = torch.empty_like(x)
        for i in range(N):
            received = [messages[(j, i)] for j in neighbours(i)]
            total = half[i] + sum(m for m, _ in received)
            n_bar = 1 + sum(c for _, c in received)
            new[i] = (total + (N - n_bar) * x0[i]) / N if mode == "world_size" else total / n_bar
        return new

    return rule


def _push_sum(t, x, g, w, state):
    """Assran et al.: x½ = x − γ g(z); keep half of (x½, w), push half to i + 2^k
    (k = t mod log2 n); z = x / w. Here x is z, the parameters trained."""
    weight = state.get("w", torch.ones(N, 1))
    numerator = x * weight - LR * g
    hop = 2 ** (t % 2)  # n = 4: hops 1, 2
    src = [(i - hop) % N for i in range(N)]
    numerator = 0.5 * numerator + 0.5 * numerator[src]
    weight = 0.5 * weight + 0.5 * weight[src]
    state["w"] = weight
    return numerator / weight


def _push_sum_steps(k):
    """SGP with k gossip steps per optimizer step (the paper's push_sum_avg_steps): after
    the local step, k successive push-sum exchanges, the j-th with the hop of exchange
    k·t + j (n = 4: hops 1, 2, 1, 2, ...)."""
    def rule(t, x, g, w, state):
        weight = state.get("w", torch.ones(N, 1))
        numerator = x * weight - LR * g
        for j in range(k):
            hop = 2 ** ((k * t + j) % 2)
            src = [(i - hop) % N for i in range(N)]
            numerator = 0.5 * numerator + 0.5 * numerator[src]
            weight = 0.5 * weight + 0.5 * weight[src]
        state["w"] = weight
        return numerator / weight

    return rule


def _engine(name, kwargs, momentum=0.0, steps=STEPS):
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine

    x, y = engine_cases.data()
    net = engine_cases.model()
    engine = Engine(net, N, Algorithm.init(name, **kwargs),
                    lambda params: torch.optim.SGD(params, lr=LR, momentum=momentum))
    for index in _batches(steps):
        engine.step(x[index], y[index], torch.nn.functional.cross_entropy)
    names = [n for n, _ in net.named_parameters()]
    return torch.stack([torch.cat([engine.model.worker_state(i)[n].reshape(-1) for n in names]) for i in range(N)])


ORACLES = [
    ("d2_ring", "d2", {"topology": "ring"}, 0.0, _d2),
    ("gradient_tracking_ring", "gradient_tracking", {"topology": "ring"}, 0.0, _tracking),
    ("quasi_global_momentum_ring", "decentralized",
     {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True}, 0.9, _quasi_global(0.9)),
    ("relaysum_grad_chain", "relaysum_grad", {"topology": "chain"}, 0.0, _relaysum_grad),
    ("sgp_one_peer_exponential", "sgp", {}, 0.0, _push_sum),
    ("relaysum_model_chain_world_size", "relay", {"topology": "chain", "mode": "world_size"}, 0.0,
     _relaysum_model("world_size")),
    ("relaysum_model_chain_count", "relay", {"topology": "chain"}, 0.0, _relaysum_model("count")),
]


@pytest.mark.parametrize("label,name,kwargs,momentum,rule", ORACLES, ids=[o[0] for o in ORACLES])
def test_the_engine_follows_the_papers_rule(label, name, kwargs, momentum, rule):
    expected = _oracle(rule)
    got = _engine(name, kwargs, momentum)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 2e-5 * scale, label
    assert (got - got.mean(0)).abs().max() > 1e-4 * scale  # the workers' models differ (non-IID shares)


def test_d2_is_not_d_psgd_and_tracking_is_not_either():
    """The corrections matter: D² and gradient tracking leave the plain gossip's path."""
    def gossip(t, x, g, w, state):
        return _mix(w, x - LR * g)

    plain = _oracle(gossip)
    for rule in (_d2, _tracking):
        assert (_oracle(rule) - plain).abs().max() > 1e-4


CASES = [
    ("d2_ring", "d2", {"topology": "ring"}),
    ("gradient_tracking_ring", "gradient_tracking", {"topology": "ring"}),
    ("gradient_tracking_one_peer", "gradient_tracking", {"topology": "one_peer_exponential"}),
    ("qgm_ring", "decentralized", {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True}),
    ("qgm_one_peer", "decentralized",
     {"hierarchical": False, "topology": "one_peer_exponential", "quasi_global_momentum": True}),
    ("relaysum_grad_chain", "relaysum_grad", {"topology": "chain"}),
    ("relaysum_grad_dbt_drops", "relaysum_grad", {"topology": "double_binary_tree", "drop_rate": 0.2, "seed": 4}),
    ("sgp", "sgp", {}),
    ("sgp_ring", "sgp", {"topology": "ring"}),
    ("sgp_two_avg_steps", "sgp", {"push_sum_avg_steps": 2}),
]


@pytest.fixture(scope="module")
def per_rank():
    return run_workers(engine_cases.per_rank, N, CASES, timeout=180)


@pytest.mark.parametrize("label,name,kwargs", CASES, ids=[c[0] for c in CASES])
def test_every_engine_worker_equals_its_process(per_rank, label, name, kwargs):
    """SGD with momentum and weight decay (engine_cases), α = 0.1 shares, 4 workers."""
    expected = torch.stack([per_rank[rank][label] for rank in range(N)])
    got = engine_cases.stacked(N, name, kwargs)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), label


def _resume_worker(rank, world, name, kwargs):
    same, saved = engine_cases.checkpoint_resume(rank, world, name, kwargs, "0")
    return same, sorted(saved)


RESUME = [
    ("d2", {}, ["d2_correction", "exchanges"]),
    ("gradient_tracking", {"topology": "one_peer_exponential"}, ["exchanges", "tracking_correction"]),
    ("decentralized", {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True},
     ["exchanges", "quasi_global_momentum"]),
    ("sgp", {}, ["exchanges"]),
]


@pytest.mark.parametrize("name,kwargs,keys", RESUME, ids=[r[0] for r in RESUME])
def test_a_checkpoint_resumes_exactly(name, kwargs, keys):
    for same, saved in run_workers(_resume_worker, 3, name, kwargs, timeout=90):
        assert same
        assert saved == keys


def test_bad_arguments_and_topologies_are_refused_by_name():
    from bagua_algos.algorithms import (D2Algorithm, DecentralizedAlgorithm, GradientTrackingAlgorithm,
                                        RelaySumGradAlgorithm, SGPAlgorithm)

    with pytest.raises(ValueError, match="unknown topology 'torus'"):
        D2Algorithm(topology="torus")
    with pytest.raises(ValueError, match="RelaySGD needs a tree"):
        RelaySumGradAlgorithm(topology="ring")
    with pytest.raises(ValueError, match="drop_rate"):
        RelaySumGradAlgorithm(drop_rate=1.0)
    with pytest.raises(TypeError, match="quasi_global_momentum must be True or False"):
        DecentralizedAlgorithm(topology="ring", hierarchical=False, quasi_global_momentum="yes")
    with pytest.raises(ValueError, match="quasi_global_momentum=True gossips every step over a topology"):
        DecentralizedAlgorithm(quasi_global_momentum=True)
    with pytest.raises(ValueError, match="communication_interval=1"):
        DecentralizedAlgorithm(topology="ring", hierarchical=False, quasi_global_momentum=True,
                               communication_interval=2)
    with pytest.raises(TypeError, match="topology must be a Topology"):
        GradientTrackingAlgorithm(topology=3)
    SGPAlgorithm(topology="ring")  # a fixed topology gossips with its Metropolis–Hastings weights


@pytest.mark.parametrize("name,kwargs,match", [
    ("d2", {"topology": "one_peer_exponential"}, "changes its peers every exchange"),
    ("decentralized", {"hierarchical": False, "topology": "one_peer_exponential"}, "changes its peers every exchange"),
])
def test_a_fixed_matrix_algorithm_refuses_the_time_varying_graph(name, kwargs, match):
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine

    with pytest.raises(ValueError, match=match):
        Engine(engine_cases.model(), N, Algorithm.init(name, **kwargs), engine_cases.optimizer)


@pytest.mark.parametrize("make,match", [
    (lambda p: torch.optim.SGD(p, lr=0.1), "needs SGD momentum > 0"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening 0"),
    (lambda p: torch.optim.Adam(p, lr=0.1), "replaces torch.optim.SGD's momentum buffer; the optimizer is Adam"),
])
def test_quasi_global_momentum_names_the_optimizer_it_needs(make, match):
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine

    x, y = engine_cases.data()
    engine = Engine(engine_cases.model(), N, Algorithm.init(
        "decentralized", hierarchical=False, topology="ring", quasi_global_momentum=True), make)
    with pytest.raises((TypeError, ValueError), match=match):
        engine.step(x[:32].view(N, 8, 12), y[:32].view(N, 8), torch.nn.functional.cross_entropy)


def test_bytes_per_step_follow_the_topology():
    """A ring worker sends its model to 2 neighbours, gradient tracking twice the model,
    SGP to one peer, RelaySum/Grad on a chain to at most 2 (the ends to 1)."""
    from bagua_algos import Algorithm
    from bagua_algos.engine import Engine
    from bagua_algos.runtime.comm import counter

    x, y = engine_cases.data()
    d = sum(p.numel() for p in engine_cases.model().parameters())
    sent = {}
    for label, name, kwargs in [("d2", "d2", {}), ("tracking", "gradient_tracking", {}), ("sgp", "sgp", {}),
                                ("grad", "relaysum_grad", {})]:
        engine = Engine(engine_cases.model(), N, Algorithm.init(name, **kwargs), engine_cases.optimizer)
        before = counter.bytes_sent()
        engine.step(x[:32].view(N, 8, 12), y[:32].view(N, 8), torch.nn.functional.cross_entropy)
        sent[label] = counter.bytes_sent() - before
    assert sent["d2"] == 2 * 4 * d
    assert sent["tracking"] == 2 * sent["d2"]
    assert sent["sgp"] == 4 * d
    assert 4 * d * 3 // 2 <= sent["grad"] <= 2 * 4 * d + 64  # messages, plus the counts (float64 each)


# ---------------------------------------------------- 16 workers, Nesterov SGD locally
# The four baselines at the RelaySum paper's 16 workers, each worker's local optimizer
# torch.optim.SGD(lr η, momentum β = 0.9, nesterov=True, dampening 0, weight decay 1e-4),
# Nesterov as epfml/relaysgd's base optimizer always is. The oracles write that step out,
#     g = ∇f_i(x_i) + λ x_i;  buf ← β buf + g;  x½ = x − η (g + β buf),
# then apply each paper's communication rule; engine_cases.STEPS steps on rank i's
# share, as the engine and the gloo processes (engine_cases.per_rank) read them.
# Oracle and engine compare in float64 (they agree to 1e-15 of the weights): in float32
# the quasi-global case's step 10 has a worker whose second-layer pre-activation is
# 9e-9 in exact arithmetic, under float32's resolution, so rounding decides its ReLU and
# the engine leaves the exact path by 1e-4 (its float32 rows stay bit-equal to the
# processes'). The processes and the engine compare in float32, the processes' dtype. The
# shares are drawn at α = 0.3: engine_cases' 256 samples of 4 classes have no α = 0.1
# draw that gives each of 16 workers half its fair share (DirichletPartitionError);
# at 0.3 several workers still hold one class only.

N16, ALPHA16 = 16, 0.3
ETA, BETA, WD = engine_cases.LR, engine_cases.MOMENTUM, engine_cases.WEIGHT_DECAY
NESTEROV = {"nesterov": True, "dampening": 0}  # engine_cases' SGD settings, plus these


def _nesterov(x, g, buf):
    """torch SGD's Nesterov step written out: (x½, the new buffer); g has λ x in it."""
    buf = BETA * buf + g
    return x - ETA * (g + BETA * buf), buf


def _stacked_gradients(net):
    """(x [n, d], index [n, b]) → [n, d]: each row's gradient on its own batch, the
    loop of :func:`_gradients` as one torch.func.vmap over the rows (in float64 the
    same numbers bit for bit, in a fraction of the time)."""
    from torch.func import functional_call, grad, vmap

    shapes = {name: p.shape for name, p in net.named_parameters()}
    inputs, labels = engine_cases.data()
    inputs = inputs.to(next(net.parameters()).dtype)

    def loss(row, xb, yb):
        params, offset = {}, 0
        for name, shape in shapes.items():
            params[name] = row[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        return torch.nn.functional.cross_entropy(functional_call(net, params, (xb,)), yb)

    gradient = vmap(grad(loss))
    return lambda x, index: gradient(x, inputs[index], labels[index])


def _oracle16(rule, steps=engine_cases.STEPS):
    """[16, d] (float64) after ``steps`` steps of ``rule(t, x, g, state)``: g each
    worker's gradient at its parameters x plus λ x (torch SGD's weight_decay),
    ``state["buf"]`` its Nesterov buffer (zero at the start: β·0 + g is torch's first
    buffer, g)."""
    net = engine_cases.model().double()
    gradients = _stacked_gradients(net)
    x = _flat(net).repeat(N16, 1)
    state = {"buf": torch.zeros_like(x)}
    for t, index in enumerate(_batches(steps, N16, ALPHA16)):
        g = gradients(x, index) + WD * x
        x = rule(t, x, g, state)
    return x


def _d2_nesterov(t, x, g, state):
    """Tang et al.'s D² with the local step's update u_t = x½ − x_t in place of −γ g_t (as
    epfml/relaysgd runs D² over a base optimizer): x_1 = W(x_0 + u_0),
    x_{t+1} = W(2x_t − x_{t−1} + u_t − u_{t−1}); W the 16-ring's (1/3 on i − 1, i, i + 1)."""
    half, state["buf"] = _nesterov(x, g, state["buf"])
    u = half - x
    w = _ring_matrix(N16)
    new = _mix(w, half) if t == 0 else _mix(w, 2 * x - state["x"] + u - state["u"])
    state["x"], state["u"] = x, u
    return new


def _relaysum_grad_nesterov(t, x, g, state):
    """x_i^{t+1} = x_i^t + (1/n) Σ_j u_j^{t − τ_ij} over the 16-chain, u = x½ − x the
    Nesterov step's update, τ_ij = max(|i − j| − 1, 0), an update not yet arrived zero."""
    half, state["buf"] = _nesterov(x, g, state["buf"])
    history = state.setdefault("u", [])
    history.append(half - x)
    new = x.clone()
    for i in range(N16):
        for j in range(N16):
            s = t - max(_chain_distance(i, j) - 1, 0)
            if s >= 0:
                new[i] += history[s][j] / N16
    return new


def _quasi_global_nesterov(t, x, g, state):
    """Lin et al.'s Algorithm 1 with Nesterov's step (their QG-SGD code, nesterov=True):
    m = β m̂ + g; x½ = x − η (g + β m); x' = W x½; m̂ ← β m̂ + (1 − β)(x − x')/η. The
    worker's own buffer is not kept: m̂ replaces it every step."""
    m_hat = state.get("m_hat", torch.zeros_like(x))
    m = BETA * m_hat + g
    half = x - ETA * (g + BETA * m)
    new = _mix(_ring_matrix(N16), half)
    state["m_hat"] = BETA * m_hat + (1 - BETA) * (x - new) / ETA
    return new


def _push_sum_nesterov(t, x, g, state):
    """Assran et al.'s SGP with Nesterov momentum: the local step on the numerator, its
    gradient at z = numerator / weight (x here); keep half of (numerator, weight), push
    half to i + 2^k, k = t mod log2 16; return z."""
    weight = state.get("w", torch.ones(N16, 1, dtype=x.dtype))
    numerator = state.get("numerator", x * weight)
    half, state["buf"] = _nesterov(numerator, g, state["buf"])
    hop = 2 ** (t % 4)  # n = 16: hops 1, 2, 4, 8
    src = [(i - hop) % N16 for i in range(N16)]
    state["numerator"] = 0.5 * half + 0.5 * half[src]
    state["w"] = 0.5 * weight + 0.5 * weight[src]
    return state["numerator"] / state["w"]


NESTEROV16 = [
    ("d2_ring", "d2", {"topology": "ring", "optimizer": NESTEROV}, _d2_nesterov),
    ("qgm_ring", "decentralized",
     {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True, "optimizer": NESTEROV},
     _quasi_global_nesterov),
    ("relaysum_grad_chain", "relaysum_grad", {"topology": "chain", "optimizer": NESTEROV}, _relaysum_grad_nesterov),
    ("sgp_one_peer_exponential", "sgp", {"topology": "one_peer_exponential", "optimizer": NESTEROV},
     _push_sum_nesterov),
]


def _engine16(name, kwargs, dtype=torch.float32) -> torch.Tensor:
    """[16, d]: the engine's workers after engine_cases.STEPS steps."""
    return engine_cases.stacked(N16, name, kwargs, ALPHA16, dtype)


@pytest.mark.parametrize("label,name,kwargs,rule", NESTEROV16, ids=[c[0] for c in NESTEROV16])
def test_sixteen_nesterov_workers_follow_the_papers_rule(label, name, kwargs, rule):
    """The engine's 16 workers (float64) on the oracle's path to 1e-12; leaving out the
    weight decay moves them by 2e-4 of the weights, heavy-ball instead of Nesterov by 0.05 or more."""
    group = engine_cases.build_optimizer(name, kwargs, engine_cases.model().parameters()).param_groups[0]
    assert group["nesterov"] and group["weight_decay"] == WD  # the engine's optimizer is the oracle's
    expected = _oracle16(rule)
    got = _engine16(name, kwargs, torch.float64)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-12 * scale, label
    assert (got - got.mean(0)).abs().max() > 1e-4 * scale  # the workers' models differ (non-IID shares)


@pytest.fixture(scope="module")
def per_rank16():
    """The four cases in one group of 16 gloo processes, spawned once."""
    return run_workers(engine_cases.per_rank, N16, [case[:3] for case in NESTEROV16], ALPHA16, timeout=180)


@pytest.mark.parametrize("label,name,kwargs,rule", NESTEROV16, ids=[c[0] for c in NESTEROV16])
def test_sixteen_nesterov_processes_equal_the_engines_workers(per_rank16, label, name, kwargs, rule):
    """Every one of the 16 processes ends where the engine's worker of its rank does."""
    expected = torch.stack([per_rank16[rank][label] for rank in range(N16)])
    got = _engine16(name, kwargs)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), label


def test_sgp_with_two_avg_steps_is_two_successive_exchanges():
    """push_sum_avg_steps=2 on the engine follows two push-sum exchanges a step (hops
    2^(2t mod 2) = 1, then 2). On 4 workers hops 1 and 2 are the hypercube's two
    dimensions, so the two exchanges average exactly: every worker ends on the mean,
    off the one-exchange path."""
    assert torch.equal(_oracle(_push_sum_steps(1)), _oracle(_push_sum))
    expected = _oracle(_push_sum_steps(2))
    got = _engine("sgp", {"push_sum_avg_steps": 2})
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 2e-5 * scale
    assert (got - got.mean(0)).abs().max() <= 1e-6 * scale
    assert (got - _engine("sgp", {})).abs().max() > 1e-4 * scale


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_sgp_refuses_a_bad_number_of_avg_steps(steps):
    from bagua_algos.algorithms import SGPAlgorithm

    with pytest.raises(ValueError, match="push_sum_avg_steps must be an integer >= 1"):
        SGPAlgorithm(push_sum_avg_steps=steps)


def test_relaysum_models_two_normalizations_differ():
    """The first diameter − 1 steps (n̄_i < N) fill with x0 or divide by n̄_i: the two
    oracles part there and stay apart, so each engine test above tells them apart."""
    gap = (_oracle(_relaysum_model("world_size")) - _oracle(_relaysum_model("count"))).abs().max()
    assert gap > 1e-3 * _oracle(_relaysum_model("count")).abs().max()
