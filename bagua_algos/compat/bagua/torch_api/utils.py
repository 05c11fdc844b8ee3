"""``bagua.torch_api.utils``: Bagua 0.9's helpers that scripts and Bagua's own tests
import (flattening, a flattened collective, dtype names, and the time-weighted
average of its autotuner's scores)."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from bagua_algos.runtime import comm

flatten = torch._utils._flatten_dense_tensors
unflatten = torch._utils._unflatten_dense_tensors

_BAGUA_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.long: "i64"}


def apply_flattened_call(bucket, call, extra_args=None) -> None:
    """``call(flat, *extra_args)`` on the tensors of ``bucket`` packed in one buffer,
    then the buffer copied back into them. With ``call`` torch.distributed's
    ``all_reduce`` the sum is divided by the world size (an average)."""
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    if call is torch.distributed.all_reduce:  # recognised, not called: the sum becomes a mean
        flat /= comm.get_world_size()
    for tensor, value in zip(bucket, unflatten(flat, bucket)):
        tensor.copy_(value)


def apply_flattened_call_all(tensors, call) -> None:
    """:func:`apply_flattened_call` once per tensor type (dtype and device) of ``tensors``."""
    by_type = {}
    for tensor in tensors:
        by_type.setdefault(tensor.type(), []).append(tensor)
    for group in by_type.values():
        apply_flattened_call(group, call)


def check_contiguous(tensors) -> bool:
    """Whether each tensor's storage starts where the previous one's ends."""
    end = None
    for tensor in tensors:
        if end is not None and tensor.data_ptr() != end:
            return False
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return True


def get_flattened_tensor(tensors: list) -> torch.Tensor | None:
    """A new 1-D tensor with the values of ``tensors`` one after another (the first's
    dtype and device); None for no tensors."""
    if not tensors:
        return None
    return torch.cat([t.reshape(-1).to(tensors[0].dtype) for t in tensors])


def to_bagua_datatype(datatype) -> str:
    """Bagua's name of a torch dtype: f32, f16, u8 or i64."""
    try:
        return _BAGUA_DTYPES[datatype]
    except KeyError:
        raise ValueError(f"unsupported data type {datatype}; Bagua names {list(_BAGUA_DTYPES)}") from None


def average_by_removing_extreme_values(raw_score_list):
    """(mean, std, kept scores) of the last two thirds of ``raw_score_list`` (the first
    third is warm-up), after dropping the scores more than one standard deviation from
    the mean, again while the spread exceeds the mean (at most ten more times)."""
    scores = np.asarray(raw_score_list)
    scores = scores[len(scores) // 3:]

    def within_one_sigma(values):
        kept = values[np.abs(values - np.mean(values)) < np.std(values)]
        return kept if len(kept) else values

    scores = within_one_sigma(scores)
    for _ in range(10):
        if np.std(scores) < np.mean(scores):
            break
        scores = within_one_sigma(scores)
    return np.mean(scores), np.std(scores), scores.tolist()


class StatisticalAverage:
    """The mean of a value over recent windows of time, kept in O(log T) numbers.

    ``records[i]`` is the mean over the 2^i seconds that end at ``last_update_time``;
    ``record_tail = (seconds, mean)`` covers the recorded time beyond the last record.
    A mean over another span is interpolated linearly between the two windows around
    it. :meth:`record` takes a value that held since the last update.
    """

    def __init__(self, last_update_time: float | None = None, records: list | None = None,
                 record_tail: tuple = (0.0, 0.0)) -> None:
        self.last_update_time = time.time() if last_update_time is None else last_update_time
        self.records = list(records) if records is not None else []
        self.record_tail = tuple(record_tail)

    def record_seconds(self) -> float:
        """The span of the longest record (2^(len − 1) s), 0 with none."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """The mean over the last ``last_n_seconds`` up to ``last_update_time``."""
        if last_n_seconds <= 0.0:
            return 0.0
        tail_seconds, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        if last_n_seconds < 1.0:
            return self.records[0]
        span = self.record_seconds()
        if last_n_seconds <= span:
            k = max(0, math.floor(math.log2(last_n_seconds)))
            if k + 1 >= len(self.records):
                return self.records[k]
            lo = 2.0 ** k
            return _interpolate(last_n_seconds, lo, self.records[k], 2.0 * lo, self.records[k + 1])
        if last_n_seconds <= span + tail_seconds:
            return _interpolate(last_n_seconds, span, self.records[-1], span + tail_seconds, tail_mean)
        return tail_mean

    def record(self, val: float) -> None:
        """``val`` held from ``last_update_time`` until now: every window's mean moves."""
        now = time.time()
        elapsed = now - self.last_update_time
        recorded = self.total_recording_time()
        records, tail = [], (0.0, 0.0)
        for i in range(64):
            window = 2.0 ** i
            if window <= elapsed:  # the window is all new value
                records.append(val)
            elif window <= elapsed + recorded:  # new value, then older history
                share = elapsed / window
                records.append(val * share + self.get_records_mean(window - elapsed) * (1.0 - share))
            else:  # beyond the windows: what is left of the history is the tail
                total = elapsed + recorded
                share = elapsed / total if total > 0 else 1.0
                tail = (total - 2.0 ** (len(records) - 1),
                        val * share + self.get_records_mean(recorded) * (1.0 - share))
                break
        self.last_update_time, self.records, self.record_tail = now, records, tail

    def get(self, last_n_seconds: float) -> float:
        """The mean over the last ``last_n_seconds`` up to now (the value last recorded
        holds since ``last_update_time``)."""
        since = time.time() - self.last_update_time
        if last_n_seconds <= since:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - since)

    def __str__(self) -> str:
        return str({"last_update_time": self.last_update_time, "records": self.records,
                    "record_tail": self.record_tail})


def _interpolate(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
