"""The min-max codec's header, the one fact about a record's bytes that both of its
implementations write: :mod:`.minmax` (torch; its docstring has the whole layout) and
:mod:`.minmax_triton` (the CUDA kernels).

The header is little-endian ``<BBff``: the bit width, the tail, the min and the max. It
lives in a module of its own so that the kernels' module reads its size without
importing the codec, which imports the kernels' module when a CUDA tensor comes: the two
would otherwise import each other."""

from __future__ import annotations

import struct

__all__ = ["HEADER", "HEADER_BYTES"]

HEADER = struct.Struct("<BBff")
HEADER_BYTES = HEADER.size  # 10
