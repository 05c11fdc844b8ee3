"""An algorithm file is the one place that registers an algorithm and declares its rows
of the table (``register_algorithm`` in bagua_algos/algorithms/table.py), and the
package finds its files itself (bagua_algos/algorithms/__init__.py).

Pinned here, as they were when each file still had a line in the package's
``__init__``, ``__all__`` and the table's hand-kept list: the table's rows in their
order (test ids, the sweep's default rows and one_per_algorithm follow it), the
package's exports and bagua_algos' own names. A copy of the package with one more
file shows that the file alone adds the algorithm, its exports and its row."""

from __future__ import annotations

import importlib
import shutil
import sys
import textwrap
import types

import pytest

import bagua_algos
import bagua_algos.algorithms as algorithms
from bagua_algos import GlobalAlgorithmRegistry
from bagua_algos.algorithms.table import ALGORITHM_TABLE, AlgorithmConfig, config_by_label, register_algorithm
from subprocesses import REPO, child_env, run_python

TABLE_LABELS = [
    "gradient_allreduce", "gradient_allreduce_hierarchical", "allreduce_average", "decentralized",
    "decentralized_ring", "decentralized_all", "decentralized_shift_one", "relay_chain", "relay_binary_tree",
    "relay_double_binary_tree", "decentralized_ring_qgm", "d2_ring", "gradient_tracking_ring",
    "relaysum_grad_chain", "sgp", "terngrad", "terngrad_nearest", "bytegrad", "bytegrad_flat", "powersgd",
    "unbiased_low_rank", "random_block", "random_k", "top_k", "sign_norm", "signum", "atomo",
    "low_precision_decentralized", "qadam", "diloco", "diloco_streaming_8bit", "diloco_streaming_overlap",
    "sparseloco", "demo", "sparta", "sparta_diloco", "async",
]

SWEEP_LABELS = ["allreduce_average", "decentralized_ring", "decentralized_all", "relay_chain", "relay_binary_tree",
                "relay_double_binary_tree", "terngrad", "bytegrad_flat", "powersgd"]

# `from bagua_algos.algorithms import X` for each X of the package's hand-kept __all__
ALGORITHMS_EXPORTS = [
    "AllreduceAverageAlgorithm", "AllreduceAverageAlgorithmImpl", "AsyncModelAverageAlgorithm",
    "AsyncModelAverageAlgorithmImpl", "AtomoAlgorithm", "ByteGradAlgorithm", "ByteGradAlgorithmImpl", "D2Algorithm",
    "D2AlgorithmImpl", "DeMoAlgorithm", "DeMoAlgorithmImpl", "DecentralizedAlgorithm", "DecentralizedAlgorithmImpl",
    "DiLoCoAlgorithm", "DiLoCoAlgorithmImpl", "GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl",
    "GradientTrackingAlgorithm", "GradientTrackingAlgorithmImpl", "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl", "PowerSGDAlgorithm", "PowerSGDAlgorithmImpl", "QAdamAlgorithm",
    "QAdamAlgorithmImpl", "QAdamOptimizer", "RandomBlockAlgorithm", "RandomKAlgorithm", "RandomSketchAlgorithm",
    "RandomSketchAlgorithmImpl", "RelayAlgorithm", "RelayAlgorithmImpl", "RelaySumGradAlgorithm",
    "RelaySumGradAlgorithmImpl", "SGPAlgorithm", "SGPAlgorithmImpl", "SignNormAlgorithm", "SignumAlgorithm",
    "SparseLoCoAlgorithm", "SparseLoCoAlgorithmImpl", "SpartaAlgorithm", "SpartaAlgorithmImpl", "TernGradAlgorithm",
    "TernGradAlgorithmImpl", "TopKAlgorithm", "UnbiasedLowRankAlgorithm", "shift_one_peer",
]

# bagua_algos' names that are not modules (its submodules' names depend on what else is imported)
BAGUA_ALGOS_NAMES = [
    "Algorithm", "AlgorithmImpl", "BAGUA_COMMUNICATION_NAMES", "BaguaProcessGroup", "GlobalAlgorithmRegistry",
    "ReduceOp", "allgather", "allgather_inplace", "allreduce", "allreduce_inplace", "alltoall", "alltoall_inplace",
    "alltoall_v", "alltoall_v_inplace", "barrier", "broadcast", "broadcast_object", "destroy_process_group",
    "gather", "gather_inplace", "get_local_rank", "get_local_size", "get_node_rank", "get_rank", "get_world_size",
    "init_process_group", "is_initialized", "load_checkpoint", "neighbor_exchange", "new_group", "recv", "reduce",
    "reduce_inplace", "reduce_scatter", "reduce_scatter_inplace", "resume_from_checkpoint", "save_checkpoint",
    "scatter", "scatter_inplace", "send", "with_bagua",
]


def test_the_table_keeps_its_rows_in_their_order():
    assert [config.label for config in ALGORITHM_TABLE] == TABLE_LABELS
    assert [config.label for config in ALGORITHM_TABLE if config.in_sweep] == SWEEP_LABELS


def test_every_name_the_package_exported_is_still_exported():
    missing = [name for name in ALGORITHMS_EXPORTS if name not in algorithms.__all__]
    assert not missing, f"no longer in bagua_algos.algorithms.__all__: {missing}"
    for name in ALGORITHMS_EXPORTS:
        value = getattr(algorithms, name)
        assert getattr(sys.modules[value.__module__], name) is value


def test_bagua_algos_exports_what_it_did():
    names = sorted(name for name, value in vars(bagua_algos).items()
                   if not name.startswith("_") and not isinstance(value, types.ModuleType))
    assert names == BAGUA_ALGOS_NAMES


def test_every_module_of_the_package_is_imported_and_re_exported():
    files = sorted(path.stem for path in (REPO / "bagua_algos" / "algorithms").glob("*.py")
                   if path.stem not in ("__init__", "table"))
    for stem in files:
        module = sys.modules.get(f"bagua_algos.algorithms.{stem}")
        assert module is not None, f"bagua_algos.algorithms did not import {stem}"
        for name in module.__all__:
            assert name in algorithms.__all__ and getattr(algorithms, name) is getattr(module, name), (stem, name)
    assert len(algorithms.__all__) == len(set(algorithms.__all__))


def test_each_package_row_is_declared_by_its_algorithm_s_own_file():
    """The row's name is the algorithm its file registers: a row sits with the class it builds."""
    for config in ALGORITHM_TABLE:
        assert GlobalAlgorithmRegistry.get(config.name).__module__.startswith("bagua_algos.algorithms."), config.label


def test_the_coverage_test_fails_for_an_algorithm_registered_without_a_row():
    """tests/test_algorithm_table.py's check that the table names every registered
    algorithm: an algorithm of the package registered the old way, with no row, fails it."""
    coverage = importlib.import_module("test_algorithm_table").test_the_table_covers_every_registered_algorithm
    coverage()  # the package as it is passes

    class RowlessAlgorithm(bagua_algos.Algorithm):
        pass

    RowlessAlgorithm.__module__ = "bagua_algos.algorithms.rowless"
    GlobalAlgorithmRegistry.register("rowless_probe", RowlessAlgorithm, "registered with no row")
    try:
        with pytest.raises(AssertionError, match=r"algorithms with no row: \['rowless_probe'\]"):
            coverage()
    finally:
        GlobalAlgorithmRegistry.unregister("rowless_probe")


class _Probe(bagua_algos.Algorithm):
    pass


def _row(label="probe_row", name="probe"):
    return AlgorithmConfig(label, name)


@pytest.mark.parametrize("rows,error,match", [
    ([], ValueError, r"'probe': rows must hold at least one \(position, AlgorithmConfig\) pair"),
    ("probe_row", TypeError, r"'probe': rows must be a sequence of \(position, AlgorithmConfig\) pairs"),
    (None, TypeError, r"'probe': rows must be a sequence"),
    ([_row()], TypeError, r"'probe': each of rows must be a \(position, AlgorithmConfig\) pair, got AlgorithmConfig"),
    ([(10, {"label": "probe_row"})], TypeError, r"'probe': the second of each rows pair must be an AlgorithmConfig"),
    ([(1.5, _row())], ValueError, r"probe_row: position must be an int >= 0, got 1.5"),
    ([(-1, _row())], ValueError, r"probe_row: position must be an int >= 0, got -1"),
    ([(10, _row(name="other"))], ValueError, r"probe_row: a row of 'probe' must have name='probe', got name='other'"),
    ([(10, _row()), (20, _row())], ValueError, r"probe_row: the label is declared twice"),
    ([(10, _row("relay_chain"))], ValueError, r"relay_chain: the label is declared twice"),
], ids=["empty", "a_string", "none", "a_bare_row", "not_a_row", "float_position", "negative_position",
        "another_name", "label_twice", "a_label_of_the_table"])
def test_bad_rows_are_refused_by_name_and_register_nothing(rows, error, match):
    with pytest.raises(error, match=match):
        register_algorithm("probe", _Probe, "a probe", rows=rows)
    assert "probe" not in GlobalAlgorithmRegistry.available_algorithms()
    with pytest.raises(ValueError, match="no algorithm configuration labelled 'probe_row'"):
        config_by_label("probe_row")


def test_a_name_already_registered_is_refused_before_any_row_is_kept():
    with pytest.raises(ValueError, match="algorithm 'relay' is already registered"):
        register_algorithm("relay", _Probe, "a second relay", rows=[(10_000, AlgorithmConfig("relay_probe", "relay"))])
    with pytest.raises(ValueError, match="no algorithm configuration labelled 'relay_probe'"):
        config_by_label("relay_probe")


# A new file in a copy of the package: the template algorithm, at a position of its own.
_PROBE = textwrap.dedent('''
    import bagua_algos.algorithms as algorithms
    from bagua_algos.algorithms import EFSignSGDAlgorithm, RelayAlgorithm
    from bagua_algos.algorithms.table import ALGORITHM_TABLE, config_by_label, one_per_algorithm

    assert algorithms.__file__.startswith({copy!r}), algorithms.__file__
    labels = [config.label for config in ALGORITHM_TABLE]
    print("LABELS", ",".join(labels))
    print("LAST", one_per_algorithm()[-1].name, type(config_by_label("ef_sign_sgd").build()).__name__)
''')


def _package_copy(tmp_path, position: int, also: str = ""):
    """Run _PROBE against a copy of the package holding the template at ``position``,
    and ``also`` as one more module of the package when given."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "bagua_algos", copy / "bagua_algos", ignore=shutil.ignore_patterns("__pycache__"))
    template = (REPO / "examples" / "ef_sign_sgd.py").read_text()
    assert "(1000, AlgorithmConfig(" in template
    (copy / "bagua_algos" / "algorithms" / "ef_sign_sgd.py").write_text(
        template.replace("(1000, AlgorithmConfig(", f"({position}, AlgorithmConfig("))
    if also:
        (copy / "bagua_algos" / "algorithms" / "also.py").write_text(also)
    (copy / "probe.py").write_text(_PROBE.format(copy=str(copy)))
    env = child_env()
    env["PYTHONPATH"] = str(copy) + ":" + env["PYTHONPATH"]  # the copy's package before the checkout's
    return run_python([copy / "probe.py"], env=env, timeout=180)


def test_a_new_file_in_the_package_is_all_an_algorithm_needs(tmp_path):
    """The template copied into bagua_algos/algorithms/, no other file touched: its class
    is exported by the package, its row is in the table at its position (1000: last),
    and the rows before it are the table's as they were."""
    code, out, err = _package_copy(tmp_path, 1000)
    assert code == 0, err[-3000:]
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("LABELS", "LAST")))
    assert lines["LABELS"].split(",") == TABLE_LABELS + ["ef_sign_sgd"]
    assert lines["LAST"] == "ef_sign_sgd EFSignSGDAlgorithm"


def test_two_rows_at_one_position_are_refused_by_label(tmp_path):
    """Positions order the table, so a file that takes one already held fails the import
    and names both rows."""
    code, out, err = _package_copy(tmp_path, 80)  # relay_chain's
    assert code != 0
    assert "rows 'relay_chain' and 'ef_sign_sgd' have the same position 80" in err or \
        "rows 'ef_sign_sgd' and 'relay_chain' have the same position 80" in err, err[-3000:]


def test_a_module_that_reads_the_table_before_it_is_collected_is_told_when_it_may(tmp_path):
    """ALGORITHM_TABLE exists once every module of the package is imported; a module of
    the package that read it at import would see part of it, and is refused instead."""
    also = "from bagua_algos.algorithms.table import ALGORITHM_TABLE\n\n__all__ = []\n"
    code, out, err = _package_copy(tmp_path, 1000, also)
    assert code != 0
    assert "RuntimeError: ALGORITHM_TABLE is collected once bagua_algos.algorithms has imported every" in err, \
        err[-3000:]
