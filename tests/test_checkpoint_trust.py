"""Checkpoints are data and never lose or hide state (bagua_algos/runtime/checkpoint.py):
a pickled payload is refused unless the caller opts in, and its code never runs; a state
that does not fit the model is refused before anything is written into it; a killed
save's temporary files are removed by the next save or resume; the first rank's state is
serialised once; a bad tracker or checksum file falls back to the newest valid iteration
on disk, never to a fresh start while one exists."""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings

import pytest
import torch

from bagua_algos.runtime import checkpoint
from bagua_algos.runtime.checkpoint import (CheckpointError, CheckpointMismatchError, UntrustedCheckpointError,
                                            load_checkpoint, resume_from_checkpoint, save_checkpoint)



def _model(seed, out=3):
    torch.manual_seed(seed)
    return torch.nn.Linear(4, out)


def _saved(root, iterations=(1, 2)):
    for it in iterations:
        model = _model(it)
        save_checkpoint(it, str(root), model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return root


def _call(loader, root, model, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        iteration = loader(str(root), model, **kwargs)
    return iteration, [str(w.message) for w in caught]


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- pickled code


class _Payload:
    """Unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_payload(root, iteration, marker):
    """Replace the iteration's files by a state carrying a payload, with matching
    checksum files (whoever writes a file can write its checksum)."""
    directory = checkpoint._iteration_dir(str(root), iteration)
    state = {"iteration": iteration, "world_size": 1, "model": _model(7).state_dict(), "extra": _Payload(marker)}
    for name in ("bagua_rank_00000_states.pt", checkpoint.FIRST_RANK_FILE):
        path = os.path.join(directory, name)
        torch.save(state, path + ".new")
        data = open(path + ".new", "rb").read()
        os.replace(path + ".new", path)
        record = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "world_size": 1}
        with open(path + ".sha256.new", "w") as f:
            json.dump(record, f)
        os.replace(path + ".sha256.new", path + ".sha256")


@pytest.mark.parametrize("loader", [load_checkpoint, resume_from_checkpoint])
def test_a_pickled_payload_is_refused_and_its_code_never_runs(tmp_path, loader, monkeypatch):
    monkeypatch.delenv(checkpoint.TRUST_PICKLE_ENV, raising=False)
    root, marker = _saved(tmp_path / "ck"), tmp_path / "marker"
    _plant_payload(root, 2, marker)
    model = _model(0)
    before = _snapshot(model)
    with pytest.raises(UntrustedCheckpointError, match=r"posix\.system.*trust_pickle=True.*BAGUA_ALGOS_TRUST_PICKLE=1"):
        _call(loader, root, model)
    assert not marker.exists() and _unchanged(model, before)
    assert not marker.exists()


def test_the_payload_runs_only_when_the_caller_trusts_the_file(tmp_path, monkeypatch):
    root, marker = _saved(tmp_path / "ck"), tmp_path / "marker"
    _plant_payload(root, 2, marker)
    assert _call(load_checkpoint, root, _model(0), trust_pickle=True)[0] == 2 and marker.exists()
    marker.unlink()
    monkeypatch.setenv(checkpoint.TRUST_PICKLE_ENV, "1")
    assert _call(resume_from_checkpoint, root, _model(0))[0] == 2 and marker.exists()
    monkeypatch.setenv(checkpoint.TRUST_PICKLE_ENV, "maybe")
    with pytest.raises(ValueError, match="BAGUA_ALGOS_TRUST_PICKLE must be 1, true, yes"):
        _call(load_checkpoint, root, _model(0))


def test_every_algorithms_state_loads_as_data():
    """The types a checkpoint holds load under weights_only=True: the state of an
    algorithm with generators, tensors in nested dicts and lists, and a scheduler."""
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "lr_scheduler": scheduler.state_dict(),
             "bagua": {"algorithm": "RelayAlgorithm", "world_size": 2, "bagua_train_step_counter": 3,
                       "algorithm_state": {"generator": [torch.Generator().get_state()], "received_counts": {"0": 1.0},
                                           "last_counts": [[1, 2]], "dropped": 0},
                       "bucket_state": {"b": {"relay_received": {0: torch.zeros(3)}, "flag": True}}}}
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = checkpoint._torch_load(buffer, "state", trust_pickle=False)
    assert torch.equal(loaded["model"]["weight"], model.weight) and loaded["bagua"]["bucket_state"]["b"]["flag"]


# --------------------------------------------------- a state that does not fit


@pytest.mark.parametrize("loader", [load_checkpoint, resume_from_checkpoint])
def test_a_model_of_other_shapes_is_refused_before_anything_is_written(tmp_path, loader):
    root = _saved(tmp_path)
    model = _model(0, out=5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _snapshot(model)
    with pytest.raises(CheckpointMismatchError, match=r"nothing was loaded.*'weight' has shape \(3, 4\), this model's \(5, 4\)"):
        _call(loader, root, model, optimizer=optimizer)
    assert _unchanged(model, before) and optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize("loader", [load_checkpoint, resume_from_checkpoint])
def test_an_optimizer_of_other_groups_is_refused_before_the_model_is_written(tmp_path, loader):
    root = _saved(tmp_path)
    model = _model(0)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    before = _snapshot(model)
    with pytest.raises(CheckpointMismatchError, match=r"parameter groups of \[2\] parameters, this one of \[1, 1\]"):
        _call(loader, root, model, optimizer=optimizer)
    assert _unchanged(model, before)


def test_a_part_that_fails_past_the_checks_puts_back_what_was_loaded(tmp_path):
    """A StepLR's state given to a LambdaLR passes the checks (a dict) and fails in
    its load_state_dict, after the model and optimizer were loaded: they are put back."""
    model = _model(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(1, str(tmp_path), model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2))
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    before = _snapshot(model)
    for loader in (load_checkpoint, resume_from_checkpoint):
        with pytest.raises(CheckpointMismatchError, match="could not be loaded .*are as they were"):
            _call(loader, tmp_path, model, optimizer=optimizer, lr_scheduler=scheduler)
        assert _unchanged(model, before) and optimizer.state_dict()["state"] == {}


def _save_relay(rank, world_size, root):
    from bagua_algos.algorithms import RelayAlgorithm

    model = _model(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([optimizer], RelayAlgorithm(topology="chain"))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(1, root, model, optimizer)


def _load_into_allreduce(rank, world_size, root):
    from bagua_algos.algorithms import GradientAllReduceAlgorithm

    found = {}
    for loader in (load_checkpoint, resume_from_checkpoint):
        model = _model(10 + rank)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
        before = _snapshot(model)
        try:
            loader(root, model, optimizer)
            found[loader.__name__] = "loaded"
        except CheckpointMismatchError as error:
            found[loader.__name__] = str(error)
        found[loader.__name__ + "_unchanged"] = _unchanged(model, before)
    return found


def test_another_algorithms_state_is_refused_with_the_weights_untouched(tmp_path):
    from bagua_algos.experiments.gloo_workers import run_workers

    root = str(tmp_path)
    run_workers(_save_relay, 2, root, timeout=120)
    for found in run_workers(_load_into_allreduce, 2, root, timeout=120):
        for name in ("load_checkpoint", "resume_from_checkpoint"):
            assert "holds state of algorithm 'RelayAlgorithm', this module runs 'GradientAllReduceAlgorithm'" \
                in found[name], found[name]
            assert found[name + "_unchanged"]


# ------------------------------------------------- temporary files, one write


def _plant(path, age_s):
    with open(path, "wb") as f:
        f.write(b"x" * 1000)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))


@pytest.mark.parametrize("then", ["save", "resume"])
def test_a_killed_saves_temporary_files_are_removed_by_the_next_save_or_resume(tmp_path, then):
    root = _saved(tmp_path, (1,))
    folder = checkpoint._iteration_dir(str(root), 1)
    stale = [os.path.join(folder, "bagua_rank_00000_states.pt.tmp.4242"),
             os.path.join(folder, "mp_rank_00_model_states.pt.sha256.tmp.4242"),
             os.path.join(str(root), checkpoint.TRACKER + ".tmp.17")]
    kept = [os.path.join(folder, "notes.pt.tmp.4242"),  # not this module's name: never touched
            os.path.join(folder, "bagua_rank_00001_states.pt.tmp.99")]  # newer than this process: a write in flight
    for path in stale:
        _plant(path, 3600)
    _plant(kept[0], 3600)
    _plant(kept[1], -60)
    if then == "save":
        save_checkpoint(2, str(root), _model(2))
    else:
        assert _call(resume_from_checkpoint, root, _model(0))[0] == 1
    assert [os.path.exists(p) for p in stale] == [False] * 3
    assert all(os.path.exists(p) for p in kept)


def test_the_first_ranks_state_is_serialised_once(tmp_path, monkeypatch):
    calls = []
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(1), real(obj, f, *a, **k))[1])
    save_checkpoint(3, str(tmp_path), _model(0))
    assert len(calls) == 1
    folder = checkpoint._iteration_dir(str(tmp_path), 3)
    own = os.stat(os.path.join(folder, "bagua_rank_00000_states.pt"))
    first = os.stat(os.path.join(folder, checkpoint.FIRST_RANK_FILE))
    assert (own.st_ino, own.st_dev) == (first.st_ino, first.st_dev)  # one file on disk, two names
    monkeypatch.setattr(torch, "save", real)
    model = _model(5)
    assert _call(load_checkpoint, tmp_path, model)[0] == 3 and torch.equal(model.weight, _model(0).weight)


# ---------------------------------------------------- bad tracker, bad checksum


def _bad_tracker(root, kind):
    tracker = os.path.join(str(root), checkpoint.TRACKER)
    os.remove(tracker)
    if kind == "directory":
        os.mkdir(tracker)
    elif kind == "binary":
        open(tracker, "wb").write(b"\xff\xfe\x00")
    elif kind != "missing":
        open(tracker, "w").write(kind)


@pytest.mark.parametrize("kind", ["-5", "abc", "1.5", "", "directory", "binary", "missing"])
def test_a_bad_tracker_falls_back_to_the_newest_valid_iteration_on_disk(tmp_path, kind):
    root = _saved(tmp_path)
    _bad_tracker(root, kind)
    model = _model(0)
    iteration, messages = _call(resume_from_checkpoint, root, model)
    assert iteration == 2 and torch.equal(model.weight, _model(2).weight)
    assert len(messages) == 1 and checkpoint.TRACKER in messages[0] and "from the newest" in messages[0]
    if kind != "missing":  # Bagua's load_checkpoint: no tracker is no checkpoint; a bad one, a warning
        iteration, messages = _call(load_checkpoint, root, _model(0))
        assert iteration == 2 and len(messages) == 1 and "loading the newest iteration on disk, 2" in messages[0]


def test_a_bad_tracker_skips_an_invalid_newest_iteration_too(tmp_path):
    root = _saved(tmp_path)
    _bad_tracker(root, "-5")
    open(checkpoint._rank_file(str(root), 2, 0), "ab").write(b"x")
    iteration, messages = _call(resume_from_checkpoint, root, _model(0))
    assert iteration == 1 and len(messages) == 2 and "truncated or extended" in messages[1]


def test_a_bad_tracker_and_no_iteration_is_a_fresh_start_with_a_warning(tmp_path):
    os.makedirs(tmp_path / checkpoint.TRACKER)
    iteration, messages = _call(resume_from_checkpoint, tmp_path, _model(0))
    assert iteration == 0 and len(messages) == 1 and "is a directory" in messages[0]
    with pytest.raises(ValueError, match="is a directory.*holds no iter_\\* folder"):
        _call(load_checkpoint, tmp_path, _model(0))


@pytest.mark.parametrize("sidecar", ["5", "[1, 2]", '"abc"', "null", '{"sha256": 5, "bytes": 1}',
                                     '{"sha256": "%s", "bytes": -1}' % ("0" * 64), "{", '{"a": 1}'])
def test_a_checksum_file_not_of_its_shape_makes_the_file_invalid(tmp_path, sidecar):
    root = _saved(tmp_path)
    path = checkpoint._rank_file(str(root), 2, 0)
    os.remove(path + ".sha256")
    open(path + ".sha256", "w").write(sidecar)
    model = _model(0)
    iteration, messages = _call(resume_from_checkpoint, root, model)
    assert iteration == 1 and torch.equal(model.weight, _model(1).weight)
    assert len(messages) == 1 and "no valid checksum file" in messages[0]
    with pytest.raises(CheckpointError, match="no valid checksum file"):
        _call(load_checkpoint, root, _model(0))


@pytest.mark.parametrize("given", ["tracker", "iteration"])
def test_a_file_or_an_iteration_folder_for_the_checkpoints_folder_is_an_error(tmp_path, given):
    root = _saved(tmp_path)
    path = root / checkpoint.TRACKER if given == "tracker" else root / "iter_0000002"
    for loader in (load_checkpoint, resume_from_checkpoint):
        with pytest.raises(CheckpointError, match="is a file|is one iteration's folder; pass its parent"):
            _call(loader, path, _model(0))
