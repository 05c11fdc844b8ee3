"""Seed 004, TernGrad's study report: the 2-bit min-max codec's worked example (Figure
1) and its claim of negligible loss."""

from __future__ import annotations

import torch

from bagua_algos.experiments.reproduce.compare import compare
from bagua_algos.experiments.reproduce.output import print_table
from bagua_algos.experiments.reproduce.published import SEED004_EXAMPLE
from bagua_algos.experiments.reproduce.rows import Row
from bagua_algos.experiments.reproduce.settings import CODEC, NO_NETWORK


def seed004_fig1(ctx):
    """The report's worked example through the package's min-max codec."""
    import struct

    from bagua_algos.compression import HEADER_BYTES, decode, encode, encode_chunks

    ctx.header("the report's example: (-5, 2, -3, 7, -1, 5) and a padding 3 at 2 bits -> {2, 1, -5, 7, 39, 104}",
               "bagua_algos.compression.encode / encode_chunks (2 bits, nearest and stochastic)",
               "none (tests/test_minmax.py asserts the same bytes)")
    x = torch.tensor(SEED004_EXAMPLE)
    nearest = encode(x, 2)
    bits, tail, low, high = struct.unpack("<BBff", bytes(nearest[:HEADER_BYTES].tolist()))
    draws = 20000
    g = torch.Generator().manual_seed(0)
    rows_ = encode_chunks(x.expand(draws, len(x)), 2, stochastic=True, generator=g).view(draws, -1)
    payloads = [tuple(r) for r in rows_[:, HEADER_BYTES:].tolist()]
    share = sum(p == (39, 104) for p in payloads) / draws
    table = [
        ["header: bits, tail, min, max", "2, 1, -5, 7", f"{bits}, {tail}, {low:g}, {high:g}"],
        ["payload, nearest rounding", "39, 104 (says 2 -> 3)", f"{nearest[HEADER_BYTES:].tolist()} "
         "(2 -> 3; -3 and 5 are ties, sent to the even level)"],
        ["decoded, nearest", "", str(decode(nearest).tolist())],
        ["payload 39, 104 drawn stochastically", "one possible draw", f"{share:.4f} of {draws} draws (exact 3/16 = "
                                                                       f"{3 / 16:.4f})"],
        ["P(2 -> 3)", "0.75", f"{sum(p[0] >> 4 & 3 == 2 for p in payloads) / draws:.4f}"],
    ]
    print_table(["quantity", "seed", "ours"], table)
    print(f"\n   wrote {ctx.write_csv([dict(zip(('quantity', 'seed', 'ours'), r)) for r in table])}")


def seed004_codec(ctx):
    rows = [
        Row("unquantised (allreduce)", table_label="gradient_allreduce", seed={"claim": "baseline"}),
        Row("TernGrad codec, 8 bits", "terngrad", {"bits": 8}, seed={"claim": "-"}),
        Row("ByteGrad (8 bits, flat)", table_label="bytegrad_flat", seed={"claim": "-"}),
        Row("TernGrad codec, 2 bits, clip 2.5 sigma", table_label="terngrad", seed={"claim": "negligible loss"}),
        Row("TernGrad codec, 2 bits, unclipped", "terngrad", {"bits": 2}, seed={"claim": "negligible loss"}),
    ]
    compare(ctx, CODEC, rows, ["claim"], data_column=True, time_column=True,
            seed_text="none: the report describes the codec, not a training run ('negligible impact on accuracy')",
            differs="the seed has no run: our proxy is seed 001's (MNIST subset, MLP, 8 workers x 32, 20 epochs, "
                    "IID)" + NO_NETWORK)
