"""Throughput of the min-max codec (``bagua_algos.compression.minmax``) against a plain
copy of the same tensor, in the same run.

    python benchmarks/codec_benchmark.py [--numel 16777216] [--chunks 8] [--repeats 7]
                                         [--threads 1] [--device cpu] [--validated]

For each bit width (1, 2, 4, 8) and rounding (nearest, stochastic) it times
``encode_chunks`` + ``decode_chunks`` of a float32 tensor cut into ``--chunks`` chunks
(as the algorithms do: one chunk per worker; the defaults are 8 chunks of 2^21 values)
and reports GB/s of float32 input (numel × 4 bytes / seconds, median of ``--repeats``)
against ``x.clone()`` of the same tensor (a plain copy: read 4 bytes, write 4 bytes a
value, into newly allocated memory as the codec's outputs are), timed alternately with
it: the ratio is the median of the rounds' copy time / codec time (1.0: as fast as
the copy).
An encode + decode moves about 1.75× a copy's bytes at 8 bits (the input read twice,
for the min/max and for the quantization, the values written once, the payload written
and read), so by memory traffic alone 0.57 would be its ceiling; both sides also pay
the page faults of freshly allocated outputs (the decode's is the copy's size), which
shift real figures either way. The codec runs as the runtime calls it: ``non_finite="mark"`` and
the decode given ``bits``/``numel``, so nothing waits for the device;
``--validated`` times the default forms instead (on CUDA one host synchronisation for
each: the finiteness check and the headers read back). On CUDA the codec runs its
Triton kernels (``BAGUA_MINMAX_TRITON=0``: the torch path). Not a test: numbers depend
on the machine; the ratio is what to compare.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def _time_against(fn, baseline, repeats: int, sync):
    """Median seconds of ``fn`` and of ``baseline``, timed alternately (one of each per
    round), and the median of the per-round ratios baseline / fn: a machine whose load
    drifts during the run slows both sides of a round alike."""
    def once(f):
        start = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - start

    fn(), baseline()  # warm-up (and, on CUDA, the kernels' compilation)
    sync()
    mine, base = [], []
    for _ in range(repeats):
        base.append(once(baseline))
        mine.append(once(fn))
    ratio = statistics.median(b / m for b, m in zip(base, mine))
    return statistics.median(mine), statistics.median(base), ratio


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> None:
    from bagua_algos.compression import minmax

    parser = argparse.ArgumentParser(prog="codec_benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8 * 2**21)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--validated", action="store_true",
                        help="time the default forms (finiteness check, headers read back)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator(device=device).manual_seed(0)
    n = args.numel - args.numel % args.chunks
    per_chunk = n // args.chunks
    x = torch.randn(n, generator=g, device=device)
    rows = x.view(args.chunks, -1)
    gb = n * 4 / 1e9
    copy = lambda: x.clone()  # noqa: E731
    kernels = "torch"
    if device.type == "cuda":
        kernels = "triton" if minmax._kernels(x) is not None else "torch (no Triton)"
    threads = f", {args.threads} thread(s)" if device.type == "cpu" else ""
    print(f"codec_benchmark: {n} float32 values ({gb * 1e3:.1f} MB) in {args.chunks} chunks of {per_chunk}, "
          f"device {device} ({device_name(device)}){threads}, codec path {kernels}, "
          f"{'validated' if args.validated else 'runtime'} forms, torch {torch.__version__}, median of {args.repeats}")
    print(f"{'what':<28} {'GB/s':>8} {'copy GB/s':>10} {'ratio to copy':>14} {'encoded bytes':>14}")
    for bits in minmax.VALID_BITS:
        for stochastic in (False, True):
            gen = torch.Generator(device=device).manual_seed(1)
            size = minmax.encoded_size(per_chunk, bits) * args.chunks

            if args.validated:
                def round_trip():
                    buf = minmax.encode_chunks(rows, bits, stochastic=stochastic, generator=gen)
                    minmax.decode_chunks(buf, args.chunks)
            else:
                def round_trip():
                    buf = minmax.encode_chunks(rows, bits, stochastic=stochastic, generator=gen, non_finite="mark")
                    minmax.decode_chunks(buf, args.chunks, bits=bits, numel=per_chunk)

            s, copy_s, ratio = _time_against(round_trip, copy, args.repeats, sync)
            label = f"{bits}-bit {'stochastic' if stochastic else 'nearest'} enc+dec"
            print(f"{label:<28} {gb / s:8.3f} {gb / copy_s:10.3f} {ratio:14.3f} {size:14d}")


if __name__ == "__main__":
    main()
