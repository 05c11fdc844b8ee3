"""The algorithm table (bagua_algos/algorithms/table.py) covers every algorithm the
package registers, each row builds its algorithm, rows are read-only values, and every
row has a --configs form that the benchmarks read back as the same row.

And the runtime contract: whether an algorithm needs the optimizer step is an attribute
each AlgorithmImpl declares (an algorithm file written for Bagua is given one)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from bagua_algos import GlobalAlgorithmRegistry
from bagua_algos.algorithms.table import ALGORITHM_TABLE, AlgorithmConfig, config_by_label, one_per_algorithm
from bagua_algos.runtime.algorithm import AlgorithmImpl
from bagua_algos.experiments.common import config_spec, parse_configs

LABELS = [config.label for config in ALGORITHM_TABLE]


def _package_algorithms() -> set[str]:
    """The names the package registers (a test module may register its own, e.g. the template's)."""
    return {name for name in GlobalAlgorithmRegistry.available_algorithms()
            if GlobalAlgorithmRegistry.get(name).__module__.startswith("bagua_algos.")}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def test_the_table_covers_every_registered_algorithm():
    names = {config.name for config in ALGORITHM_TABLE}
    assert _package_algorithms() <= names, f"algorithms with no row: {sorted(_package_algorithms() - names)}"
    assert names <= set(GlobalAlgorithmRegistry.available_algorithms())
    assert [config.name for config in one_per_algorithm()] == list(dict.fromkeys(c.name for c in ALGORITHM_TABLE))


def test_the_topologies_and_modes_the_tests_rely_on_have_rows():
    kwargs = {config.label: dict(config.kwargs) for config in ALGORITHM_TABLE}
    assert kwargs["gradient_allreduce_hierarchical"]["hierarchical"] is True
    assert {kwargs[f"relay_{t}"]["topology"] for t in ("chain", "binary_tree", "double_binary_tree")} == {
        "chain", "binary_tree", "double_binary_tree"}
    assert kwargs["decentralized_ring"]["topology"] == "ring"
    modes = {kwargs[label]["peer_selection_mode"] for label in ("decentralized_all", "decentralized_shift_one")}
    assert modes == {"all", "shift_one"}


def test_labels_are_unique_and_looked_up_by_name():
    assert len(set(LABELS)) == len(LABELS)
    assert all(config_by_label(label).label == label for label in LABELS)
    with pytest.raises(ValueError, match="no algorithm configuration labelled 'nope'; labels: "):
        config_by_label("nope")


@pytest.mark.parametrize("label", LABELS)
def test_each_row_builds_its_registered_algorithm(label):
    config = config_by_label(label)
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = config.optimizer_for(params, _sgd)
    algorithm = config.build(optimizer)
    assert isinstance(algorithm, GlobalAlgorithmRegistry.get(config.name))
    if config.own_optimizer is not None:
        assert isinstance(optimizer, config.own_optimizer.cls)
        with pytest.raises(TypeError, match=f"{label}: 'qadam' is built on its own QAdamOptimizer"):
            config.build(_sgd(params))
    else:
        assert type(optimizer) is torch.optim.SGD


@pytest.mark.parametrize("label", LABELS)
def test_a_row_is_a_read_only_value_that_pickles(label):
    config = config_by_label(label)
    with pytest.raises(TypeError):
        config.kwargs["extra"] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.label = "other"
    assert pickle.loads(pickle.dumps(config)) == config
    assert hash(config) == hash(pickle.loads(pickle.dumps(config)))


def test_bad_rows_are_refused_by_field():
    with pytest.raises(ValueError, match="replicas must be one of"):
        AlgorithmConfig("x", "gradient_allreduce", replicas="same")
    with pytest.raises(ValueError, match="min_workers must be an int >= 1"):
        AlgorithmConfig("x", "gradient_allreduce", min_workers=0)
    with pytest.raises(TypeError, match="kwargs must be a mapping"):
        AlgorithmConfig("x", "gradient_allreduce", ["hierarchical"])


def test_runs_with_follows_the_worker_count_rules():
    shift_one = config_by_label("decentralized_shift_one")
    assert [n for n in range(1, 7) if shift_one.runs_with(n)] == [2, 4, 6]
    assert all(config_by_label("relay_chain").runs_with(n) for n in range(1, 7))


@pytest.mark.parametrize("label", LABELS)
def test_every_row_has_a_configs_entry_read_back_as_the_same_row(label):
    config = config_by_label(label)
    [parsed] = parse_configs(config_spec(config))
    own = dict(config.own_optimizer.kwargs) if config.own_optimizer else {}
    assert parsed.name == config.name and parsed.kwargs == {**config.kwargs, **own}


def test_the_sweep_defaults_are_the_rows_marked_for_it():
    from bagua_algos.experiments.sweep.cli import DEFAULT_CONFIGS

    assert [c.spec for c in parse_configs(DEFAULT_CONFIGS)] == [
        config_spec(config) for config in ALGORITHM_TABLE if config.in_sweep]


# ------------------------------------------------------------------ the runtime contract


def test_needs_optimizer_step_is_declared_by_each_algorithm():
    from bagua_algos import algorithms as A

    needs = {cls.__name__: cls.needs_optimizer_step for cls in (
        A.GradientAllReduceAlgorithmImpl, A.ByteGradAlgorithmImpl, A.TernGradAlgorithmImpl, A.QAdamAlgorithmImpl,
        A.DecentralizedAlgorithmImpl, A.AllreduceAverageAlgorithmImpl, A.RelayAlgorithmImpl,
        A.LowPrecisionDecentralizedAlgorithmImpl, A.AsyncModelAverageAlgorithmImpl, A.PowerSGDAlgorithmImpl)}
    # Gradient algorithms and D-PSGD communicate during backward (or forward); the others
    # after the step (PowerSGD's error_in_grad writes the error there).
    assert needs == {
        "GradientAllReduceAlgorithmImpl": False, "ByteGradAlgorithmImpl": False, "TernGradAlgorithmImpl": False,
        "QAdamAlgorithmImpl": False, "DecentralizedAlgorithmImpl": False,
        "AllreduceAverageAlgorithmImpl": True, "RelayAlgorithmImpl": True,
        "LowPrecisionDecentralizedAlgorithmImpl": True, "AsyncModelAverageAlgorithmImpl": True,
        "PowerSGDAlgorithmImpl": True}


def test_an_algorithm_file_written_for_bagua_needs_the_step_when_it_defines_the_hook():
    class BaguaStyle(AlgorithmImpl):  # Bagua's files know no needs_optimizer_step
        def init_post_optimizer_step_hook(self, bagua_ddp):
            return lambda optimizer: None

    class Declared(AlgorithmImpl):
        needs_optimizer_step = False

        def init_post_optimizer_step_hook(self, bagua_ddp):
            return lambda optimizer: None

    class Inherits(BaguaStyle):
        pass

    assert AlgorithmImpl.needs_optimizer_step is False
    assert BaguaStyle.needs_optimizer_step is True and Inherits.needs_optimizer_step is True
    assert Declared.needs_optimizer_step is False
