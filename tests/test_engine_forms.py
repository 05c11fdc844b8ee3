"""The engine's forms (bagua_algos/engine/forms.py): the engine, not the algorithm,
installs an equal-valued form of an algorithm's step. Relay's: its impl's ``delivery``
is the exchange (``ExchangeDelivery``) wherever the algorithm builds it, and the
engine's ``StackedRelayDelivery`` once the engine adopts the impl; relay.py itself never
asks which backend runs it."""

from __future__ import annotations

import ast

import pytest
import torch

from bagua_algos.algorithms import RelayAlgorithm, RelaySumGradAlgorithm
from bagua_algos.algorithms.relay import ExchangeDelivery, RelayAlgorithmImpl
from bagua_algos.engine import Engine, forms
from bagua_algos.engine import runtime as engine_runtime
from bagua_algos.engine.relay import StackedRelayDelivery, relay_form
from subprocesses import REPO


def _engine(topology: str, n: int = 5, algorithm=RelayAlgorithm) -> Engine:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return Engine(net, n, algorithm(topology=topology), lambda params: torch.optim.SGD(params, lr=0.1))


def _train(engine: Engine, steps: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(engine.n, 4, 6, generator=g), torch.randint(0, 3, (engine.n, 4), generator=g)
        engine.step(x, y, torch.nn.functional.cross_entropy)
    return torch.cat([b.flat_view().clone() for b in engine.runtime.bagua_buckets], 1)


@pytest.mark.parametrize("algorithm", [RelayAlgorithm, RelaySumGradAlgorithm], ids=["relay", "relaysum_grad"])
@pytest.mark.parametrize("topology", ["chain", "double_binary_tree"])
def test_relays_form_is_the_engines_choice_and_equals_the_algorithms_own(topology, algorithm, monkeypatch):
    """On the engine the impl delivers with the engine's form; without the engine's
    adopt (what a process's reify gives) it is the algorithm's own exchange, and the
    two train to the same parameters, bit for bit. RelaySum/Grad runs relay's round, so
    the same form."""
    adopted = _engine(topology, algorithm=algorithm)
    impl = adopted.runtime.bagua_algorithm
    assert forms.form_of(impl) is relay_form
    assert type(impl.delivery) is StackedRelayDelivery
    monkeypatch.setattr(engine_runtime, "adopt", lambda impl: impl)  # the algorithm left to itself
    own = _engine(topology, algorithm=algorithm)
    assert type(own.runtime.bagua_algorithm.delivery) is ExchangeDelivery
    assert torch.equal(_train(adopted), _train(own))


def test_register_form_refuses_what_is_not_a_class_or_a_second_form():
    with pytest.raises(TypeError, match="impl_class must be a class"):
        forms.register_form("relay")
    with pytest.raises(TypeError, match="form must be a function"):
        forms.register_form(type("Impl", (), {}))(3)
    with pytest.raises(ValueError, match="RelayAlgorithmImpl already has an engine form"):
        forms.register_form(RelayAlgorithmImpl)(lambda impl: None)
    assert forms.form_of(RelayAlgorithmImpl.__new__(RelayAlgorithmImpl)) is relay_form


def test_relay_py_has_no_branch_on_the_backend():
    """relay.py names nothing of the engine: no import of bagua_algos.engine, no
    ``is_stacked`` call and no name or attribute that says ``stacked``."""
    tree = ast.parse((REPO / "bagua_algos" / "algorithms" / "relay.py").read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in names if "stacked" in name.lower()]
    assert not [module for module in imported if "engine" in module]


def test_the_comparison_times_each_tree_in_its_own_process_and_checks_they_agree():
    """benchmarks/relay_engine_compare.py against this checkout itself, at its smallest:
    one line per tree and repetition, and a summary whose two checksums (the parameters
    after the run) are equal and whose ratio is the two medians' (no timing asserted)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "relay_engine_compare.py"), "--tree",
                          f"self={REPO}", "--repetitions", "1", "--workers", "4", "--warmup", "1", "--blocks", "1",
                          "--steps", "2", "--topologies", "chain"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["tree"] for line in lines if "repetition" in line] == ["now", "self"]
    summary = next(line for line in lines if line.get("topology") == "chain")
    assert summary["now_checksum"] == summary["self_checksum"]
    assert summary["now/self"] == pytest.approx(summary["now_ms"] / summary["self_ms"], rel=0.02)
