"""Throughput of the min-max codec (``bagua_algos.compression.minmax``) against a plain
copy of the same tensor, in the same run.

    python benchmarks/codec_benchmark.py [--numel 4194304] [--repeats 7] [--threads 1]
                                         [--chunks 4] [--device cpu]

For each bit width (1, 2, 4, 8) and rounding (nearest, stochastic) it times
``encode_chunks`` + ``decode_chunks`` of a float32 tensor cut into ``--chunks`` chunks
(as the algorithms do: one chunk per worker) and reports GB/s of float32 input
(numel × 4 bytes / seconds, median of ``--repeats``) and the ratio to ``x.clone()``
(a plain copy: read 4 bytes, write 4 bytes a value). Not a test: numbers depend on the
machine; the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    from bagua_algos.compression import minmax

    parser = argparse.ArgumentParser(prog="codec_benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)
    n = args.numel - args.numel % args.chunks
    x = torch.randn(n, generator=g, device=device)
    rows = x.view(args.chunks, -1)
    gb = n * 4 / 1e9
    copy_s = _time(lambda: x.clone(), args.repeats, sync)
    print(f"codec_benchmark: {n} float32 values ({gb * 1e3:.1f} MB) in {args.chunks} chunks, device {device}, "
          f"{args.threads} thread(s), torch {torch.__version__}, median of {args.repeats}")
    print(f"{'what':<28} {'GB/s':>8} {'ratio to copy':>14} {'encoded bytes':>14}")
    print(f"{'plain copy (x.clone())':<28} {gb / copy_s:8.3f} {1.0:14.3f} {n * 4:14d}")
    for bits in minmax.VALID_BITS:
        for stochastic in (False, True):
            gen = torch.Generator(device=device).manual_seed(1)
            size = minmax.encoded_size(n // args.chunks, bits) * args.chunks

            def round_trip():
                buf = minmax.encode_chunks(rows, bits, stochastic=stochastic, generator=gen)
                minmax.decode_chunks(buf, args.chunks)

            s = _time(round_trip, args.repeats, sync)
            label = f"{bits}-bit {'stochastic' if stochastic else 'nearest'} enc+dec"
            print(f"{label:<28} {gb / s:8.3f} {copy_s / s:14.3f} {size:14d}")


if __name__ == "__main__":
    main()
