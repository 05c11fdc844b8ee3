"""tools/bagua_upstream_tests.py: how it prepares a copy of Bagua's tests (running them
needs a Bagua checkout, which this project does not have offline)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("bagua_upstream_tests", REPO / "tools" / "bagua_upstream_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_copy_skips_nothing_and_clears_the_shared_store(tool, tmp_path):
    bagua = tmp_path / "bagua"
    (bagua / "tests" / "torch_api").mkdir(parents=True)
    (bagua / "tests" / "__init__.py").write_text("def skip_if_cuda_not_available():\n    raise AssertionError\n")
    (bagua / "tests" / "torch_api" / "test_x.py").write_text(
        "class T:\n    def run_diff_locally(\n        self, n, backend\n    ):\n        pass\n\n"
        "    def test_a(self):\n        init = 'file:///tmp/.bagua.test.filestore'\n")
    root = tool.prepared_copy(bagua, tmp_path / "copy")
    namespace = {}
    exec((root / "tests" / "__init__.py").read_text(), namespace)
    assert namespace["skip_if_cuda_not_available"]()(len) is len and namespace["skip_if_cuda_available"]()(len) is len
    text = (root / "tests" / "torch_api" / "test_x.py").read_text()
    assert text.count(tool._CLEAR) == 2  # at the start of the run and of the test method
    compile(text, "test_x.py", "exec")
    assert "torch.Tensor.cuda" in (root / "shim" / "sitecustomize.py").read_text()


def test_bad_arguments_are_refused_by_name(tool, tmp_path, capsys):
    with pytest.raises(SystemExit, match="no tests/torch_api there"):
        tool.main(["--bagua", str(tmp_path)])
    with pytest.raises(SystemExit):
        tool.main(["--bagua", str(tmp_path), "--workers", "1"])
    assert "--workers: at least 2" in capsys.readouterr().err
