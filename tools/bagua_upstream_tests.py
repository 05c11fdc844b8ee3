"""Run Bagua's own tests (``tests/`` of a BaguaSys/bagua checkout) against this plugin's
compatibility package, on the CPU.

    python tools/bagua_upstream_tests.py --bagua ~/src/bagua                # the default files
    python tools/bagua_upstream_tests.py --bagua ~/src/bagua tests/torch_api/test_qadam.py

Bagua's tests are written for GPUs: they call ``.cuda()`` and ``torch.cuda.set_device``,
take ``torch.cuda.device_count()`` workers and skip without CUDA. Their copy here runs
with a shim (a ``sitecustomize`` on the workers' path): ``.cuda()`` leaves a tensor or
module on the CPU, ``set_device`` does nothing, the device count is ``--workers``,
torch's DDP (the tests' reference runs) drops its device ids, and a reference group
asked for NCCL gets gloo (the plugin picks gloo by itself). Two things of the copies
are patched, both in the tests' own harness, never in what they check: the skip helpers of
``tests/__init__.py`` skip nothing, and the shared FileStore file of the torch
reference runs is removed before each run (the reference groups are never destroyed,
so a later run would read an earlier run's keys). ``inspect.getargspec`` (gone in
Python 3.11) is aliased to ``getfullargspec``.

Workers get ``OMP_NUM_THREADS=1`` (as torchrun's), unless it is set: each test joins its
workers with a 60 s timeout, which 1000 steps of 4 workers with 2 OpenMP threads each
exceed on 2 cores. docs/bagua_api.md has the results. Nothing here needs a network:
give a local checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_FILES = [
    "tests/torch_api/test_utils.py", "tests/torch_api/test_gradient_allreduce.py",
    "tests/torch_api/test_decentralized.py", "tests/torch_api/test_low_precision_decentralized.py",
    "tests/torch_api/test_async_model_average.py", "tests/torch_api/test_multi_models.py",
    "tests/torch_api/test_broadcast_state.py",
    "tests/torch_api/test_qadam.py", "tests/torch_api/test_bagua_module.py",
    *(f"tests/torch_api/data_parallel/test_{name}.py" for name in (
        "decentralized", "gradient_allreduce", "low_precision_decentralized", "multi_models", "broadcast_state",
        "async_model_average", "bagua_module")),
]

SHIM = '''\
import os
if os.environ.get("BAGUA_CPU_SHIM"):
    import inspect
    import torch
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.device_count = lambda: int(os.environ["BAGUA_CPU_SHIM"])
    if not hasattr(inspect, "getargspec"):
        inspect.getargspec = inspect.getfullargspec
    _ddp_init = torch.nn.parallel.DistributedDataParallel.__init__

    def _ddp_on_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
        # the reference runs name their GPU: torch's DDP takes no device ids on the CPU
        _ddp_init(self, module, None, None, *args, **kwargs)

    torch.nn.parallel.DistributedDataParallel.__init__ = _ddp_on_cpu
    import torch.distributed as _dist
    _init_group = _dist.init_process_group

    def _gloo_for_nccl(*args, **kwargs):
        # a reference run that asks for NCCL gets gloo: there is no GPU
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return _init_group(*args, **kwargs)

    _dist.init_process_group = _gloo_for_nccl
'''

SKIP_HELPERS = '''\
def skip_if_cuda_available():
    return lambda func: func


def skip_if_cuda_not_available():
    return lambda func: func
'''

STORE = "/tmp/.bagua.test.filestore"
_CLEAR = f'__import__("os").path.exists("{STORE}") and __import__("os").remove("{STORE}")'


def prepared_copy(bagua: Path, into: Path) -> Path:
    """Bagua's ``tests/`` copied under ``into``, its harness patched (module docstring)."""
    source = bagua / "tests"
    if not (source / "torch_api").is_dir():
        raise SystemExit(f"--bagua {bagua}: no tests/torch_api there; give a checkout of BaguaSys/bagua")
    shutil.copytree(source, into / "tests")
    (into / "tests" / "__init__.py").write_text(SKIP_HELPERS)
    for path in (into / "tests").rglob("test_*.py"):
        text = path.read_text()
        if STORE in text:  # clear the store file at the start of every test method
            text = re.sub(r"(\n    def test_\w+\(self[^)]*\):\n)", rf"\1        {_CLEAR}\n", text)
            text = re.sub(r"(\n    def run_diff_locally\([^)]*\):\n)", rf"\1        {_CLEAR}\n", text)
            path.write_text(text)
    (into / "shim").mkdir()
    (into / "shim" / "sitecustomize.py").write_text(SHIM)
    return into


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bagua", type=Path, required=True, help="a checkout of BaguaSys/bagua")
    parser.add_argument("--workers", type=int, default=4, help="the device count the shim reports (default 4)")
    parser.add_argument("files", nargs="*", help=f"test files, relative to the checkout (default: {len(DEFAULT_FILES)})")
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error(f"--workers: at least 2 (Bagua's tests start that many processes), got {args.workers}")
    with tempfile.TemporaryDirectory(prefix="bagua_tests_") as tmp:
        root = prepared_copy(args.bagua.expanduser().resolve(), Path(tmp))
        # one intra-op thread a worker, as torchrun gives its workers: the tests start
        # their workers with multiprocessing, and 4 workers of 2 spinning OpenMP threads
        # on 2 cores take 8x as long a step (torch's own DDP too), past the joins' 60 s
        env = dict(os.environ, BAGUA_CPU_SHIM=str(args.workers), PYTHONPATH=os.pathsep.join(
            [str(root / "shim"), str(REPO / "bagua_algos" / "compat"), str(root), str(REPO)]))
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(args.files or DEFAULT_FILES)]
        return subprocess.call(command, cwd=root, env=env)


if __name__ == "__main__":
    sys.exit(main())
