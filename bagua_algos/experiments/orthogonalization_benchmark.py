"""Orthogonalization methods timed on PowerSGD's matrices: torch's QR, Gram–Schmidt and
cuda_ext's batched kernels on the factors of real steps.

Two sets of matrices:

- ``resnet18``: the P factors of one PowerSGD step of the CIFAR ResNet-18 at ranks 1,
  2, 4 and 8 (PowerSGD's usual ranks). A layer's gradient is viewed as shape[0] × (the rest) = n × m and P is
  n × r. Only layers PowerSGD compresses count (2-D or more, and compression rate
  n·m / ((n + m)·r) ≥ 2): conv1 (64×3×3×3), the 16 3×3 convolutions of layer1–layer4,
  the 3 1×1 shortcuts and fc (10×512), i.e. 21 matrices with 64, 128, 256, 512 or
  10 rows (at rank 8 fc's rate is 1.2, so 20 matrices); biases and batch-norm
  parameters are 1-D and not compressed.
- ``grid``: the thesis's Table 4.1 grid, one m × r matrix per shape,
  r ∈ {2, 4, …, 128}, m ∈ {256, 512, …, 4096}.

Methods (each returns orthonormal columns spanning the input):

- ``torch_loop``: torch's ``powerSGD_hook`` as it does it, one ``_orthogonalize`` call
  per layer (Gram–Schmidt for r ≤ 2, else ``torch.linalg.qr`` with ``out=``), in place;
- ``linalg_qr``: ``torch.linalg.qr`` batched over same-shape groups;
- ``cholesky_qr2``, ``gram_schmidt``: ``bagua_algos.compression.orthogonalization``,
  batched over same-shape groups;
- ``cuda_ext``: this project's compiled Householder QR, all matrices in one call (one
  kernel launch on CUDA, one parallel loop on CPU).

Reported: the median µs per call (the whole set) after warm-up, with
``torch.cuda.synchronize()`` around each call on CUDA, the ratio to ``torch_loop``
and the largest |QᵀQ − I| over the set (computed in float64 from a fresh input).
Runs on CUDA when available (builds the CUDA extension on first use), else CPU.

    python benchmarks/orthogonalization_benchmark.py                 # both sets
    python benchmarks/orthogonalization_benchmark.py --sets resnet18 --repeats 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch


from bagua_algos.compression import orthogonalization

EPSILON = 1e-8
METHODS = ("torch_loop", "linalg_qr", "cholesky_qr2", "gram_schmidt", "cuda_ext")

# CIFAR ResNet-18 parameter shapes with more than one dimension.
RESNET18_SHAPES = (
    [(64, 3, 3, 3)]
    + [(64, 64, 3, 3)] * 4
    + [(128, 64, 3, 3), (128, 128, 3, 3), (128, 64, 1, 1), (128, 128, 3, 3), (128, 128, 3, 3)]
    + [(256, 128, 3, 3), (256, 256, 3, 3), (256, 128, 1, 1), (256, 256, 3, 3), (256, 256, 3, 3)]
    + [(512, 256, 3, 3), (512, 512, 3, 3), (512, 256, 1, 1), (512, 512, 3, 3), (512, 512, 3, 3)]
    + [(10, 512)]
)
MIN_COMPRESSION_RATE = 2.0


def resnet18_p_shapes(rank: int) -> List[tuple]:
    """(n, r) of each compressed layer's P factor."""
    shapes = []
    for shape in RESNET18_SHAPES:
        n = shape[0]
        m = 1
        for s in shape[1:]:
            m *= s
        r = min(rank, n, m)
        if n * m >= MIN_COMPRESSION_RATE * (n + m) * r:
            shapes.append((n, r))
    return shapes


def grid_shapes() -> List[tuple]:
    return [(m, r) for r in (2, 4, 8, 16, 32, 64, 128) for m in (256, 512, 1024, 2048, 4096)]


# --- the methods: each takes a list of m × r matrices, returns the Q factors ----------
def torch_loop(matrices: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    for p in matrices:  # in place, one call per layer, as the hook's compute_qs does
        _orthogonalize(p.unsqueeze(0), EPSILON)
    return list(matrices)


def _grouped(method: str) -> Callable[[Sequence[torch.Tensor]], List[torch.Tensor]]:
    def run(matrices):
        return orthogonalization.orthogonalize(matrices, method, EPSILON)

    return run


def linalg_qr(matrices):
    return orthogonalization.orthogonalize(matrices, "torch_qr", EPSILON)


def cuda_ext_method(matrices):
    import cuda_ext

    return cuda_ext.orthogonalize(matrices, epsilon=EPSILON)


METHOD_FUNCTIONS: Dict[str, Callable] = {
    "torch_loop": torch_loop,
    "linalg_qr": linalg_qr,
    "cholesky_qr2": _grouped("cholesky_qr2"),
    "gram_schmidt": _grouped("gram_schmidt"),
    "cuda_ext": cuda_ext_method,
}


# --- measuring ------------------------------------------------------------------------
def make_inputs(shapes, device, seed=0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, r, generator=g).to(device) for m, r in shapes]


def orthonormality_error(qs) -> float:
    worst = 0.0
    for q in qs:
        q = q.double()
        eye = torch.eye(q.shape[1], dtype=torch.float64, device=q.device)
        worst = max(worst, (q.T @ q - eye).abs().max().item())
    return worst


def time_method(fn, shapes, device, warmup: int, repeats: int) -> Dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    error = orthonormality_error(fn(make_inputs(shapes, device)))
    work = make_inputs(shapes, device, seed=1)  # torch_loop overwrites it: same cost each time
    for _ in range(warmup):
        fn(work)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(work)
        sync()
        times.append(time.perf_counter() - start)
    return {"median_us": statistics.median(times) * 1e6, "error": error}


def available_methods(device, wanted) -> List[str]:
    methods = []
    for name in wanted:
        if name == "cuda_ext":
            import cuda_ext

            try:
                cuda_ext.load_orthogonalize(device)
            except cuda_ext.ExtensionUnavailable as error:
                print(f"# cuda_ext unavailable on {device}: {error}", file=sys.stderr)
                continue
        methods.append(name)
    return methods


def run_set(name, shape_sets, device, methods, warmup, repeats) -> List[dict]:
    rows = []
    for label, shapes in shape_sets:
        row = {"set": name, "case": label, "matrices": len(shapes)}
        for method in methods:
            row[method] = time_method(METHOD_FUNCTIONS[method], shapes, device, warmup, repeats)
        rows.append(row)
        print(format_row(row, methods), flush=True)
    return rows


def format_header(methods) -> str:
    cells = ["set", "case", "n"] + [f"{m} µs (×loop)" for m in methods] + ["max |QᵀQ−I| per method"]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def format_row(row, methods) -> str:
    base = row["torch_loop"]["median_us"] if "torch_loop" in row else None
    cells = [row["set"], row["case"], str(row["matrices"])]
    for m in methods:
        t = row[m]["median_us"]
        cells.append(f"{t:.0f} ({t / base:.2f}×)" if base else f"{t:.0f}")
    cells.append(" / ".join(f"{row[m]['error']:.1e}" for m in methods))
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sets", default="resnet18,grid", help="comma-separated: resnet18, grid")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ranks", default="1,2,4,8", help="ResNet-18 ranks")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per case (resnet18)")
    parser.add_argument("--grid-repeats", type=int, default=None, help="timed calls per grid case (default: --repeats)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_FUNCTIONS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; valid: {list(METHODS)}")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not set(sets) <= {"resnet18", "grid"}:
        parser.error(f"--sets must name resnet18 and/or grid, got {args.sets!r}")
    methods = available_methods(device, methods)
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# device: {device} ({what}); torch {torch.__version__}; epsilon {EPSILON}; "
          f"median of {args.repeats} calls after {args.warmup} warm-up calls")
    print(format_header(methods))
    rows = []
    if "resnet18" in sets:
        ranks = [int(r) for r in args.ranks.split(",")]
        cases = [(f"rank {r}", resnet18_p_shapes(r)) for r in ranks]
        rows += run_set("resnet18", cases, device, methods, args.warmup, args.repeats)
    if "grid" in sets:
        cases = [(f"{m}×{r}", [(m, r)]) for m, r in grid_shapes()]
        rows += run_set("grid", cases, device, methods, args.warmup, args.grid_repeats or args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "what": what, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
