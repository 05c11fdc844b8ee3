"""The template algorithm (examples/ef_sign_sgd.py) is what docs/DESIGN.md says it is: an
algorithm that trains on gloo workers exactly as its math says, whose state checkpoints
with no code of its own, and an example that runs under the launcher."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bagua_algos.experiments.gloo_workers import run_workers
from subprocesses import REPO, free_port, run_python

sys.path.insert(0, str(REPO / "examples"))
import ef_sign_sgd  # noqa: E402

N, STEPS, LR = 2, 4, 0.1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=40))
@example([0.0, 1.401298464324817e-45])  # the scale ‖p‖₁/d underflows to 0 in float32
def test_scaled_sign_keeps_each_sign_and_the_l1_norm_of_a_zero_free_vector(values):
    p = torch.tensor(values, dtype=torch.float32)
    delta = ef_sign_sgd.scaled_sign(p)
    if float(p.abs().sum() / p.numel()) == 0.0:
        # the scale is 0 in float32 (only subnormals, a sum below the smallest one once
        # divided by d): δ is 0, and error feedback keeps all of p for the next step
        assert not bool(delta.any())
        return
    assert torch.equal(torch.sign(delta), torch.sign(p))
    if bool((p != 0).all()):
        torch.testing.assert_close(delta.abs().sum(), p.abs().sum(), rtol=1e-5, atol=1e-6)


def test_a_flag_that_is_not_a_bool_is_refused_by_name():
    with pytest.raises(TypeError, match="error_feedback"):
        ef_sign_sgd.EFSignSGDAlgorithm(error_feedback="yes")


def test_its_row_is_found_by_label_once_the_module_is_imported():
    """The template declares its row where it registers (register_algorithm), as a file
    of the package does; outside the package the row is found by label, while the
    package's table, which the suite runs, stays as the package declares it."""
    from bagua_algos.algorithms.table import ALGORITHM_TABLE, config_by_label

    row = config_by_label("ef_sign_sgd")
    assert row.name == "ef_sign_sgd" and row.replicas == "equal"
    algorithm = row.build()
    assert isinstance(algorithm, ef_sign_sgd.EFSignSGDAlgorithm) and algorithm.error_feedback is True
    assert "ef_sign_sgd" not in {config.label for config in ALGORITHM_TABLE}


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _train_worker(rank, n):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model = model.with_bagua([optimizer], ef_sign_sgd.EFSignSGDAlgorithm())
    assert len(model.bagua_buckets) == 1, "the oracle below assumes one bucket"
    x, y = _data(rank)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    state = model.bagua_state_dict()
    return [p.detach().clone() for p in model.parameters()], state


def _oracle():
    """n workers simulated in one process: the four numbered steps of the module's docstring."""
    model = _model()
    params = list(model.parameters())
    errors = [torch.zeros(sum(p.numel() for p in params)) for _ in range(N)]
    for _ in range(STEPS):
        deltas = []
        for rank in range(N):
            x, y = _data(rank)
            grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
            p = torch.cat([g.reshape(-1) for g in grads]) + errors[rank]
            delta = ef_sign_sgd.scaled_sign(p)
            errors[rank] = p - delta
            deltas.append(delta)
        mean = torch.stack(deltas).mean(0)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.sub_(LR * mean[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
    return [p.detach() for p in params], errors


def test_two_workers_train_as_the_single_process_oracle_and_checkpoint_the_error():
    results = run_workers(_train_worker, N, timeout=90)
    expected, errors = _oracle()
    for rank, (params, state) in enumerate(results):
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        saved = [v for k, v in _flatten(state) if "ef_sign_error" in k]
        assert len(saved) == 1, f"bagua_state_dict() should carry the error buffer: {[k for k, _ in _flatten(state)]}"
        assert saved[0].shape == (1, errors[rank].numel())  # [W, L], the bucket's flat shape (W = 1 in a job)
        # The flattened bucket may order the parameters differently: compare as multisets.
        torch.testing.assert_close(saved[0][0].sort().values, errors[rank].sort().values, rtol=1e-5, atol=1e-6)


def test_the_engine_runs_the_template_s_own_op_with_nothing_registered():
    """An algorithm outside the package on the one-process engine: its own op, run for
    the n workers at once on stacked buckets, trains as the oracle's n workers, and its
    error buffer is one row per worker."""
    from bagua_algos.engine import Engine

    engine = Engine(_model(), N, ef_sign_sgd.EFSignSGDAlgorithm(), lambda params: torch.optim.SGD(params, lr=LR))
    x = torch.stack([_data(rank)[0] for rank in range(N)])
    y = torch.stack([_data(rank)[1] for rank in range(N)])
    for _ in range(STEPS):
        engine.step(x, y, torch.nn.functional.cross_entropy)
    expected, errors = _oracle()
    for rank in range(N):
        state = engine.model.worker_state(rank)
        for (name, _), want in zip(_model().named_parameters(), expected):
            torch.testing.assert_close(state[name], want, rtol=1e-5, atol=1e-6)
    (bucket,) = engine.runtime.bagua_buckets
    assert bucket.state["ef_sign_error"].shape == (N, bucket.numel)
    for rank in range(N):
        torch.testing.assert_close(bucket.state["ef_sign_error"][rank].sort().values, errors[rank].sort().values,
                                   rtol=1e-5, atol=1e-6)


def test_the_engine_says_why_an_algorithm_it_cannot_stack_fails():
    """A per-rank buffer where the engine needs a row per worker is named, with the way
    out."""
    from bagua_algos.engine import Engine
    from bagua_algos.runtime import comm
    from bagua_algos.runtime.algorithm import Algorithm, AlgorithmImpl

    class PerRankBuffer(AlgorithmImpl):
        def init_operations(self, bagua_ddp, bucket):
            bucket.clear_ops()
            mine = torch.zeros(bucket.numel)  # a rank's shape: no row per worker
            bucket.append_python_op(lambda name: comm.allreduce_inplace(mine, group=self.process_group))

    class Unstackable(Algorithm):
        def reify(self, process_group):
            return PerRankBuffer(process_group)

    engine = Engine(_model(), 2, Unstackable(), lambda params: torch.optim.SGD(params, lr=LR))
    x = torch.stack([_data(rank)[0] for rank in range(2)])
    y = torch.stack([_data(rank)[1] for rank in range(2)])
    with pytest.raises(ValueError, match=r"a row of a stacked tensor.*zeros_like\(bucket.flat_view\(\)\)"):
        engine.step(x, y, torch.nn.functional.cross_entropy)


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}/{i}")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def test_the_example_trains_under_the_launcher():
    rc, out, err = run_python(["-m", "bagua_algos.launch", "--backend", "gloo", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(REPO / "examples" / "ef_sign_sgd.py"),
                               "--steps", "60"], timeout=120)
    assert rc == 0, err
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) >= 3, out
    assert losses[-1] < 0.6 * losses[0], out
