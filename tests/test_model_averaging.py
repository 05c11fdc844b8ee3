"""allreduce_average, decentralized (D-PSGD) and relay (RelaySGD) on gloo workers."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from bagua_algos.algorithms import (
    AllreduceAverageAlgorithm,
    DecentralizedAlgorithm,
    RelayAlgorithm,
    shift_one_peer,
)
from bagua_algos.algorithms.relay import coordinate_ranges
from bagua_algos.arguments import rank_seed
from topologies import ChainTopology, get_topology

from bagua_algos.experiments.gloo_workers import run_workers

DIM = 11  # odd, so the double binary tree's halves differ in size


class Vector(torch.nn.Module):
    """One parameter vector x with the loss f_i(x) = ½‖x − b_i‖² (gradient x − b_i)."""

    def __init__(self, dim: int = DIM):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, target):
        return 0.5 * ((self.x - target) ** 2).sum()


def target(rank: int, dim: int = DIM) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(rank))


def wrapped(algorithm, lr: float, start=None, momentum: float = 0.0):
    model = Vector()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    model.with_bagua([opt], algorithm)
    if start is not None:
        with torch.no_grad():
            model.x.copy_(start)
    return model, opt


def sgd_steps(model, opt, rank, steps, record=None):
    for _ in range(steps):
        opt.zero_grad()
        model(target(rank)).backward()
        opt.step()
        if record is not None:
            record.append(model.x.detach().clone())


# ------------------------------------------------------------------- simulator


def simulate_relay(topology, steps, lr, mode="count", drop_rate=0.0, seed=0, dim=DIM):
    """Single-process RelaySum: every worker's x after each step, on f_i = ½‖x − b_i‖²."""
    n = topology.world_size
    trees = topology.trees
    parts = coordinate_ranges(dim, len(trees))
    x = [torch.zeros(dim) for _ in range(n)]
    x0 = torch.zeros(dim)
    # heard[k][i][j]: (message, count) worker i got from j over tree k last step
    heard = [[{j: (torch.zeros(e - s), 0.0) for j in tree.neighbors(i)} for i in range(n)]
             for tree, (s, e) in zip(trees, parts)]
    gens = [torch.Generator().manual_seed(rank_seed(seed, i)) for i in range(n)]  # the one per-rank rule
    history = [[] for _ in range(n)]
    for _ in range(steps):
        half = [x[i] - lr * (x[i] - target(i)) for i in range(n)]
        new_heard = [[{} for _ in range(n)] for _ in trees]
        for k, (tree, (s, e)) in enumerate(zip(trees, parts)):
            for i in range(n):
                for j in tree.neighbors(i):
                    message = half[i][s:e].clone()
                    count = 1.0
                    for other, (m, c) in heard[k][i].items():
                        if other != j:
                            message += m
                            count += c
                    new_heard[k][j][i] = (message, count)
        if drop_rate:
            for i in range(n):
                for k, tree in enumerate(trees):
                    for j in tree.neighbors(i):
                        if torch.rand((), generator=gens[i]).item() < drop_rate:
                            m, _ = new_heard[k][i][j]
                            new_heard[k][i][j] = (torch.zeros_like(m), 0.0)
        heard = new_heard
        for i in range(n):
            out = torch.empty(dim)
            for k, (s, e) in enumerate(parts):
                total = half[i][s:e].clone()
                n_bar = 1.0
                for m, c in heard[k][i].values():
                    total += m
                    n_bar += c
                if mode == "count":
                    out[s:e] = total / n_bar
                else:
                    out[s:e] = (total + (n - n_bar) * x0[s:e]) / n
            x[i] = out
            history[i].append(out.clone())
    return history


# --------------------------------------------------------------- relay on 8 workers

RELAY_CONFIGS = [
    ("chain", "count", 0.0),
    ("binary_tree", "count", 0.0),
    ("double_binary_tree", "count", 0.0),
    ("double_binary_tree", "world_size", 0.0),
    ("binary_tree", "count", 0.3),
]


def _relay_checks(rank, n):
    out = {}
    for name in ("chain", "binary_tree", "double_binary_tree"):
        diameter = get_topology(name, n).diameter()
        # Identical models and no learning: everything stays exactly one.
        model, opt = wrapped(RelayAlgorithm(topology=name), lr=0.0, start=torch.ones(DIM))
        counts = []
        for _ in range(diameter + 2):
            sgd_steps(model, opt, rank, 1)
            counts.append(list(model.bagua_algorithm.last_counts))
        out[(name, "ones")] = bool(torch.all(model.x == 1.0))
        out[(name, "counts")] = counts
        out[(name, "diameter")] = diameter
        # Different models, no learning: one common model.
        model, opt = wrapped(RelayAlgorithm(topology=name), lr=0.0, start=torch.full((DIM,), float(rank)))
        sgd_steps(model, opt, rank, 60)
        out[(name, "consensus")] = model.x.detach().clone()
    for name, mode, drop in RELAY_CONFIGS:
        model, opt = wrapped(RelayAlgorithm(topology=name, mode=mode, drop_rate=drop, seed=3), lr=0.1)
        record = []
        sgd_steps(model, opt, rank, 12, record)
        out[(name, mode, drop)] = torch.stack(record)
    # A stopped and resumed run continues exactly (double tree, with drops).
    algo = RelayAlgorithm(topology="double_binary_tree", drop_rate=0.2, seed=1)
    model, opt = wrapped(algo, lr=0.1, momentum=0.9)
    sgd_steps(model, opt, rank, 4)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "bagua": model.bagua_state_dict()})
    untouched = copy.deepcopy(checkpoint)  # (a loaded optimizer state shares the checkpoint's tensors)
    sgd_steps(model, opt, rank, 5)
    resumed, resumed_opt = wrapped(algo, lr=0.1, momentum=0.9)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    sgd_steps(resumed, resumed_opt, rank, 5)
    out["resume"] = torch.equal(model.x, resumed.x)
    # A job's checkpoint written in the form before every state had a row dimension
    # ("k/j" count keys, floats, one generator state) loads to the same run.
    resumed, resumed_opt = wrapped(algo, lr=0.1, momentum=0.9)
    resumed.load_state_dict(untouched["model"])
    resumed_opt.load_state_dict(untouched["opt"])
    resumed.load_bagua_state_dict(_old_job_form(untouched["bagua"]))
    sgd_steps(resumed, resumed_opt, rank, 5)
    out["resume_old_form"] = torch.equal(model.x, resumed.x)
    # Its per-bucket state is in bucket.state: the live buffers, saved with no relay code.
    bagua = checkpoint["bagua"]
    out["state_keys"] = (sorted(bagua["algorithm_state"]), {b: sorted(st) for b, st in bagua["bucket_state"].items()})
    impl, buckets = model.bagua_algorithm, model.bagua_ddp.bagua_buckets
    # relay_step builds the next messages from bucket.state["relay_received"] itself: a
    # [1, neighbours, L] tensor per tree, this rank's slot per tree neighbour
    out["state_is_live"] = all(
        bucket.state["relay_received"][k].shape[:2] == (1, len(impl.trees[k].neighbors(rank)))
        for bucket in buckets for k in range(len(impl.trees))
    )
    # Mode "world_size" resumes too, x0 included: the resumed module is wrapped from
    # another model (so its own x0 differs) before the checkpoint is loaded.
    algo = RelayAlgorithm(topology="chain", mode="world_size", seed=2)
    model, opt = wrapped(algo, lr=0.1)
    sgd_steps(model, opt, rank, 2)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "bagua": model.bagua_state_dict()})
    sgd_steps(model, opt, rank, 3)
    resumed = Vector()
    with torch.no_grad():
        resumed.x.fill_(5.0)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed.with_bagua([resumed_opt], algo)
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    sgd_steps(resumed, resumed_opt, rank, 3)
    out["resume_world_size"] = torch.equal(model.x, resumed.x)
    resumed = Vector()  # ... and from the old job form, x0 a 1-D [L] then
    with torch.no_grad():
        resumed.x.fill_(5.0)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1)
    resumed.with_bagua([resumed_opt], algo)
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_bagua_state_dict(_old_job_form(checkpoint["bagua"]))
    sgd_steps(resumed, resumed_opt, rank, 3)
    out["resume_world_size_old_form"] = torch.equal(model.x, resumed.x)
    return out


def _old_job_form(bagua: dict) -> dict:
    """A relay checkpoint of one rank as a job wrote it before the one [W, ...] shape."""
    old = copy.deepcopy(bagua)
    state = old["algorithm_state"]
    counts = {}
    for key, value in state["received_counts"].items():  # "k/i/j" → "k/j"
        k, _, j = key.split("/")
        counts[f"{k}/{j}"] = value
    state["received_counts"] = counts
    state["last_counts"] = [c[0] for c in state["last_counts"]]
    state["generator"] = state["generator"][0]
    for bucket_state in old["bucket_state"].values():
        if "relay_x0" in bucket_state:
            bucket_state["relay_x0"] = bucket_state["relay_x0"][0]
    return old


@pytest.fixture(scope="module")
def relay_results():
    return run_workers(_relay_checks, 8, timeout=240)


def test_relay_keeps_identical_models_exactly(relay_results):
    for out in relay_results:
        for name in ("chain", "binary_tree", "double_binary_tree"):
            assert out[(name, "ones")], name


def test_relay_counts_reach_world_size_after_diameter_steps(relay_results):
    n = len(relay_results)
    for out in relay_results:
        for name in ("chain", "binary_tree", "double_binary_tree"):
            counts, diameter = out[(name, "counts")], out[(name, "diameter")]
            assert all(c == n for c in counts[diameter - 1]), (name, counts)
            assert all(c <= n for step in counts for c in step)
    # Someone has not heard from everyone one step earlier (the tree is not a star).
    assert any(min(out[("chain", "counts")][out[("chain", "diameter")] - 2]) < n for out in relay_results)


def test_relay_without_learning_reaches_one_common_model(relay_results):
    for name in ("chain", "binary_tree", "double_binary_tree"):
        models = torch.stack([out[(name, "consensus")] for out in relay_results])
        initial_spread = len(relay_results) - 1  # worker r starts at x = r
        # Per coordinate: on the double tree each half has its own consensus value.
        spread = models.max(dim=0).values - models.min(dim=0).values
        assert float(spread.max()) < 1e-3 * initial_spread, name
        # Not the exact mean in "count" mode: during the first diameter steps a central
        # rank averages over more models than a leaf does.
        assert 0.0 < float(models.mean()) < initial_spread, name


@pytest.mark.parametrize("name,mode,drop", RELAY_CONFIGS)
def test_relay_matches_single_process_simulator(relay_results, name, mode, drop):
    n = len(relay_results)
    expected = simulate_relay(get_topology(name, n), steps=12, lr=0.1, mode=mode, drop_rate=drop, seed=3)
    for rank, out in enumerate(relay_results):
        torch.testing.assert_close(out[(name, mode, drop)], torch.stack(expected[rank]), atol=1e-5, rtol=1e-5)


def test_relay_resumes_exactly_from_checkpoint(relay_results):
    assert all(out["resume"] for out in relay_results)
    assert all(out["resume_world_size"] for out in relay_results)
    assert all(out["resume_old_form"] and out["resume_world_size_old_form"] for out in relay_results)


def test_relay_keeps_its_per_bucket_state_in_bucket_state(relay_results):
    for out in relay_results:
        algorithm_keys, bucket_keys = out["state_keys"]
        assert algorithm_keys == ["dropped", "generator", "last_counts", "received_counts", "step"]
        assert bucket_keys and all(keys == ["relay_received"] for keys in bucket_keys.values())
        assert out["state_is_live"]


# ---------------------------------------- allreduce_average and decentralized, 4 workers


def _averaging_checks(rank, n):
    out = {}
    start = torch.arange(DIM, dtype=torch.float32) * (rank + 1)
    for key, algo in {
        "allreduce_average": AllreduceAverageAlgorithm(),
        "all": DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="all"),
        "shift_one": DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"),
        "ring": DecentralizedAlgorithm(hierarchical=False, topology="ring"),
        "hierarchical_all": DecentralizedAlgorithm(hierarchical=True, peer_selection_mode="all"),
        "hierarchical_shift_one": DecentralizedAlgorithm(hierarchical=True, peer_selection_mode="shift_one"),
    }.items():
        model, opt = wrapped(algo, lr=0.0, start=start)
        record = []
        sgd_steps(model, opt, rank, 2, record)
        out[key] = record
    # D-PSGD applies the gradient at the old weights to the mixed ones.
    model, opt = wrapped(DecentralizedAlgorithm(hierarchical=False, topology="ring"), lr=0.1, start=start)
    sgd_steps(model, opt, rank, 1)
    out["dpsgd_step"] = model.x.detach().clone()
    # communication_interval=2 averages at steps 1, 3, 5, ... (Bagua's schedule); each
    # worker moves its model by +rank between steps, so a skipped average shows.
    for key, algo in {
        "interval": AllreduceAverageAlgorithm(communication_interval=2),
        "interval_dpsgd": DecentralizedAlgorithm(hierarchical=False, communication_interval=2),
    }.items():
        model, opt = wrapped(algo, lr=0.0, start=start)
        record = []
        for _ in range(3):
            sgd_steps(model, opt, rank, 1, record)
            with torch.no_grad():
                model.x.add_(rank)
        out[key] = record
    # shift_one resumes with the same peer schedule.
    algo = DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one")
    model, opt = wrapped(algo, lr=0.1, start=start)
    sgd_steps(model, opt, rank, 3)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "bagua": model.bagua_state_dict()})
    sgd_steps(model, opt, rank, 3)
    resumed, resumed_opt = wrapped(algo, lr=0.1)
    resumed.load_state_dict(checkpoint["model"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    sgd_steps(resumed, resumed_opt, rank, 3)
    out["resume"] = torch.equal(model.x, resumed.x)
    # Two training-mode forwards before one backward (a loss computed and dropped): two
    # exchanges a step, on every rank in the same order. (A first form of posting the
    # exchange from the training thread, one slot per op, left the second forward's
    # exchange unmatched here, and the job hung until gloo's timeout.)
    model, opt = wrapped(DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"), lr=0.1,
                         start=start)
    for _ in range(2):
        opt.zero_grad()
        model(target(rank))  # its loss dropped
        model(target(rank)).backward()
        opt.step()
    out["two_forwards"] = model.x.detach().clone()
    out.update(_posting_checks(rank, start))
    return out


def _posting_checks(rank, start):
    """Where a job's shift_one exchange is posted: the thread of every exchange, with
    one training forward a step, and with two whose first exchange is slow to finish;
    and what an error in posting does."""
    import threading

    from bagua_algos.runtime.gossip import Gossip

    out, threads, original = {}, [], Gossip.start_exchange_into
    slow_first = [False]

    def recorded(self, *args, **kwargs):
        threads.append("training" if threading.current_thread() is threading.main_thread() else "communication")
        handle, finish = original(self, *args, **kwargs)
        if slow_first[0]:  # the first exchange of the step still in flight at the second forward
            slow_first[0] = False
            wait = handle.wait
            handle.wait = lambda: (time.sleep(0.5), wait())[1]
        return handle, finish

    Gossip.start_exchange_into = recorded
    try:
        model, opt = wrapped(DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"), lr=0.0,
                             start=start)
        sgd_steps(model, opt, rank, 2)
        out["posted_threads"], threads[:] = list(threads), []
        out["posted_result"] = model.x.detach().clone()
        model, opt = wrapped(DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"), lr=0.1,
                             start=start)
        for _ in range(2):
            slow_first[0] = True
            opt.zero_grad()
            model(target(rank))
            model(target(rank)).backward()
            opt.step()
        out["two_forwards_threads"] = list(threads)
        out["two_forwards_slow"] = model.x.detach().clone()

        def failing(self, *args, **kwargs):
            raise RuntimeError("posting failed on purpose")

        Gossip.start_exchange_into = failing
        model, opt = wrapped(DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"), lr=0.0)
        try:
            sgd_steps(model, opt, rank, 1)
            out["posting_error"] = None
        except Exception as err:  # noqa: BLE001 - the test reads what was raised
            out["posting_error"] = f"{type(err).__name__}: {err}"
    finally:
        Gossip.start_exchange_into = original
    return out


@pytest.fixture(scope="module")
def averaging_results():
    return run_workers(_averaging_checks, 4, env={"LOCAL_WORLD_SIZE": "2"})


def _start(rank: int) -> torch.Tensor:
    return torch.arange(DIM, dtype=torch.float32) * (rank + 1)


def _expected_models(key: str, rank: int, n: int) -> list:
    """Worker ``rank``'s model after each of the first steps of _averaging_checks'
    configuration ``key`` (no learning: only the mixing moves the models)."""
    starts = [_start(r) for r in range(n)]
    mean = torch.stack(starts).mean(0)
    if key == "shift_one":
        # step 0 pairs 0↔2, 1↔3; step 1 pairs 0↔3, 1↔2.
        first = [(starts[r] + starts[shift_one_peer(r, n, 0)]) / 2 for r in range(n)]
        return [first[rank], (first[rank] + first[shift_one_peer(rank, n, 1)]) / 2]
    if key == "ring":
        ring = get_topology("ring", n).gossip_matrix()
        return [sum(ring[rank][j] * starts[j] for j in range(n))]
    if key in ("interval", "interval_dpsgd"):
        # step 1 averages; step 2 does not (the +rank stays); step 3 averages again.
        return [mean, mean + rank, mean + (n - 1)]
    return [mean]  # an exact average of all the models at once


@pytest.mark.parametrize("key", ["allreduce_average", "all", "shift_one", "ring", "hierarchical_all",
                                 "hierarchical_shift_one", "interval", "interval_dpsgd"])
def test_averaging_algorithms_mix_as_specified(averaging_results, key):
    n = len(averaging_results)
    for rank, out in enumerate(averaging_results):
        for step, want in enumerate(_expected_models(key, rank, n)):
            torch.testing.assert_close(out[key][step], want, msg=lambda m: f"{key}, rank {rank}, step {step}: {m}")


def test_dpsgd_applies_the_gradient_at_the_old_weights_to_the_mixed_ones(averaging_results):
    n = len(averaging_results)
    for rank, out in enumerate(averaging_results):
        mixed = _expected_models("ring", rank, n)[0]
        torch.testing.assert_close(out["dpsgd_step"], mixed - 0.1 * (_start(rank) - target(rank)))


def test_shift_one_resumes_with_the_same_peer_schedule(averaging_results):
    assert all(out["resume"] for out in averaging_results)


def test_two_training_forwards_before_a_backward_exchange_twice_in_step(averaging_results):
    """shift_one with a second training-mode forward a step: each forward is an exchange
    of the same weights (Bagua counts a step per training forward), the second's pairing
    one further on, and its average is what the copy-back writes before the step (the
    gradient at the weights both forwards read): no rank waits for an unmatched message."""
    n = len(averaging_results)
    x = [torch.arange(DIM, dtype=torch.float32) * (r + 1) for r in range(n)]
    count = 0
    for _ in range(2):
        mixed = [(x[r] + x[shift_one_peer(r, n, count + 1)]) / 2 for r in range(n)]
        x = [mixed[r] - 0.1 * (x[r] - target(r)) for r in range(n)]
        count += 2
    for rank, out in enumerate(averaging_results):
        assert torch.allclose(out["two_forwards"], x[rank], atol=1e-5), (rank, out["two_forwards"], x[rank])


def test_a_job_posts_shift_one_s_exchange_from_the_training_thread(averaging_results):
    """One training forward a step: the exchange is posted at the forward pre-hook, on
    the training thread, and the weights are those of the op's own exchange."""
    for out in averaging_results:
        assert out["posted_threads"] == ["training", "training"]
        assert torch.equal(out["posted_result"], out["shift_one"][-1])


def test_a_second_forward_while_the_first_exchange_runs_exchanges_on_the_communication_thread(
        averaging_results):
    """With the first exchange of a step still in flight at the second training forward,
    the second is not posted over it (it would receive into the same buffer): the op
    exchanges itself after the first, so every rank's exchanges keep their order and
    the result is the two-forward formula's."""
    for out in averaging_results:
        assert out["two_forwards_threads"] == ["training", "communication"] * 2
        torch.testing.assert_close(out["two_forwards_slow"], out["two_forwards"], rtol=0, atol=0)


def test_an_error_in_posting_is_raised_by_the_step(averaging_results):
    for out in averaging_results:
        assert out["posting_error"] is not None and "posting failed on purpose" in out["posting_error"]


def test_shift_one_pairing_follows_bagua_formula():
    assert [shift_one_peer(r, 4, 0) for r in range(4)] == [2, 3, 0, 1]
    assert [shift_one_peer(r, 4, 1) for r in range(4)] == [3, 2, 1, 0]
    for n in range(2, 21, 2):
        for step in range(2 * n):
            peers = [shift_one_peer(r, n, step) for r in range(n)]
            assert all(peers[peers[r]] == r and peers[r] != r for r in range(n))
            assert all((r < n // 2) != (peers[r] < n // 2) for r in range(n))
    with pytest.raises(ValueError, match="even"):
        shift_one_peer(0, 3, 0)


# ------------------------------------------------------------------------ bad input


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="peer_selection_mode.*'all', 'shift_one'"):
        DecentralizedAlgorithm(peer_selection_mode="random")
    with pytest.raises(ValueError, match="mode must be one of.*count"):
        RelayAlgorithm(mode="bogus")
    with pytest.raises(ValueError, match="unknown topology 'star'.*chain"):
        RelayAlgorithm(topology="star")
    with pytest.raises(ValueError, match="drop_rate"):
        RelayAlgorithm(drop_rate=1.0)
    with pytest.raises(ValueError, match="communication_interval"):
        AllreduceAverageAlgorithm(communication_interval=0)


def _bad_setups(rank, n):
    errors = {}
    for key, algo in {
        "size": RelayAlgorithm(topology=ChainTopology(n + 1)),
        "odd": DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"),
        "gossip_size": DecentralizedAlgorithm(hierarchical=False, topology=get_topology("ring", 2)),
    }.items():
        try:
            wrapped(algo, lr=0.1)
        except ValueError as exc:
            errors[key] = str(exc)
    model, opt = wrapped(RelayAlgorithm(topology="chain"), lr=0.1)  # still usable
    sgd_steps(model, opt, rank, 2)
    return errors


def test_bad_setups_are_refused_at_with_bagua():
    for errors in run_workers(_bad_setups, 3):
        assert "4 ranks but the process group has 3" in errors["size"]
        assert "even number of workers, got 3" in errors["odd"]
        assert "2 ranks but the process group has 3" in errors["gossip_size"]
