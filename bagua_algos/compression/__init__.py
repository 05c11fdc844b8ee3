"""Gradient compression codecs: pure tensor functions, no communication."""

from .minmax import (
    HEADER_BYTES,
    VALID_BITS,
    decode,
    decode_chunks,
    encode,
    encode_chunks,
    encoded_size,
    marked,
)

__all__ = [
    "HEADER_BYTES",
    "VALID_BITS",
    "decode",
    "decode_chunks",
    "encode",
    "encode_chunks",
    "encoded_size",
    "marked",
]
