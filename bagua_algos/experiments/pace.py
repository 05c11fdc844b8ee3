"""The hot paths' speed figures in one run, as ratios, on the device this process finds.

    python benchmarks/pace.py                 # the full sizes (meant for a GPU)
    python benchmarks/pace.py --quick         # small sizes: a few minutes on a CPU
    python benchmarks/pace.py --device cpu --sections ws1,codec

One process, a process group of one (NCCL on CUDA, gloo on CPU). Every ratio has its
anchor measured in this process, interleaved with it; the header names the device.

Sections (``--sections``, all by default):

- ``powersgd``: our PowerSGD step against torch's ``powerSGD_hook`` at ranks 1, 2, 4,
  8 on the CIFAR ResNet-18 and on ResNet-50 (``powersgd_benchmark.bench_compress``:
  DDP's 25 MB buckets, error feedback and warm start; ratio ours / torch, < 1 faster);
- ``orth``: cuda_ext on ResNet-50's set of P factors at ranks 1 … 8, all in one call,
  against one ``torch.linalg.qr`` call on the largest of them; and every shape of the
  thesis's Table 4.1 grid (one m × r matrix) against ``torch.linalg.qr`` on it, for
  cuda_ext and for what PowerSGD's ``"auto"`` picks (ratio < 1: faster than the anchor);
- ``codec``: the min-max codec's 8-bit encode + decode (the runtime's form) against a
  copy of the same tensor (``codec_benchmark``; ratio copy time / codec time);
- ``ws1``: Bagua's synthetic benchmark at world size 1 (Bagua's defaults for every
  algorithm: SGD at lr 0.01, ``qadam`` on its ``QAdamOptimizer`` inside its warm-up),
  every algorithm's images/s against ``gradient_allreduce``'s and
  ``gradient_allreduce``'s against torch DDP's; blocks of steps interleaved over rounds,
  the ratio is the median of the rounds' ratios. Model: ResNet-50 at 224×224, batch 32
  (``--ws1-model``, ``--ws1-image``, ``--ws1-batch``).

The goals: PowerSGD ratio < 1 at every rank; cuda_ext's P set < 1× one
``linalg.qr`` call and no grid shape > 1× for "auto"; every algorithm ≥ 0.95×
``gradient_allreduce`` and ``gradient_allreduce`` ≥ 0.98× DDP at world size 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path


import torch

SECTIONS = ("powersgd", "orth", "codec", "ws1")
WS1_CONFIGS = ("ddp", "gradient_allreduce", "bytegrad", "async", "decentralized",
               "low_precision_decentralized", "qadam")
GRID_M = (256, 512, 1024, 2048, 4096)
GRID_R = (2, 4, 8, 16, 32, 64, 128)


def _say(text: str = "") -> None:
    print(text, flush=True)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    from bagua_algos.experiments.codec_benchmark import device_name as cpu_name

    return f"CPU {cpu_name(device)}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s)"


def _sync(device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _interleaved(fns: dict, repeats: int, sync) -> dict:
    """Median seconds per call of each function, the functions taking turns."""
    for fn in fns.values():
        fn()
    sync()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


# ----------------------------------------------------------------------------- PowerSGD
def section_powersgd(device, quick: bool) -> list[dict]:
    from bagua_algos.experiments.powersgd_benchmark import bench_compress

    models = ("cifar_resnet18",) if quick else ("cifar_resnet18", "resnet50")
    ranks = (1, 2) if quick else (1, 2, 4, 8)
    steps, warmup = (3, 1) if quick else (15, 3)
    rows = []
    _say(f"## PowerSGD: our step / torch's powerSGD_hook (median of {steps} steps; < 1: ours faster)")
    for model in models:
        for row in bench_compress(ranks, steps, warmup, device, model):
            row["what"], row["model"] = "powersgd", model
            rows.append(row)
            _say(f"powersgd {model:<15} rank {row['rank']}: ours {row['ours_ms']:8.2f} ms, torch "
                 f"{row['torch_ms']:8.2f} ms, ratio {row['ratio']:.3f} (vs torch batched {row['ratio_batched']:.3f})")
    return rows


# ----------------------------------------------------------------------- orthogonalization
def resnet50_p_shapes(rank: int) -> list[tuple]:
    """(n, r) of the P factor of every ResNet-50 layer PowerSGD compresses at ``rank``
    (compression rate >= 2, as PowerSGD's plan decides)."""
    import torchvision

    shapes = [p.shape for p in torchvision.models.resnet50().parameters() if p.dim() > 1]
    out = []
    for shape in shapes:
        n, m = shape[0], shape.numel() // shape[0]
        r = min(rank, n, m)
        if n * m >= 2.0 * (n + m) * r:
            out.append((n, r))
    return out


def section_orth(device, quick: bool) -> list[dict]:
    import cuda_ext
    from bagua_algos.compression import orthogonalization

    sync = _sync(device)
    repeats = 5 if quick else 50
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        cuda_ext.load_orthogonalize(device)
        have_ext = True
    except cuda_ext.ExtensionUnavailable as error:
        _say(f"# cuda_ext unavailable on {device}: {error}")
        have_ext = False
    ranks = (1, 4) if quick else (1, 2, 4, 8)
    _say(f"## cuda_ext: ResNet-50's P set in one call / one torch.linalg.qr call on its largest P "
         f"(median of {repeats}; < 1: the whole set is faster than one linalg.qr call)")
    for rank in ranks:
        shapes = resnet50_p_shapes(rank)
        mats = [torch.randn(n, r, generator=g).to(device) for n, r in shapes]
        big = max(mats, key=lambda t: t.numel()).clone()
        fns = {"qr_one": lambda: torch.linalg.qr(big)}
        if have_ext:
            fns["ext_set"] = lambda: cuda_ext.orthogonalize(mats, epsilon=1e-8)
        t = _interleaved(fns, repeats, sync)
        row = {"what": "resnet50_p_set", "rank": rank, "matrices": len(mats),
               "qr_one_us": 1e6 * t["qr_one"], "largest": tuple(big.shape)}
        if have_ext:
            row["ext_set_us"] = 1e6 * t["ext_set"]
            row["ratio"] = t["ext_set"] / t["qr_one"]
        rows.append(row)
        _say(f"orth resnet50 P set rank {rank} ({len(mats)} matrices): one linalg.qr {tuple(big.shape)} "
             f"{row['qr_one_us']:.0f} µs" + (f", cuda_ext set {row['ext_set_us']:.0f} µs, ratio {row['ratio']:.3f}"
                                               if have_ext else ""))
    grid_m = (256, 4096) if quick else GRID_M
    grid_r = (2, 16, 128) if quick else GRID_R
    _say(f"## Table 4.1 grid: one m × r matrix, time / torch.linalg.qr's (median of {repeats}; > 1: slower)")
    for r in grid_r:
        for m in grid_m:
            x = torch.randn(m, r, generator=g).to(device)
            method = orthogonalization._resolve("auto", {device}, r)  # what PowerSGD would run
            fns = {"qr": lambda: torch.linalg.qr(x),
                   "auto": lambda: orthogonalization.orthogonalize([x], "auto", 1e-8)}
            if have_ext:
                fns["ext"] = lambda: cuda_ext.orthogonalize([x], epsilon=1e-8)
            t = _interleaved(fns, repeats, sync)
            row = {"what": "grid", "m": m, "r": r, "qr_us": 1e6 * t["qr"], "auto": method,
                   "auto_ratio": t["auto"] / t["qr"]}
            if have_ext:
                row["ext_ratio"] = t["ext"] / t["qr"]
            rows.append(row)
            _say(f"orth grid {m:>4}×{r:<3}: linalg.qr {row['qr_us']:8.0f} µs, auto ({method}) "
                 f"{row['auto_ratio']:.2f}×" + (f", cuda_ext {row['ext_ratio']:.2f}×" if have_ext else ""))
    return rows


# ----------------------------------------------------------------------------- the codec
def section_codec(device, quick: bool) -> list[dict]:
    from bagua_algos.experiments.codec_benchmark import _time_against
    from bagua_algos.compression import minmax

    n = 2**20 if quick else 2**24
    chunks = 8
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    rows_view = x.view(chunks, -1)

    def round_trip():
        buf = minmax.encode_chunks(rows_view, 8, non_finite="mark")
        minmax.decode_chunks(buf, chunks, bits=8, numel=n // chunks)

    _, _, ratio = _time_against(round_trip, lambda: x.clone(), 5 if quick else 15, _sync(device))
    _say(f"## codec: 8-bit encode + decode of {n} float32 values / a copy (ratio copy time / codec time; "
         f"1: as fast as a copy)")
    _say(f"codec 8-bit nearest: {ratio:.3f}")
    return [{"what": "codec", "numel": n, "ratio_copy_over_codec": ratio}]


# ------------------------------------------------------------- world size 1, Bagua's benchmark
def _ws1_model(name: str, image: int, device):
    torch.manual_seed(0)
    if name == "mlp":
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * image * image, 256), torch.nn.ReLU(),
                                   *[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())],
                                   torch.nn.Linear(256, 1000)).to(device)
    import torchvision

    return getattr(torchvision.models, name)(num_classes=1000).to(device)


def _ws1_wrap(config: str, args, device):
    from bagua_algos.runtime.algorithm import GlobalAlgorithmRegistry
    from bagua_algos.algorithms import QAdamAlgorithm, QAdamOptimizer

    model = _ws1_model(args.ws1_model, args.ws1_image, device)
    if config == "qadam":  # Bagua's script: lr/10 and a warm-up it never leaves here
        optimizer = QAdamOptimizer(model.parameters(), lr=0.001, warmup_steps=10**9)
        model.with_bagua([optimizer], QAdamAlgorithm(optimizer))
        return model, optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if config == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model), optimizer
    model.with_bagua([optimizer], GlobalAlgorithmRegistry.get(config)())
    return model, optimizer


def section_ws1(device, args) -> list[dict]:
    import torch.nn.functional as F

    sync = _sync(device)
    data = torch.randn(args.ws1_batch, 3, args.ws1_image, args.ws1_image, device=device)
    target = torch.randint(0, 1000, (args.ws1_batch,), device=device)
    wrapped = {c: _ws1_wrap(c, args, device) for c in WS1_CONFIGS}

    def block(config):
        model, optimizer = wrapped[config]
        sync()
        start = time.perf_counter()
        for _ in range(args.ws1_steps):
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        sync()
        return time.perf_counter() - start

    for config in WS1_CONFIGS:  # warm-up (cudnn's autotuning, first allocations)
        block(config)
    times = {c: [] for c in WS1_CONFIGS}
    for r in range(args.ws1_rounds):
        for config in (WS1_CONFIGS if r % 2 == 0 else WS1_CONFIGS[::-1]):
            times[config].append(block(config))
    for config, (model, _) in wrapped.items():
        if config != "ddp":
            abort = getattr(model.bagua_algorithm, "abort", None)
            if abort is not None:
                abort(model)
            model.bagua_ddp.detach()
    images = args.ws1_batch * args.ws1_steps
    rows = []
    _say(f"## world size 1, Bagua's synthetic benchmark: {args.ws1_model} {args.ws1_image}×{args.ws1_image}, batch "
         f"{args.ws1_batch}, {args.ws1_rounds} rounds of {args.ws1_steps} steps per config, interleaved; ratio = "
         f"median over rounds of the images/s ratio")
    for config in WS1_CONFIGS:
        anchor = "ddp" if config == "gradient_allreduce" else "gradient_allreduce"
        if config == "ddp":
            anchor = None
        ips = statistics.median(images / t for t in times[config])
        row = {"what": "ws1", "config": config, "images_per_s": ips}
        text = f"ws1 {config:<28} {ips:9.1f} img/s"
        if anchor is not None:
            row["anchor"] = anchor
            row["ratio"] = statistics.median(a / t for t, a in zip(times[config], times[anchor]))
            text += f"  vs {anchor}: {row['ratio']:.3f}"
        rows.append(row)
        _say(text)
    return rows


# --------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (a CPU in minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (default 1)")
    parser.add_argument("--ws1-model", default=None, help="resnet50 (default; mlp with --quick on a CPU), any "
                        "torchvision model or mlp")
    parser.add_argument("--ws1-image", type=int, default=None, help="image size (default 224; 32 with --quick)")
    parser.add_argument("--ws1-batch", type=int, default=32)
    parser.add_argument("--ws1-steps", type=int, default=None, help="steps per timed block (default 20; 5 quick)")
    parser.add_argument("--ws1-rounds", type=int, default=None, help="rounds (default 10; 3 quick)")
    parser.add_argument("--json", default=None, help="also write every row here")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        parser.error(f"--sections: unknown {bad}; valid: {list(SECTIONS)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    small = args.quick and device.type == "cpu"
    args.ws1_model = args.ws1_model or ("mlp" if small else "resnet50")
    args.ws1_image = args.ws1_image or (32 if small else 224)
    args.ws1_steps = args.ws1_steps or (5 if args.quick else 20)
    args.ws1_rounds = args.ws1_rounds or (3 if args.quick else 10)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(args.threads)
    from bagua_algos.runtime import comm
    from bagua_algos.experiments.powersgd_benchmark import _one_process_group

    _say(f"pace: device {device_name(device)}; torch {torch.__version__}; python {platform.python_version()}; "
         f"host {platform.node()}; sections {sections}{'; quick' if args.quick else ''}")
    _say("pace: command: " + " ".join(["python", "benchmarks/pace.py", *(argv if argv is not None else sys.argv[1:])]))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _one_process_group(tmp, device)
        try:
            if "powersgd" in sections:
                rows += section_powersgd(device, args.quick)
            if "orth" in sections:
                rows += section_orth(device, args.quick)
            if "codec" in sections:
                rows += section_codec(device, args.quick)
            if "ws1" in sections:
                rows += section_ws1(device, args)
        finally:
            comm.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name(device), "torch": torch.__version__, "rows": rows}, f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
