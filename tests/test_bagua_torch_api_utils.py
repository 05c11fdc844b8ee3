"""``bagua.torch_api.utils`` of the compatibility package: what Bagua's scripts and
its own tests import from it."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from bagua_algos.compat import compat_path


@pytest.fixture(scope="module")
def utils():
    sys.path.insert(0, compat_path())
    try:
        from bagua.torch_api import utils
        yield utils
    finally:  # leave no compat ``bagua`` behind for other files of this process
        sys.path.remove(compat_path())
        for name in [m for m in sys.modules if m == "bagua" or m.startswith("bagua.")]:
            del sys.modules[name]


def test_flatten_and_unflatten_round_trip(utils):
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.zeros(2, 2)]
    flat = utils.flatten(tensors)
    assert flat.shape == (11,) and torch.equal(flat[:7], torch.tensor([0.0, 1, 2, 3, 4, 5, 7]))
    for a, b in zip(utils.unflatten(flat, tensors), tensors):
        assert torch.equal(a, b)
    assert torch.equal(utils.get_flattened_tensor(tensors), flat)
    assert utils.get_flattened_tensor([]) is None


def test_apply_flattened_call_writes_back(utils):
    tensors = [torch.ones(2, 2), torch.full((3,), 2.0)]
    utils.apply_flattened_call(tensors, lambda flat, k: flat.mul_(k), extra_args=[3.0])
    assert torch.equal(tensors[0], torch.full((2, 2), 3.0)) and torch.equal(tensors[1], torch.full((3,), 6.0))
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(3)]
    utils.apply_flattened_call_all(mixed, lambda flat: flat.add_(1))
    assert all(torch.equal(t, torch.full_like(t, 2)) for t in mixed)


def test_check_contiguous_and_dtype_names(utils):
    base = torch.zeros(10)
    assert utils.check_contiguous([base[:4], base[4:]])
    assert not utils.check_contiguous([base[:4], base[5:]])
    assert [utils.to_bagua_datatype(d) for d in (torch.float32, torch.float16, torch.uint8, torch.long)] == \
        ["f32", "f16", "u8", "i64"]
    with pytest.raises(ValueError, match="unsupported data type torch.float64"):
        utils.to_bagua_datatype(torch.float64)


def test_average_by_removing_extreme_values_drops_warmup_and_outliers(utils):
    scores = [100.0] * 3 + [10.0, 10.5, 9.5, 10.0, 40.0, 10.0]  # a warm-up third, one outlier
    mean, std, kept = utils.average_by_removing_extreme_values(scores)
    assert kept == [10.0, 10.5, 9.5, 10.0, 10.0]
    assert mean == pytest.approx(10.0) and std == pytest.approx(np.std(kept))


def test_statistical_average_blends_a_new_value_into_every_window(utils, monkeypatch):
    """Bagua's own example (tests/torch_api/test_utils.py), its one-second sleep replaced
    by a clock that reads exactly one second later."""
    now = time.time()
    m = utils.StatisticalAverage(last_update_time=now - 1.0, records=[5.0, 4.5005175, 3.5034241850204078],
                                 record_tail=(2.0166309999999985, 2.499061185570463))
    monkeypatch.setattr(utils.time, "time", lambda: now)
    m.record(6.0)
    for seconds, mean in [(1.0, 6.0), (2.0, (6.0 + 5.0) / 2), (3.0, (6.0 + 4.5005175 * 2) / 3),
                          (5.0, (6.0 + 3.5034241850204078 * 4) / 5),
                          (7.0, (6.0 + 2.499061185570463 * (4.0 + 2.0166309999999985)) / 7)]:
        assert m.get_records_mean(seconds) == pytest.approx(mean, abs=0.1), seconds
    assert m.total_recording_time() == pytest.approx(4.0 + 2.0166309999999985 + 1, abs=0.1)
    assert m.get(0.0) == m.records[0] == pytest.approx(6.0, abs=0.01)
    empty = utils.StatisticalAverage()
    assert empty.get_records_mean(3.0) == 0.0 and empty.total_recording_time() == 0.0
