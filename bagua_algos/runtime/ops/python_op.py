"""Bagua's python op: a function of the bucket's name, run in the bucket's turn."""

from __future__ import annotations

__all__ = ["PythonOp"]


class PythonOp:
    """``python_function(bucket_name)``."""

    def __init__(self, python_function):
        self.python_function = python_function

    def __call__(self, bucket) -> None:
        self.python_function(bucket.name)
