"""The Bagua contract on torch.distributed: hooks, buckets, gradient allreduce, errors."""

from __future__ import annotations

import copy

import pytest
import torch

import bagua_algos
from bagua_algos.runtime import comm
from bagua_algos.runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from bagua_algos.algorithms import GradientAllReduceAlgorithm

from bagua_algos.experiments.gloo_workers import run_workers


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model.register_buffer("scale", torch.ones(1))
    return model


def batch(step: int, rank: int, n: int, per_rank: int = 8):
    """Rows ``rank*per_rank ... (rank+1)*per_rank`` of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n * per_rank, 6, generator=g)
    y = torch.randint(0, 3, (n * per_rank,), generator=g)
    if rank < 0:
        return x, y
    return x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]


def train(model, optimizer, steps, rank, n, start=0, set_to_none=True):
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(start, start + steps):
        x, y = batch(step, rank, n)
        optimizer.zero_grad(set_to_none=set_to_none)
        loss_fn(model(x), y).backward()
        optimizer.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------- comm


def _comm_checks(rank, n):
    out = {}
    t = torch.full((5,), float(rank + 1))
    comm.allreduce_inplace(t, comm.ReduceOp.AVG)
    out["avg"] = t.tolist()
    t = torch.full((3,), rank + 1)
    comm.allreduce_inplace(t, comm.ReduceOp.MAX)
    out["max"] = t.tolist()
    send, recv = torch.full((2,), float(rank)), torch.zeros(2)
    comm.allreduce(send, recv, comm.ReduceOp.SUM)
    out["allreduce"] = (send.tolist(), recv.tolist())
    g = torch.zeros(2 * n)
    comm.allgather(torch.tensor([rank, 10.0 * rank]), g)
    out["allgather"] = g.tolist()
    rs = torch.zeros(2)
    comm.reduce_scatter(torch.arange(2.0 * n), rs, comm.ReduceOp.AVG)
    out["reduce_scatter"] = rs.tolist()
    b = torch.full((3,), float(rank))
    comm.broadcast(b, src=n - 1)
    out["broadcast"] = b.tolist()
    right, left = (rank + 1) % n, (rank - 1) % n
    got_left, got_right = torch.zeros(4), torch.zeros(4)
    comm.neighbor_exchange(
        [(right, torch.full((4,), float(rank))), (left, torch.full((4,), -float(rank)))],
        [(left, got_left), (right, got_right)],
    )
    out["neighbors"] = (got_left.tolist(), got_right.tolist())
    # the plugin's peers: a [W] long tensor, W = 1 in a job (-1: no peer, the pair skipped)
    peer = lambda r: torch.tensor([r])  # noqa: E731
    got_left, got_right, untouched = torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4)
    comm.neighbor_exchange(
        [(peer(right), torch.full((1, 4), float(rank))), (peer(left), torch.full((1, 4), -float(rank))),
         (peer(-1), torch.ones(1, 4))],
        [(peer(left), got_left), (peer(right), got_right), (peer(-1), untouched)],
    )
    out["tensor_peers"] = (got_left[0].tolist(), got_right[0].tolist(), untouched[0].tolist())
    if rank == 0:
        comm.send(torch.tensor([42.0]), dst=1)
        comm.send(torch.tensor([43.0]), dst=torch.tensor([1]))
    elif rank == 1:
        r, r2 = torch.zeros(1), torch.zeros(1)
        comm.recv(r, src=0)
        comm.recv(r2, src=torch.tensor([0]))
        out["recv"] = (r.item(), r2.item())
    group = comm.new_group([0, 1])
    if rank < 2:
        t = torch.tensor([float(rank + 1)])
        comm.allreduce_inplace(t, comm.ReduceOp.SUM, group=group)
        out["subgroup"] = t.item()
    comm.barrier()
    out["ids"] = (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_local_size())
    return out


def test_comm_collectives_on_four_workers():
    n = 4
    results = run_workers(_comm_checks, n)
    for rank, out in enumerate(results):
        assert out["avg"] == [2.5] * 5
        assert out["max"] == [4] * 3
        assert out["allreduce"] == ([float(rank)] * 2, [6.0] * 2)
        assert out["allgather"] == [v for r in range(n) for v in (r, 10.0 * r)]
        assert out["reduce_scatter"] == [2.0 * rank, 2.0 * rank + 1]
        assert out["broadcast"] == [3.0] * 3
        assert out["neighbors"] == ([float((rank - 1) % n)] * 4, [-float((rank + 1) % n)] * 4)
        assert out["tensor_peers"] == ([float((rank - 1) % n)] * 4, [-float((rank + 1) % n)] * 4, [0.0] * 4)
        assert out["ids"] == (rank, n, rank, n)
    assert results[1]["recv"] == (42.0, 43.0)
    assert results[0]["subgroup"] == results[1]["subgroup"] == 3.0


# ---------------------------------------------------------------- gradient allreduce


def _allreduce_vs_ddp(rank, n, bucket_size, do_flatten, set_to_none, hierarchical):
    from torch.nn.parallel import DistributedDataParallel

    bagua_model = small_model(seed=rank)  # different seeds: with_bagua must broadcast rank 0's
    opt = torch.optim.SGD(bagua_model.parameters(), lr=0.1, momentum=0.9)
    algorithm = GradientAllReduceAlgorithm(hierarchical=hierarchical)
    bagua_model.with_bagua([opt], algorithm, do_flatten=do_flatten, bucket_size=bucket_size)
    train(bagua_model, opt, 5, rank, n, set_to_none=set_to_none)

    ddp_inner = small_model(seed=0)
    ddp = DistributedDataParallel(ddp_inner)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    train(ddp, ddp_opt, 5, rank, n)
    views = all(b.check_flatten() for b in bagua_model.bagua_buckets) if do_flatten else None
    return flat(bagua_model), flat(ddp_inner), len(bagua_model.bagua_buckets), views, bagua_model.bagua_train_step_counter


@pytest.mark.parametrize(
    "bucket_size,do_flatten,set_to_none,hierarchical",
    [(10 * 1024 * 1024, True, True, False), (256, True, False, False), (256, False, True, False),
     (256, True, True, True)],
    ids=["one-bucket", "small-buckets", "no-flatten", "hierarchical-2x2"],
)
def test_gradient_allreduce_matches_ddp_and_single_process(bucket_size, do_flatten, set_to_none, hierarchical):
    n = 4
    env = {"LOCAL_WORLD_SIZE": "2"} if hierarchical else None  # two "nodes" of two workers
    results = run_workers(_allreduce_vs_ddp, n, bucket_size, do_flatten, set_to_none, hierarchical, env=env)
    reference = small_model(seed=0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    train(reference, opt, 5, rank=-1, n=n)  # one process, the concatenated batch
    for bagua_params, ddp_params, buckets, views, counter in results:
        torch.testing.assert_close(bagua_params, ddp_params, atol=1e-5, rtol=0)
        torch.testing.assert_close(bagua_params, flat(reference), atol=1e-5, rtol=0)
        assert counter == 5
        if bucket_size == 256:
            assert buckets > 1
        if do_flatten:
            assert views is True


# ------------------------------------------------------------- hooks, re-wrap, state


class RecordingImpl(AlgorithmImpl):
    def __init__(self, process_group, log, resets):
        super().__init__(process_group)
        self.log = log
        self.resets = resets

    def need_reset(self):
        return bool(self.resets) and self.resets.pop()

    def init_tensors(self, bagua_ddp):
        self.log.append(("init_tensors",))
        return super().init_tensors(bagua_ddp)

    def init_forward_pre_hook(self, bagua_ddp):
        return lambda inputs: self.log.append(("forward_pre", bagua_ddp.bagua_train_step_counter))

    def init_backward_hook(self, bagua_ddp):
        default = super().init_backward_hook(bagua_ddp)

        def hook(name, param):
            self.log.append(("backward", name))
            default(name, param)

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            self.log.append(("post_backward", bagua_ddp.bagua_train_step_counter))
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        return lambda optimizer: self.log.append(("post_step", bagua_ddp.bagua_train_step_counter))


class RecordingAlgorithm(Algorithm):
    def __init__(self):
        self.log = []
        self.resets = []

    def reify(self, process_group):
        return RecordingImpl(process_group, self.log, self.resets)


def _runtime_scenarios(rank, n):
    out = {}
    model = small_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algo = RecordingAlgorithm()
    model.with_bagua([opt], algo)
    train(model, opt, 2, rank, n)
    out["log"] = list(algo.log)
    algo.resets.append(True)
    algo.log.clear()
    train(model, opt, 1, rank, n, start=2)
    out["after_reset"] = list(algo.log)

    # no_sync: no hooks, gradients stay local.
    algo.log.clear()
    x, y = batch(0, rank, n)
    with model.no_sync():
        torch.nn.functional.cross_entropy(model(x), y).backward()
    out["no_sync_log"] = list(algo.log)
    out["no_sync_counter"] = model.bagua_train_step_counter

    # Re-wrap with gradient allreduce: the recording hooks are gone.
    model.with_bagua([opt], "gradient_allreduce")
    algo.log.clear()
    train(model, opt, 2, rank, n)
    out["rewrapped_log"] = list(algo.log)
    out["rewrapped_algorithm"] = type(model.bagua_algorithm).__name__
    out["rewrapped_params"] = flat(model)

    # State round trip: continue 3 steps, or save, restore into a new model, continue.
    model = small_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    train(model, opt, 2, rank, n)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "bagua": model.bagua_state_dict()})
    train(model, opt, 3, rank, n, start=2)
    resumed = small_model(seed=5)
    resumed_opt = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    resumed.with_bagua([resumed_opt], GradientAllReduceAlgorithm())
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    out["resumed_counter"] = resumed.bagua_train_step_counter
    train(resumed, resumed_opt, 3, rank, n, start=2)
    out["resume_equal"] = torch.equal(flat(model), flat(resumed))
    out["resume_views"] = all(b.check_flatten() for b in resumed.bagua_buckets)

    # Ignored parameters are neither broadcast nor communicated.
    ignored = small_model(seed=rank)
    ignored._bagua_params_and_buffers_to_ignore = ["2.bias"]
    opt = torch.optim.SGD(ignored.parameters(), lr=0.1)
    ignored.with_bagua([opt], GradientAllReduceAlgorithm())
    out["ignored_bias"] = ignored[2].bias.detach().clone()
    out["shared_weight"] = ignored[0].weight.detach().clone()

    # Optimizer state is broadcast from rank 0.
    model = small_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.full_like(p, float(rank))
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    out["momentum_broadcast"] = all(float(s["momentum_buffer"].abs().max()) == 0.0 for s in opt.state.values())
    return out


@pytest.fixture(scope="module")
def scenarios():
    """One 2-worker spawn runs every scenario of this section (a spawn costs seconds)."""
    return run_workers(_runtime_scenarios, 2)


def test_hooks_run_in_bagua_order(scenarios):
    names = [name for name, _ in small_model().named_parameters()]
    for out in scenarios:
        log = out["log"]
        assert log[0] == ("init_tensors",)
        for step in (1, 2):
            start = log.index(("forward_pre", step))
            backward = log[start + 1:start + 1 + len(names)]
            assert sorted(e[1] for e in backward) == sorted(names)
            assert all(e[0] == "backward" for e in backward)
            assert log[start + 1 + len(names)] == ("post_backward", step)
            assert log[start + 2 + len(names)] == ("post_step", step)
        assert len(log) == 1 + 2 * (len(names) + 3)


def test_need_reset_rebuilds_before_the_forward_hook(scenarios):
    for out in scenarios:
        assert out["after_reset"][0] == ("init_tensors",)
        assert out["after_reset"][1] == ("forward_pre", 3)


def test_no_sync_skips_the_algorithm_but_counts_the_step(scenarios):
    for out in scenarios:
        assert out["no_sync_log"] == []
        assert out["no_sync_counter"] == 4


def test_rewrap_replaces_the_hooks(scenarios):
    for out in scenarios:
        assert out["rewrapped_log"] == []
        assert out["rewrapped_algorithm"] == "GradientAllReduceAlgorithmImpl"
    torch.testing.assert_close(scenarios[0]["rewrapped_params"], scenarios[1]["rewrapped_params"])


def test_state_round_trip_resumes_bit_for_bit(scenarios):
    for out in scenarios:
        assert out["resumed_counter"] == 2
        assert out["resume_equal"] and out["resume_views"]


def test_ignored_parameters_are_neither_broadcast_nor_communicated(scenarios):
    assert not torch.equal(scenarios[0]["ignored_bias"], scenarios[1]["ignored_bias"])
    assert torch.equal(scenarios[0]["shared_weight"], scenarios[1]["shared_weight"])


def test_optimizer_state_is_broadcast_from_the_first_rank(scenarios):
    assert all(out["momentum_broadcast"] for out in scenarios)


# ------------------------------------------------------------------------ bad input


def _bad_input(rank, n):
    errors = {}
    model = small_model(seed=0)
    before = flat(model).clone()
    other = torch.optim.SGD(small_model(seed=1).parameters(), lr=0.1)
    for key, call in {
        "foreign_optimizer": lambda: model.with_bagua([other], GradientAllReduceAlgorithm()),
        "unknown_name": lambda: model.with_bagua([], "no_such_algorithm"),
        "not_algorithm": lambda: model.with_bagua([], 3),
        "not_member": lambda: model.with_bagua([], GradientAllReduceAlgorithm(), process_group=group),
    }.items():
        if key == "not_member":
            group = comm.new_group([0])
            if rank == 0:
                continue
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors[key] = str(exc)
    mixed = small_model(seed=0)
    mixed.extra = torch.nn.Parameter(torch.zeros(2, device="meta"))
    try:
        mixed.with_bagua([], GradientAllReduceAlgorithm())
    except ValueError as exc:
        errors["devices"] = str(exc)
    untouched = torch.equal(flat(model), before) and not hasattr(model, "bagua_ddp")
    # The module is still usable after the errors.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    train(model, opt, 1, rank, n)
    return errors, untouched, flat(model)


def test_bad_input_is_refused_and_module_stays_usable():
    results = run_workers(_bad_input, 2)
    for rank, (errors, untouched, _) in enumerate(results):
        assert "not a parameter of the module" in errors["foreign_optimizer"]
        assert "no_such_algorithm" in errors["unknown_name"] and "gradient_allreduce" in errors["unknown_name"]
        assert "algorithm must be" in errors["not_algorithm"]
        assert "one device" in errors["devices"] and "meta" in errors["devices"]
        if rank == 1:
            assert "does not contain this process" in errors["not_member"]
        assert untouched
    torch.testing.assert_close(results[0][2], results[1][2])


def test_with_bagua_before_process_group_is_a_clear_error():
    model = small_model()
    with pytest.raises(RuntimeError, match="init_process_group"):
        bagua_algos.with_bagua(model, [], GradientAllReduceAlgorithm())
    assert not hasattr(model, "bagua_ddp")


def test_registry_lists_names_and_refuses_duplicates():
    assert "gradient_allreduce" in GlobalAlgorithmRegistry.available_algorithms()
    assert isinstance(Algorithm.init("gradient_allreduce", average=False), GradientAllReduceAlgorithm)
    with pytest.raises(ValueError, match="already registered.*gradient_allreduce"):
        GlobalAlgorithmRegistry.register("gradient_allreduce", GradientAllReduceAlgorithm)
    with pytest.raises(ValueError, match="unknown algorithm 'nope'.*gradient_allreduce"):
        GlobalAlgorithmRegistry.get("nope")


def test_buckets_close_at_their_cap_and_split_on_dtype():
    from bagua_algos.runtime.bucket import BaguaBucket, split_into_buckets

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 400, 10)]
    params.insert(3, torch.nn.Parameter(torch.zeros(5, dtype=torch.float64)))
    tensors = [p.ensure_bagua_tensor(f"p{i}", "m") for i, p in enumerate(params)]
    groups = split_into_buckets(tensors, bucket_size=1600, first_bucket_size=400)
    # The first bucket closes at 400 B (p0), the others at 1600 B (p4 fills one alone);
    # the float64 tensor starts a bucket of its own.
    assert [[t.bagua_tensor_name for t in g] for g in groups] == [["p0"], ["p1", "p2"], ["p3"], ["p4"], ["p5"]]
    for index, group in enumerate(groups):
        assert BaguaBucket(group, name=str(index), flatten=True).check_flatten()
    with pytest.raises(ValueError, match="bucket_size"):
        split_into_buckets(tensors, bucket_size=0)
