"""``samplers`` depends on torch.distributed only, never on ``bagua_algos``.

Importing ``bagua_algos`` loads the whole plugin and patches ``torch.nn.Module``
(``with_bagua``), so a data sampler must not pull it in, not even lazily when it
looks up its defaults: like torch's ``DistributedSampler`` it asks
``torch.distributed`` for the rank and world size.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest
import torch

from samplers import DistributedHeterogeneousSampler
from samplers import dirichlet
from subprocesses import REPO, run_python

SAMPLERS = REPO / "samplers"

# Run in a fresh interpreter: import the package, use every path that picks the rank
# and world size (explicit, defaults without a process group, defaults from a
# one-process gloo group), and report which modules of the plugin got loaded.
PROBE = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import samplers
    from samplers import DistributedHeterogeneousSampler as S

    report = {"after_import": sorted(m for m in sys.modules if m.split(".")[0] == "bagua_algos")}
    labels = [0, 1, 2] * 10
    S(range(30), num_replicas=3, rank=1, labels=labels)
    try:
        S(range(30), labels=labels)
    except RuntimeError as exc:
        report["error"] = str(exc)
    import torch.distributed as dist
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            s = S(range(30), labels=labels)
            report["defaults"] = [s.num_replicas, s.rank, len(s)]
        finally:
            dist.destroy_process_group()
    report["after_use"] = sorted(m for m in sys.modules if m.split(".")[0] == "bagua_algos")
    report["nn_module_patched"] = hasattr(__import__("torch").nn.Module, "with_bagua")
    print("REPORT " + json.dumps(report))
    """
)


def test_samplers_never_import_bagua_algos_in_a_fresh_interpreter():
    code, out, err = run_python(["-c", PROBE], timeout=120)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    line = next(line for line in out.splitlines() if line.startswith("REPORT "))
    report = json.loads(line[len("REPORT "):])
    assert report["after_import"] == [], report
    assert report["after_use"] == [], report
    assert report["nn_module_patched"] is False
    assert "not initialized" in report["error"] and "num_replicas= and rank=" in report["error"]
    assert report["defaults"] == [1, 0, 30]


def _imports(path: Path):
    """(module, imported names) of every import statement in ``path``; relative
    imports keep their leading dots."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            yield "." * node.level + (node.module or ""), [alias.name for alias in node.names]


@pytest.mark.parametrize("path", sorted(SAMPLERS.glob("*.py")), ids=lambda p: p.name)
def test_samplers_source_imports_no_plugin_and_no_private_names(path):
    for module, names in _imports(path):
        top = module.lstrip(".").split(".")[0]
        assert top not in ("bagua_algos", "bagua"), f"{path.name} imports {module}"
        if module.startswith("."):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path.name} imports private names {private} from {module}"


def test_dirichlet_helpers_used_by_the_sampler_are_public():
    for name in ("partition_codes", "validate_int", "validate_alpha", "DEFAULT_MAX_ATTEMPTS"):
        assert name in dirichlet.__all__
        assert hasattr(dirichlet, name)
    assert all(not name.startswith("_") for name in dirichlet.__all__)
    assert dirichlet.validate_int(3, "n", 1) == 3
    with pytest.raises(ValueError, match="n must be an integer >= 1, got n=0"):
        dirichlet.validate_int(0, "n", 1)
    with pytest.raises(TypeError, match="n must be an integer"):
        dirichlet.validate_int(True, "n", 1)


def test_partition_codes_is_dirichlet_partition_on_encoded_labels():
    labels = ["b", "a", "c", "a"] * 25
    codes, classes = dirichlet.encode_labels(labels)
    direct = dirichlet.dirichlet_partition(labels, 4, 0.5, seed=7)
    core = dirichlet.partition_codes(codes, len(classes), 4, 0.5, 7, 10, dirichlet.DEFAULT_MAX_ATTEMPTS)
    assert len(direct) == len(core) == 4
    for a, b in zip(direct, core):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()


def test_defaults_when_torch_distributed_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="num_replicas= and rank=") as info:
        DistributedHeterogeneousSampler(range(10), labels=[0] * 10)
    assert "torch.distributed is not available" in str(info.value)
    # explicit values need no process group at all
    s = DistributedHeterogeneousSampler(range(10), num_replicas=2, rank=1, labels=[0] * 10)
    assert (s.num_replicas, s.rank) == (2, 1)

