"""Building and loading the compiled orthogonalization, once per process and kind.

Two kinds of module, both from the sources in ``csrc/``:

- ``"cpu"``: ``bindings.cpp`` + ``orthogonalize_cpu.cpp`` (C++ only, ~15-30 s to build);
- ``"cuda"``: the same plus ``orthogonalize_cuda.cpp`` and ``orthogonalize_kernel.cu``
  (nvcc, about a minute); it serves CPU tensors too.

A module is taken from, in order: this process (already loaded); a copy built at
install time (``BAGUA_BUILD_CUDA_EXT=1 pip install --no-build-isolation .`` puts
``cuda_ext._orthogonalize_cpu`` / ``_orthogonalize_cuda`` next to this file); else it
is compiled with ``torch.utils.cpp_extension.load`` into the cache directory
(:func:`cache_dir`), which torch reuses while the sources and flags are unchanged.
A failure is remembered: the next call raises the same error at once instead of
compiling again.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional

import torch

KINDS = ("cpu", "cuda")
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = {
    "cpu": ["bindings.cpp", "orthogonalize_cpu.cpp", "powersgd_cpu.cpp", "engine_cpu.cpp"],
    "cuda": ["bindings.cpp", "orthogonalize_cpu.cpp", "powersgd_cpu.cpp", "engine_cpu.cpp", "orthogonalize_cuda.cpp",
             "orthogonalize_kernel.cu"],
}
HEADERS = ["householder.h", "orthogonalize.h", "orthogonalize_kernel.h", "powersgd_cpu.h", "engine_cpu.h", "vectors.h"]
MODULE_NAMES = {"cpu": "bagua_orthogonalize_cpu", "cuda": "bagua_orthogonalize_cuda"}
PREBUILT = {"cpu": "cuda_ext._orthogonalize_cpu", "cuda": "cuda_ext._orthogonalize_cuda"}
CACHE_ENV = "BAGUA_CUDA_EXT_CACHE"
VERBOSE_ENV = "BAGUA_CUDA_EXT_VERBOSE"
CXX_FLAGS = ["-O3"]  # torch chooses the C++ standard (C++20 for torch 2.15)
NVCC_FLAGS = ["-O3"]


class ExtensionUnavailable(RuntimeError):
    """The extension could not be built or loaded (no compiler, no CUDA toolkit, ...)."""


_lock = threading.Lock()
_modules: Dict[str, ModuleType] = {}
_failures: Dict[str, ExtensionUnavailable] = {}


def cache_dir() -> Path:
    """Where JIT builds go: ``$BAGUA_CUDA_EXT_CACHE``, else
    ``$XDG_CACHE_HOME/bagua_algos/cuda_ext`` (``~/.cache/...`` by default), with one
    subdirectory per torch build and Python version (a module is only valid for those)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "bagua_algos", "cuda_ext")
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda or 'none'}-py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(root) / tag.replace("+", "_")


def kind_for(device) -> str:
    """The module kind that serves tensors on ``device``."""
    device_type = torch.device(device).type
    if device_type not in KINDS:
        raise ExtensionUnavailable(f"cuda_ext has no path for device type {device_type!r} (valid: {list(KINDS)})")
    return device_type


def loaded(kind: Optional[str] = None) -> bool:
    """Whether a module of ``kind`` (any kind when None) is loaded in this process."""
    with _lock:
        if kind is None:
            return bool(_modules)
        return kind in _modules or (kind == "cpu" and "cuda" in _modules)


def loaded_module(kind: str) -> Optional[ModuleType]:
    """The module that :func:`load` would return for ``kind`` if it is already loaded,
    else None; never builds. No lock: a dict lookup (for the per-call fast path)."""
    module = _modules.get(kind)
    if module is None and kind == "cpu":
        module = _modules.get("cuda")
    return module


def load(kind: str) -> ModuleType:
    """The module of ``kind``, building it on first use; raises ExtensionUnavailable."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    with _lock:
        if kind in _modules:
            return _modules[kind]
        if kind == "cpu" and "cuda" in _modules:  # the CUDA build serves CPU tensors too
            return _modules["cuda"]
        if kind in _failures:
            raise _failures[kind]
        try:
            module = _import_prebuilt(kind) or _build(kind)
        except Exception as error:  # noqa: BLE001 — whatever failed, the extension is unavailable
            failure = ExtensionUnavailable(f"building the {kind} extension failed: {_first_line(error)}")
            failure.__cause__ = error
            _failures[kind] = failure
            raise failure from error
        _modules[kind] = module
        return module


def forget_failures() -> None:
    """Let the next ``load`` try again (after installing a compiler, in tests)."""
    with _lock:
        _failures.clear()


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def _import_prebuilt(kind: str) -> Optional[ModuleType]:
    try:
        return importlib.import_module(PREBUILT[kind])
    except ImportError:
        return None


def build_arguments(kind: str) -> dict:
    """The arguments ``_build`` gives ``torch.utils.cpp_extension.load`` for ``kind``
    (also what :func:`nvcc_command` compiles with)."""
    extra = {}
    if kind == "cuda":
        extra["extra_cuda_cflags"] = list(NVCC_FLAGS)
    return dict(
        name=MODULE_NAMES[kind],
        sources=[str(CSRC / s) for s in SOURCES[kind]],
        extra_cflags=CXX_FLAGS + (["-DBAGUA_WITH_CUDA"] if kind == "cuda" else []),
        extra_include_paths=[str(CSRC)],
        with_cuda=(kind == "cuda"),
        **extra,
    )


def nvcc_command(source, output, workdir) -> list:
    """The command torch's JIT build runs to compile the CUDA ``source`` of the "cuda"
    module into ``output`` (without the dependency file): the nvcc flags are read from
    the build file torch's own ``cpp_extension`` writes for this module (its
    COMMON_NVCC_FLAGS such as ``--expt-relaxed-constexpr``, the arch flags of
    ``TORCH_CUDA_ARCH_LIST`` or the visible GPUs, the include paths, ``-std``), written
    into ``workdir``. Used by the compile-only test, so it checks the real build."""
    import inspect
    import shlex

    from torch.utils import cpp_extension

    args = build_arguments("cuda")
    writer = cpp_extension._write_ninja_file_to_build_library
    wanted = dict(path=os.path.join(str(workdir), "build.ninja"), name=args["name"], sources=args["sources"],
                  extra_cflags=args["extra_cflags"], extra_cuda_cflags=args["extra_cuda_cflags"],
                  extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=args["extra_include_paths"],
                  with_cuda=True, with_sycl=False, is_standalone=False)
    accepted = inspect.signature(writer).parameters
    missing = [k for k in ("path", "name", "sources", "extra_cuda_cflags", "with_cuda") if k not in accepted]
    if missing:
        raise RuntimeError(f"torch.utils.cpp_extension's build-file writer changed (no {missing}); update nvcc_command")
    writer(**{k: v for k, v in wanted.items() if k in accepted})
    flags = {}
    with open(wanted["path"]) as build_file:
        for line in build_file:
            key, _, value = line.partition(" = ")
            if key in ("nvcc", "cuda_cflags", "cuda_post_cflags"):
                flags[key] = shlex.split(value.strip())
    if "nvcc" not in flags or "cuda_cflags" not in flags:
        raise RuntimeError(f"torch's build file {wanted['path']} has no nvcc rule")
    return [*flags["nvcc"], *flags["cuda_cflags"], "-c", str(source), "-o", str(output),
            *flags.get("cuda_post_cflags", [])]


def _build(kind: str) -> ModuleType:
    from torch.utils import cpp_extension

    if kind == "cuda":
        if cpp_extension.CUDA_HOME is None:
            raise ExtensionUnavailable("no CUDA toolkit found (set CUDA_HOME to the toolkit's root)")
        if torch.version.cuda is None:
            raise ExtensionUnavailable("this torch build has no CUDA support")
    build_dir = cache_dir() / MODULE_NAMES[kind]
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        build_directory=str(build_dir),
        verbose=bool(os.environ.get(VERBOSE_ENV)),
        **build_arguments(kind),
    )
