"""Every algorithm's rule for state that depends on the world size (WORLD_SIZE_RULE,
docs/elastic.md): a job saved at 3 workers resumes at 2 through
resume_from_checkpoint, each piece carried over or reset as the rule says, with one
warning per algorithm and process; and DistributedHeterogeneousSampler partitions
again for the new n by its seeded rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from bagua_algos.experiments.gloo_workers import run_workers


def _algorithms(params_for_qadam):
    from bagua_algos.algorithms import (AllreduceAverageAlgorithm, AsyncModelAverageAlgorithm, ByteGradAlgorithm,
                                        DecentralizedAlgorithm, DeMoAlgorithm, GradientAllReduceAlgorithm,
                                        LowPrecisionDecentralizedAlgorithm, PowerSGDAlgorithm, RelayAlgorithm,
                                        SparseLoCoAlgorithm, SpartaAlgorithm, TernGradAlgorithm)
    from bagua_algos.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    qadam_optimizer = QAdamOptimizer(params_for_qadam, lr=0.01, warmup_steps=2)
    return {
        "gradient_allreduce": lambda: GradientAllReduceAlgorithm(),
        "allreduce_average": lambda: AllreduceAverageAlgorithm(),
        "decentralized": lambda: DecentralizedAlgorithm(hierarchical=False),
        "low_precision_decentralized": lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False),
        "relay": lambda: RelayAlgorithm(topology="chain", mode="world_size"),
        "powersgd": lambda: PowerSGDAlgorithm(rank=1, orthogonalization="gram_schmidt"),
        "terngrad": lambda: TernGradAlgorithm(error_feedback=True, seed=3),
        "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
        "qadam": lambda: QAdamAlgorithm(qadam_optimizer, hierarchical=False),
        "async": lambda: AsyncModelAverageAlgorithm(sync_interval_ms=0),
        "sparseloco": lambda: SparseLoCoAlgorithm(sync_every=3, chunk=4, topk_density=0.25),
        "demo": lambda: DeMoAlgorithm(chunk=4, topk=2),
        "sparta": lambda: SpartaAlgorithm(fraction=0.2, sync_every=3),
    }, qadam_optimizer


NAMES = ["gradient_allreduce", "allreduce_average", "decentralized", "low_precision_decentralized", "relay",
         "powersgd", "terngrad", "bytegrad", "qadam", "async", "sparseloco", "demo", "sparta"]


def _build(name, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    factories, qadam_optimizer = _algorithms(model.parameters())
    optimizer = qadam_optimizer if name == "qadam" else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model.with_bagua([optimizer], factories[name]()), optimizer


def _train(model, optimizer, rank, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        optimizer.zero_grad()
        model(torch.randn(4, 6, generator=g)).square().mean().backward()
        optimizer.step()


def _save_at_three(rank, world_size, root):
    from bagua_algos.runtime.checkpoint import save_checkpoint

    for name in NAMES:
        model, optimizer = _build(name)
        _train(model, optimizer, rank, 4)
        save_checkpoint(4, f"{root}/{name}", model, optimizer)
        if name == "async":
            model.bagua_algorithm.abort(model)


def _resume_at_two(rank, world_size, root):
    from bagua_algos.arguments import rank_seed
    from bagua_algos.runtime.checkpoint import resume_from_checkpoint

    found = {}
    for name in NAMES:
        model, optimizer = _build(name, seed=1)  # another initial model: what is loaded must show
        saved = torch.load(f"{root}/{name}/iter_0000004/bagua_rank_00000_states.pt", weights_only=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iteration = resume_from_checkpoint(f"{root}/{name}", model, optimizer)
        impl, ddp = model.bagua_algorithm, model.bagua_ddp
        buckets = ddp.bagua_buckets
        checks = {
            "iteration": iteration,
            "warnings": [str(w.message) for w in caught if "world size" in str(w.message)],
            "rule": dict(impl.WORLD_SIZE_RULE),
            "model_is_first_rank's": all(torch.equal(v, saved["model"][k]) for k, v in model.state_dict().items()),
            "step_counter": ddp.bagua_train_step_counter == saved["bagua"]["bagua_train_step_counter"],
        }
        if name == "relay":
            checks["messages_zero"] = all(float(t.abs().sum()) == 0 for b in buckets
                                          for t in b.state["relay_received"].values())
            checks["counts_zero"] = all(float(heard.abs().sum()) == 0.0 for heard in impl._heard)
            checks["x0_carried"] = all(torch.equal(b.state["relay_x0"], saved["bagua"]["bucket_state"][b.name]["relay_x0"])
                                       for b in buckets)
            checks["step_carried"] = impl.step == saved["bagua"]["algorithm_state"]["step"]
            checks["generator_reseeded"] = torch.equal(
                impl.generator.get_state(), torch.Generator().manual_seed(rank_seed(0, rank)).get_state())
        if name == "powersgd":
            checks["error_zero"] = all(float(b.state["error"].abs().sum()) == 0 for b in buckets)
            checks["q_carried"] = all(
                torch.equal(q, saved["bagua"]["bucket_state"][b.name]["q"][key])
                for b in buckets for key, q in b.state["q"].items())
        if name == "terngrad":
            checks["error_zero"] = all(float(b.state["terngrad_error"].abs().sum()) == 0 for b in buckets)
            checks["generator_reseeded"] = torch.equal(
                impl.rounding[0].generator.get_state(), torch.Generator().manual_seed(rank_seed(3, rank)).get_state())
        if name == "low_precision_decentralized":
            checks["copies_are_the_loaded_weights"] = all(
                torch.equal(b.state[key], b.flat_view()) for b in buckets
                for key in ("low_precision_weight", "low_precision_left_peer_weight", "low_precision_right_peer_weight"))
        if name == "decentralized":
            checks["exchanges_carried"] = all(
                b.state["decentralized_exchanges"] == saved["bagua"]["bucket_state"][b.name]["decentralized_exchanges"]
                for b in buckets)
        if name == "qadam":
            first = optimizer.param_groups[0]["params"][0]
            checks["momentum_carried"] = torch.equal(optimizer.state[first]["exp_avg"],
                                                     saved["optimizer"]["state"][0]["exp_avg"])
        saved_buckets = saved["bagua"]["bucket_state"]
        if name == "sparseloco":  # saved after step 4: one outer step taken, a residual left
            checks["error_was_saved"] = all(float(saved_buckets[b.name]["sparseloco_error"].abs().sum()) > 0
                                            for b in buckets)
            checks["error_zero"] = all(float(b.state["sparseloco_error"].abs().sum()) == 0 for b in buckets)
            checks["outer_carried"] = all(torch.equal(b.state["diloco_outer"], saved_buckets[b.name]["diloco_outer"])
                                          for b in buckets)
        if name == "demo":
            checks["momentum_was_saved"] = all(float(saved_buckets[b.name]["error"].abs().sum()) > 0 for b in buckets)
            checks["momentum_zero"] = all(float(b.state["error"].abs().sum()) == 0 for b in buckets)
        if name == "sparta":
            checks["places_generator_carried"] = all(
                torch.equal(b.state["sparta_rng_state"], saved_buckets[b.name]["sparta_rng_state"]) for b in buckets)
            checks["outer_carried"] = all(torch.equal(b.state["diloco_outer"], saved_buckets[b.name]["diloco_outer"])
                                          for b in buckets)
        if name == "async":
            checks["step_id_carried"] = impl.step_id == saved["bagua"]["algorithm_state"]["step_id"]
            checks["rounds_reset"] = impl.rounds == 0
        _train(model, optimizer, rank, 2)  # and it trains on at the new size
        checks["finite_after_training"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        if name == "async":
            model.bagua_algorithm.abort(model)
        found[name] = checks
    return found


@pytest.fixture(scope="module")
def resumed_at_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved_at_three"))
    run_workers(_save_at_three, 3, root, timeout=240)
    return run_workers(_resume_at_two, 2, root, timeout=240)


@pytest.mark.parametrize("name", NAMES)
def test_state_saved_at_three_workers_resumes_at_two_by_the_algorithm_rule(resumed_at_two, name):
    for rank, found in enumerate(resumed_at_two):
        checks = found[name]
        assert checks["iteration"] == 4
        assert len(checks["warnings"]) == 1, checks["warnings"]
        message = checks["warnings"][0]
        assert "saved at world size 3 is loaded at world size 2" in message
        for piece, what in checks["rule"].items():
            assert f"{piece}: {what}" in message
        assert checks["model_is_first_rank's"] and checks["step_counter"]
        failed = [k for k, v in checks.items() if v is False]
        assert not failed, f"rank {rank}: {name} broke its rule on {failed}"
        assert set(checks) - {"iteration", "warnings", "rule", "model_is_first_rank's", "step_counter",
                              "finite_after_training"} or name in {"gradient_allreduce", "allreduce_average", "bytegrad"}


def test_the_heterogeneous_sampler_partitions_again_for_the_new_world_size():
    from samplers import DistributedHeterogeneousSampler

    labels = np.random.default_rng(0).integers(0, 5, size=401)
    dataset = list(range(len(labels)))

    def shares(n, seed):
        return [DistributedHeterogeneousSampler(dataset, num_replicas=n, rank=r, alpha=0.5, seed=seed,
                                                labels=labels, shuffle=False).shares[r] for r in range(n)]

    for n in (4, 2):
        again = shares(n, 7)
        assert all(np.array_equal(a, b) for a, b in zip(shares(n, 7), again))  # same n and seed, same shares
        covered = np.unique(np.concatenate(again))
        assert np.array_equal(covered, np.arange(len(labels)))  # every sample, at the new n too
    assert not all(np.array_equal(a, b) for a, b in zip(shares(2, 7), shares(2, 8)))  # the seed matters
