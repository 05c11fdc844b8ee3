"""Bytes on the wire: a thread-safe per-process count of what this worker hands to
collectives and sends (what each collective counts: the package's documentation)."""

from __future__ import annotations

import threading

import torch


_sent = {"bytes": 0, "lock": threading.Lock()}


def _count(nbytes: int) -> None:
    """Add ``nbytes`` to this process's counter of bytes handed to the network."""
    with _sent["lock"]:
        _sent["bytes"] += int(nbytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


count_sent = _count  # (for a transport: it counts what its calls send, as comm's documentation says)


def bytes_sent() -> int:
    """Bytes this process has handed to collectives and sends since the last
    :func:`reset_bytes_sent` (what is counted: see the module's docstring)."""
    with _sent["lock"]:
        return _sent["bytes"]


def reset_bytes_sent() -> int:
    """Set the counter to 0; returns the count it had."""
    with _sent["lock"]:
        value, _sent["bytes"] = _sent["bytes"], 0
        return value
