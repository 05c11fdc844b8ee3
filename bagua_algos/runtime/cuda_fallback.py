"""CPU stand-ins for the CUDA stream and event calls that Bagua's own code makes.

Bagua's algorithm files call ``torch.cuda.Event()``, ``torch.cuda.current_stream()
.record_event(...)``, ``event.synchronize()``, ``torch.cuda.synchronize()`` and
``torch.cuda.Stream(...)`` unconditionally: on a machine without a GPU each raises.
Work on CPU runs in program order, so there these calls have nothing to order and
:func:`install` makes them no-ops. It changes nothing when CUDA is available, and is
installed only by the Bagua compatibility package (``import bagua``), never by
``bagua_algos`` itself.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["install", "installed"]

_installed = False


class CpuEvent:
    """``torch.cuda.Event`` without a GPU: always complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class CpuStream:
    """``torch.cuda.Stream`` without a GPU: work is already in program order."""

    cuda_stream = 0

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, event=None):
        return event if event is not None else CpuEvent()

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def installed() -> bool:
    return _installed


def install() -> None:
    """Make torch.cuda's stream and event calls no-ops when CUDA is unavailable."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    _installed = True
    torch.cuda.Event = CpuEvent
    torch.cuda.Stream = CpuStream
    torch.cuda.current_stream = lambda device=None: CpuStream()
    torch.cuda.default_stream = lambda device=None: CpuStream()
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
