"""Checkpoint files (bagua_algos/runtime/checkpoint.py) in one process: atomic writes,
invalid files detected by their checksum, and resume_from_checkpoint falling back to
the newest valid checkpoint with one warning, or a clear error when none is valid."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from bagua_algos.runtime import checkpoint
from bagua_algos.runtime.checkpoint import (CheckpointError, load_checkpoint, resume_from_checkpoint,
                                            save_checkpoint)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _saved(tmp_path, iterations=(1, 2)):
    for it in iterations:
        model = _model(it)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        save_checkpoint(it, str(tmp_path), model, opt)
    return tmp_path


def _file(tmp_path, it):
    return checkpoint._rank_file(str(tmp_path), it, 0)


def _resume(tmp_path):
    model = _model(99)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iteration = resume_from_checkpoint(str(tmp_path), model, opt)
    return iteration, model, [str(w.message) for w in caught]


def test_resume_loads_the_newest_checkpoint_and_starts_fresh_without_one(tmp_path):
    assert _resume(tmp_path / "none")[0] == 0
    _saved(tmp_path)
    iteration, model, messages = _resume(tmp_path)
    assert iteration == 2 and messages == []
    assert torch.equal(model.weight, torch.load(_file(tmp_path, 2), weights_only=True)["model"]["weight"])
    assert sorted(os.listdir(tmp_path / "iter_0000002")) == [
        "bagua_rank_00000_states.pt", "bagua_rank_00000_states.pt.sha256",
        "mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt.sha256"]


@pytest.mark.parametrize("damage", ["truncate", "flip_a_byte", "drop_checksum"])
def test_an_invalid_newest_file_falls_back_with_one_warning_naming_it(tmp_path, damage):
    _saved(tmp_path)
    path = _file(tmp_path, 2)
    data = open(path, "rb").read()
    if damage == "truncate":
        open(path, "wb").write(data[: len(data) // 2])
    elif damage == "flip_a_byte":
        open(path, "wb").write(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        os.remove(path + ".sha256")
    iteration, model, messages = _resume(tmp_path)
    assert iteration == 1
    assert torch.equal(model.weight, torch.load(_file(tmp_path, 1), weights_only=True)["model"]["weight"])
    assert len(messages) == 1 and path in messages[0] and "resuming from iteration 1" in messages[0]
    with pytest.raises(CheckpointError, match="bagua_rank_00000_states.pt is invalid"):
        load_checkpoint(str(tmp_path), _model(0))


def test_no_valid_checkpoint_is_an_error_naming_every_file(tmp_path):
    _saved(tmp_path)
    for it in (1, 2):
        open(_file(tmp_path, it), "ab").write(b"x")
    with pytest.raises(CheckpointError, match=r"no valid checkpoint .*iter_0000002.*truncated or extended.*iter_0000001"):
        _resume(tmp_path)


def test_a_kill_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    _saved(tmp_path, (1,))
    before = open(_file(tmp_path, 1), "rb").read()
    real_save = torch.save

    def killed(obj, f, *args, **kwargs):  # the process dies halfway through writing
        f.write(b"PK\x03\x04 half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(1, str(tmp_path), _model(5))  # over the same iteration
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(2, str(tmp_path), _model(5))  # a new one: the tracker must not move
    monkeypatch.setattr(torch, "save", real_save)
    assert open(_file(tmp_path, 1), "rb").read() == before
    assert not [n for d, _, names in os.walk(tmp_path) for n in names if ".tmp." in n]
    assert _resume(tmp_path)[:1] == (1,) and _resume(tmp_path)[2] == []
