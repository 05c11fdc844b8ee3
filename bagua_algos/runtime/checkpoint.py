"""Bagua's ``save_checkpoint`` / ``load_checkpoint``, in Bagua's file layout, and
:func:`resume_from_checkpoint`, the one call that resumes a restarted job.

``CHECKPOINTS/iter_{iteration:07d}/mp_rank_00_model_states.pt`` holds the first rank's
model, optimizer and LR-scheduler state; ``latest_checkpointed_iteration.txt`` names the
newest iteration. In addition each rank saves its own model, optimizer and algorithm
state (``bagua_rank_{rank:05d}_states.pt``: step counter, relay messages, error
buffers, ...) and loads that one back, so decentralized algorithms, whose workers hold
different models and state, resume exactly. Every rank must call both. The first rank
serialises its state once: ``mp_rank_00_model_states.pt`` is a hard link to its own
file (a copy of its bytes where the file system has no hard links).

Writes are atomic: each file is written to a temporary file in the same directory,
fsynced and renamed over its name (``os.replace``), then its checksum file
(``<file>.sha256``: SHA-256, length, world size) likewise; the tracker is written
last, after every rank has saved. A kill at any moment leaves the previous files or
the new ones, never a half-written file under a checkpoint's name, and the tracker
never names an iteration some rank has not finished. A file whose bytes do not match
its checksum file (truncated, corrupted, or its checksum file missing or not of that
shape) is invalid: the loaders read it never. A kill can leave a temporary file
(``<name>.tmp.<pid>``) behind; the next save or resume removes those older than the
process.

Checkpoints are data, never code: files are read with ``torch.load(weights_only=True)``,
which rebuilds tensors, numbers, strings and containers only (every algorithm's state
is made of those). A file that needs any other type to load (a pickled object whose
unpickling may run any code its writer chose) is refused with
:class:`UntrustedCheckpointError` naming the types, unless the caller opts in with
``trust_pickle=True`` or ``BAGUA_ALGOS_TRUST_PICKLE=1``. The checksum file does not make
a file trusted: whoever writes a file can write its checksum too.

Before anything is written into the model the loaded state is checked against it (its
tensors' names and shapes, the optimizer's parameter groups, the algorithm and its
buckets): a state that does not fit raises :class:`CheckpointMismatchError` and leaves
the model, optimizer and algorithm as they were; a part that fails past those checks
puts back what was loaded before it, from a copy taken first, and raises it too.

At another world size than the one saved (a job restarted with more or fewer
workers) every rank loads the first rank's file, so all start from one model and
optimizer state; what of the algorithm's state is carried over or reset is the
algorithm's ``WORLD_SIZE_RULE`` (docs/elastic.md), applied by ``load_bagua_state_dict``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import time
import warnings
from copy import deepcopy

import torch

from ..arguments import check_int, is_int
from . import comm

__all__ = ["save_checkpoint", "load_checkpoint", "resume_from_checkpoint", "CheckpointError",
           "CheckpointMismatchError", "UntrustedCheckpointError", "TRUST_PICKLE_ENV"]

TRACKER = "latest_checkpointed_iteration.txt"
FIRST_RANK_FILE = "mp_rank_00_model_states.pt"  # Bagua's name
CHECKSUM_SUFFIX = ".sha256"
TRUST_PICKLE_ENV = "BAGUA_ALGOS_TRUST_PICKLE"
_ITERATION_DIR = re.compile(r"iter_(\d{7,})")
#: the temporary files of this module's writes (``_replace_atomically``), and nothing else
_TEMPORARY = re.compile(r"(latest_checkpointed_iteration\.txt|bagua_rank_\d{5,}_states\.pt|mp_rank_00_model_states\.pt)"
                        r"(\.sha256)?\.tmp\.\d+")
#: a temporary file older than this (the module's import, before this process can have begun a save; a job's
#: ranks all import it before the process group forms, so before any of them saves) is a killed write's
_STARTED = time.time()


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (no valid file where one is needed)."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A valid checkpoint whose state does not fit the model, optimizer or algorithm
    given; raised before anything is loaded into them."""


class UntrustedCheckpointError(CheckpointError):
    """A file that needs more than tensors, numbers, strings and containers to load."""


def _iteration_dir(path: str, iteration: int) -> str:
    return os.path.join(path, f"iter_{iteration:07d}")


def _rank_file(path: str, iteration: int, rank: int) -> str:
    return os.path.join(_iteration_dir(path, iteration), f"bagua_rank_{rank:05d}_states.pt")


def _rank_and_size() -> tuple[int, int]:
    if comm.is_initialized():
        return comm.get_rank(), comm.get_world_size()
    return 0, 1


def _trusts_pickle(trust_pickle) -> bool:
    """The caller's ``trust_pickle``, else ``BAGUA_ALGOS_TRUST_PICKLE`` (1/true/yes or 0/false/no/unset)."""
    if trust_pickle is not None:
        if not isinstance(trust_pickle, bool):
            raise TypeError(f"trust_pickle must be True or False, got {trust_pickle!r}")
        return trust_pickle
    text = os.environ.get(TRUST_PICKLE_ENV, "").strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise ValueError(f"{TRUST_PICKLE_ENV} must be 1, true, yes (trust) or 0, false, no (refuse), got {text!r}")


# ------------------------------------------------------------------- atomic files


class _HashingWriter:
    """A binary file that also feeds what is written to SHA-256 (torch.save writes
    sequentially, so the file is hashed as it is written, without a second read)."""

    def __init__(self, f):
        self.f, self.sha256, self.length = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.length += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(path: str, write) -> None:
    """Run ``write(temporary path)`` (which creates the file), fsync it, rename it to
    ``path``: readers see the old file or the whole new one."""
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        write(temporary)
        fd = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    finally:
        if os.path.lexists(temporary):
            os.remove(temporary)


def _write_with(write):
    """A ``_replace_atomically`` writer that opens the temporary file and runs ``write(file)``."""
    def create(temporary: str) -> None:
        with open(temporary, "wb") as f:
            write(f)
    return create


def _link_or_copy(source: str):
    """A ``_replace_atomically`` writer that makes the temporary file a hard link to
    ``source`` (no byte written again), or a copy where hard links are not supported."""
    def create(temporary: str) -> None:
        try:
            os.link(source, temporary)
        except OSError:
            shutil.copyfile(source, temporary)
    return create


def _save_verified(state: dict, path: str, world_size: int) -> None:
    """``torch.save(state, path)`` atomically, then its checksum file atomically."""
    digest = {}

    def write(f):
        writer = _HashingWriter(f)
        torch.save(state, writer)
        digest.update(sha256=writer.sha256.hexdigest(), bytes=writer.length)

    _replace_atomically(path, _write_with(write))
    record = json.dumps({**digest, "world_size": world_size}).encode()
    _replace_atomically(path + CHECKSUM_SUFFIX, _write_with(lambda f: f.write(record)))
    _fsync_dir(os.path.dirname(path))


def _remove_stale_temporaries(checkpoints_path: str) -> None:
    """Remove what killed writes left: this module's temporary files (``_TEMPORARY``)
    in ``checkpoints_path`` and its iteration folders, older than this process."""
    folders = [checkpoints_path]
    try:
        folders += [os.path.join(checkpoints_path, n) for n in os.listdir(checkpoints_path) if _ITERATION_DIR.fullmatch(n)]
    except OSError:
        return
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not _TEMPORARY.fullmatch(name):
                continue
            path = os.path.join(folder, name)
            try:
                if os.path.isfile(path) and os.stat(path).st_mtime < _STARTED:
                    os.remove(path)
            except FileNotFoundError:  # another rank removed it first
                pass


def _checksum_record(path: str) -> dict | None:
    """The checksum file of ``path`` if it is one: a JSON object with a 64-hex-digit
    ``sha256``, a non-negative ``bytes`` and a positive ``world_size`` (or none)."""
    try:
        with open(path + CHECKSUM_SUFFIX, "rb") as f:
            record = json.loads(f.read(4096))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    sha256, size, world_size = record.get("sha256"), record.get("bytes"), record.get("world_size")
    if not isinstance(sha256, str) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        return None
    if not is_int(size) or size < 0 or (world_size is not None and (not is_int(world_size) or world_size < 1)):
        return None
    return record


def _torch_load(source, name: str, trust_pickle: bool) -> dict:
    """``torch.load`` of tensors, numbers, strings and containers only, unless
    ``trust_pickle``; a file that needs more raises :class:`UntrustedCheckpointError`."""
    if trust_pickle:
        return torch.load(source, map_location="cpu", weights_only=False)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if hasattr(source, "seek"):
            source.seek(0)
        try:
            types = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(source)) or str(error).split("\n")[0]
        except Exception:  # noqa: BLE001 - not a zip file: torch's own first line names what it met
            types = str(error).strip().split("\n")[0]
        raise UntrustedCheckpointError(
            f"{name} needs more than tensors, numbers, strings and containers to load ({types}); unpickling it can run "
            "any code its writer chose, so it is refused. A checkpoint of bagua_algos never needs that. If you trust "
            f"whoever wrote it, pass trust_pickle=True or set {TRUST_PICKLE_ENV}=1 (PyTorch: weights_only=False must "
            "never be used on a file from a source you do not trust)") from None


def _read_verified(path: str, trust_pickle: bool) -> tuple[dict | None, str | None]:
    """``(state, None)``, or ``(None, why the file is invalid)``."""
    record = _checksum_record(path)
    if record is None:
        return None, "missing" if not os.path.exists(path) else f"no valid checksum file {os.path.basename(path)}{CHECKSUM_SUFFIX}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        return None, f"unreadable ({error.strerror})"
    if len(data) != record["bytes"]:
        return None, f"truncated or extended: {len(data)} bytes, {record['bytes']} written"
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return None, "corrupted: its SHA-256 differs from the one written with it"
    try:
        return _torch_load(io.BytesIO(data), path, trust_pickle), None
    except UntrustedCheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - the checksum matched, so the writer wrote this
        return None, f"unreadable by torch.load ({type(error).__name__}: {error})"


# ------------------------------------------------------------------------ saving


def save_checkpoint(iteration: int, checkpoints_path: str, model, optimizer=None, lr_scheduler=None) -> None:
    """Save ``model`` (and optimizer, scheduler) at ``iteration``; collective. Each
    file is written atomically with its checksum; the tracker last (module notes)."""
    iteration = check_int("iteration", iteration, 0)
    rank, world_size = _rank_and_size()
    directory = _iteration_dir(checkpoints_path, iteration)
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(checkpoints_path)
    state = {"iteration": iteration, "world_size": world_size, "model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if "bagua_ddp" in model.__dict__:
        state["bagua"] = model.bagua_state_dict()
    if comm.fault_tolerance.active():  # under torchft: the committed steps go on from here at a resume
        state["torchft"] = comm.fault_tolerance.counters()
    own = _rank_file(checkpoints_path, iteration, rank)
    _save_verified(state, own, world_size)
    if rank == 0:  # Bagua's name for the same bytes: serialised once, linked
        first = os.path.join(directory, FIRST_RANK_FILE)
        _replace_atomically(first, _link_or_copy(own))
        _replace_atomically(first + CHECKSUM_SUFFIX, _link_or_copy(own + CHECKSUM_SUFFIX))
        _fsync_dir(directory)
    if comm.is_initialized():
        comm.barrier()  # every rank's files are in place before the tracker names them
    if rank == 0:
        _replace_atomically(os.path.join(checkpoints_path, TRACKER),
                            _write_with(lambda f: f.write(str(iteration).encode())))
        _fsync_dir(checkpoints_path)
    if comm.is_initialized():
        comm.barrier()


# ----------------------------------------------------------------------- loading


def _read_tracker(checkpoints_path: str) -> tuple[int | None, str | None]:
    """``(iteration, None)`` when the tracker names one, ``(None, None)`` when there is
    no tracker, ``(None, what is wrong with it)`` when it names none."""
    tracker = os.path.join(checkpoints_path, TRACKER)
    if not os.path.lexists(tracker):
        return None, None
    try:
        with open(tracker, "rb") as f:
            text = f.read(4097).decode().strip()  # an iteration number is short; more is not one
    except IsADirectoryError:
        return None, f"{tracker} is a directory, not a file naming an iteration"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"{tracker} is unreadable ({getattr(error, 'strerror', None) or error})"
    if re.fullmatch(r"\d{1,4000}", text):
        return int(text), None
    return None, f"{tracker} must hold an iteration number, got {text[:40]!r} (valid: an integer >= 0)"


def _saved_iterations(checkpoints_path: str, newest: int | None) -> list[int]:
    """The iterations with a directory, at most ``newest`` when given (those after it
    are saves that did not finish), newest first."""
    found = []
    for name in os.listdir(checkpoints_path):
        match = _ITERATION_DIR.fullmatch(name)
        if match and (newest is None or int(match.group(1)) <= newest):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def _check_path(checkpoints_path: str) -> None:
    """A file, or one iteration's folder, given for the folder of checkpoints would
    resume from zero: an error naming what to pass instead."""
    if os.path.exists(checkpoints_path) and not os.path.isdir(checkpoints_path):
        raise CheckpointError(f"checkpoints_path {checkpoints_path} is a file; pass the folder that holds {TRACKER} "
                              "and the iter_* folders")
    if _ITERATION_DIR.fullmatch(os.path.basename(os.path.normpath(checkpoints_path))) and os.path.isdir(checkpoints_path) \
            and any(n.endswith(".pt") for n in os.listdir(checkpoints_path)):
        raise CheckpointError(f"checkpoints_path {checkpoints_path} is one iteration's folder; pass its parent, "
                              f"{os.path.dirname(os.path.normpath(checkpoints_path))}")


def _candidates(checkpoints_path: str) -> tuple[list[int], str | None]:
    """The iterations to try, newest first, and a warning when the tracker could not
    cap them (a bad or missing tracker beside iteration folders: every one on disk is
    tried, so a valid checkpoint is never passed over for a fresh start)."""
    if not os.path.isdir(checkpoints_path):
        return [], None
    newest, why = _read_tracker(checkpoints_path)
    if newest is not None:
        return _saved_iterations(checkpoints_path, newest), None
    on_disk = _saved_iterations(checkpoints_path, None)
    if why is None and on_disk:
        why = f"{os.path.join(checkpoints_path, TRACKER)} is missing"
    if why is None:
        return [], None
    fallback = "trying the iterations on disk from the newest" if on_disk else "no iteration on disk: a fresh start"
    return on_disk, f"resume_from_checkpoint: {why}; {fallback}"


def _file_to_load(checkpoints_path: str, iteration: int, rank: int, world_size: int) -> str:
    """This rank's own file when the iteration was saved at this world size (read from
    the first rank's checksum file), else the first rank's."""
    own = _rank_file(checkpoints_path, iteration, rank)
    first = _rank_file(checkpoints_path, iteration, 0)
    record = _checksum_record(first) or _checksum_record(own)
    saved_size = record.get("world_size") if record else None
    if saved_size is not None and saved_size != world_size:
        return first
    if not os.path.exists(own) and not os.path.exists(own + CHECKSUM_SUFFIX):
        # Bagua's own checkpoints hold only the first rank's file, with no checksum.
        bagua = os.path.join(_iteration_dir(checkpoints_path, iteration), FIRST_RANK_FILE)
        if os.path.exists(bagua) and not os.path.exists(bagua + CHECKSUM_SUFFIX):
            return bagua
    return own


def _read(path: str, trust_pickle: bool) -> tuple[dict | None, str | None]:
    if os.path.basename(path) == FIRST_RANK_FILE and not os.path.exists(path + CHECKSUM_SUFFIX):
        try:  # Bagua's layout: no checksum to check; torch.load is the only test
            return _torch_load(path, path, trust_pickle), None
        except UntrustedCheckpointError:
            raise
        except Exception as error:  # noqa: BLE001
            return None, f"unreadable by torch.load ({type(error).__name__}: {error})"
    return _read_verified(path, trust_pickle)


def _shape_problems(saved: dict, own: dict, what: str, strict: bool) -> list[str]:
    """How the tensors of ``saved`` differ from ``own`` (names when ``strict``, shapes)."""
    problems = []
    if strict:
        missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
        if missing:
            problems.append(f"{what} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            problems.append(f"{what} has {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}, which this model has not")
    for key in (k for k in own if k in saved):  # the model's order: the same message every time
        a, b = saved[key], own[key]
        if torch.is_tensor(a) and torch.is_tensor(b) and a.shape != b.shape:
            problems.append(f"{what} {key!r} has shape {tuple(a.shape)}, this model's {tuple(b.shape)}")
    return problems


def _bagua_problems(saved: dict, ddp) -> list[str]:
    """How the algorithm state ``saved`` does not fit ``ddp`` (the algorithm, its
    buckets, at the same world size their tensors' shapes)."""
    if not isinstance(saved, dict):
        return ["its algorithm state is not a dict"]
    expected = type(ddp.algorithm).__name__
    if saved.get("algorithm") != expected:
        return [f"it holds state of algorithm {saved.get('algorithm')!r}, this module runs {expected!r}"]
    buckets = {b.name: b for b in ddp.bagua_buckets}
    bucket_state = saved.get("bucket_state")
    if not isinstance(bucket_state, dict) or set(bucket_state) != set(buckets):
        names = sorted(bucket_state) if isinstance(bucket_state, dict) else bucket_state
        return [f"it has buckets {names}, this module has {sorted(buckets)}"]
    if saved.get("world_size") != comm.get_world_size(ddp.process_group):
        return []  # the algorithm's WORLD_SIZE_RULE decides what is loaded (load_bagua_state_dict)
    problems = []
    for name, state in bucket_state.items():
        for key, value in (state.items() if isinstance(state, dict) else ()):
            current = buckets[name].state.get(key)
            if torch.is_tensor(value) and torch.is_tensor(current) and current.shape != value.shape \
                    and not (current.shape[:1] == (1,) and current.shape[1:] == value.shape):
                problems.append(f"bucket {name!r} state {key!r} has shape {tuple(value.shape)}, "
                                f"this module's {tuple(current.shape)}")
    return problems


def _check_fits(state, path: str, model, optimizer, lr_scheduler, strict: bool) -> None:
    """Raise :class:`CheckpointMismatchError` naming how ``state`` does not fit; reads only."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointMismatchError(f"checkpoint file {path} holds no model state (a dict with a 'model' entry)")
    problems = _shape_problems(state["model"], model.state_dict(), "its model", strict)
    if optimizer is not None:
        saved = state.get("optimizer")
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list):
            problems.append("it holds no optimizer state")
        else:
            sizes = [len(g.get("params", ())) for g in groups if isinstance(g, dict)]
            own = [len(g["params"]) for g in optimizer.param_groups]
            if sizes != own:
                problems.append(f"its optimizer has parameter groups of {sizes} parameters, this one of {own}")
    if lr_scheduler is not None and not isinstance(state.get("lr_scheduler"), dict):
        problems.append("it holds no lr_scheduler state")
    if "bagua" in state and "bagua_ddp" in model.__dict__:
        problems += _bagua_problems(state["bagua"], model.bagua_ddp)
    if problems:
        raise CheckpointMismatchError(f"checkpoint file {path} does not fit (nothing was loaded): {'; '.join(problems)}")


def _copy_of(model, optimizer, lr_scheduler) -> dict:
    """What :func:`_load_state` may overwrite, copied (tensors cloned)."""
    copy = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if optimizer is not None:
        copy["optimizer"] = deepcopy(optimizer.state_dict())
    if lr_scheduler is not None:
        copy["lr_scheduler"] = deepcopy(lr_scheduler.state_dict())
    if "bagua_ddp" in model.__dict__:
        copy["bagua"] = model.bagua_state_dict()  # at this world size: loading it back applies no rule
    return copy


def _load_state(state: dict, model, optimizer, lr_scheduler, strict: bool, path: str) -> None:
    """Load ``state`` (checked by :func:`_check_fits`). Should a part still fail (a
    rule of the algorithm at another world size, a dtype), what was loaded is put back
    from a copy taken first: a load that fails leaves everything as it was."""
    before = _copy_of(model, optimizer, lr_scheduler)
    try:
        _load_parts(state, model, optimizer, lr_scheduler, strict)
    except Exception as error:
        _load_parts(before, model, optimizer, lr_scheduler, strict)
        raise CheckpointMismatchError(f"checkpoint file {path} could not be loaded ({type(error).__name__}: {error}); "
                                      "the model, optimizer and algorithm state are as they were") from error


def _load_parts(state: dict, model, optimizer, lr_scheduler, strict: bool) -> None:
    model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if "bagua" in state and "bagua_ddp" in model.__dict__:
        model.load_bagua_state_dict(state["bagua"])  # after the model: the rules may start from it
    if "torchft" in state and comm.fault_tolerance.active():
        comm.fault_tolerance.restore_counters(state["torchft"])


def load_checkpoint(checkpoints_path: str, model, optimizer=None, lr_scheduler=None, strict: bool = True,
                    trust_pickle: bool | None = None) -> int:
    """Load the checkpoint the tracker names into ``model`` (etc.) and return its
    iteration (0 if there is no tracker); collective. Each rank reads the state it saved
    itself (at another world size, the first rank's). An invalid file is an error
    naming it; :func:`resume_from_checkpoint` falls back to an older one instead. A
    tracker that names no iteration (not a number, a directory, unreadable) gives a
    warning and the newest iteration folder on disk is loaded. ``trust_pickle``: see
    the module notes (default: ``BAGUA_ALGOS_TRUST_PICKLE``, else refuse)."""
    trust = _trusts_pickle(trust_pickle)
    _check_path(checkpoints_path)
    iteration, why = _read_tracker(checkpoints_path)
    if why is not None:
        on_disk = _saved_iterations(checkpoints_path, None)
        if not on_disk:
            raise ValueError(f"{why}; and {checkpoints_path} holds no iter_* folder to load instead")
        iteration = on_disk[0]
        warnings.warn(f"load_checkpoint: {why}; loading the newest iteration on disk, {iteration}", RuntimeWarning,
                      stacklevel=2)
    if iteration is None:
        return 0
    rank, world_size = _rank_and_size()
    path = _file_to_load(checkpoints_path, iteration, rank, world_size)
    state, why = _read(path, trust)
    if state is None:
        raise CheckpointError(f"checkpoint file {path} is invalid: {why}; resume_from_checkpoint() would use the "
                              "newest valid checkpoint before it")
    _check_fits(state, path, model, optimizer, lr_scheduler, strict)
    _load_state(state, model, optimizer, lr_scheduler, strict, path)
    if comm.is_initialized():
        comm.barrier()
    return iteration


def _verdict(path: str, model, optimizer, lr_scheduler, strict: bool, trust: bool):
    """``(state, None)`` or ``(None, (kind, text))``: kind "invalid" (fall back to an
    older checkpoint), "refused" or "mismatch" (stop: an older one would not do better)."""
    try:
        state, why = _read(path, trust)
    except UntrustedCheckpointError as error:
        return None, ("refused", str(error))
    if state is None:
        return None, ("invalid", f"{path} ({why})")
    try:
        _check_fits(state, path, model, optimizer, lr_scheduler, strict)
    except CheckpointMismatchError as error:
        return None, ("mismatch", str(error))
    return state, None


def resume_from_checkpoint(checkpoints_path: str, model, optimizer=None, lr_scheduler=None,
                           strict: bool = True, trust_pickle: bool | None = None) -> int:
    """Load the newest checkpoint that every rank can read, in one call; collective.

    Returns its iteration, or 0 when ``checkpoints_path`` holds no finished
    checkpoint (a fresh start). Going from the tracker's iteration back (from the
    newest folder on disk, with a warning, when the tracker is missing or names
    none), each rank checks the file it would load (its own, or the first rank's at
    another world size) against its checksum; the ranks agree on the newest iteration
    valid for all. If that is not the newest, one warning names the invalid files; if
    none is valid, a :class:`CheckpointError` names them all. A file refused as
    untrusted (``trust_pickle``, module notes) or a state that does not fit the model
    stops the resume on every rank with that error, the model untouched. Then the
    model, ``optimizer``, ``lr_scheduler`` and the algorithm's state are loaded as
    :func:`load_checkpoint` does. Call it after ``with_bagua``, on every rank.
    """
    trust = _trusts_pickle(trust_pickle)
    _check_path(checkpoints_path)
    rank, world_size = _rank_and_size()
    # Under torchft before the first quorum there is no group to agree over: each replica
    # takes its newest valid checkpoint, and one behind heals from the others at the quorum.
    distributed = comm.is_initialized() and world_size > 1 and not comm.fault_tolerance.before_first_quorum()
    _remove_stale_temporaries(checkpoints_path)
    candidates, note = _candidates(checkpoints_path) if rank == 0 or not distributed else ([], None)
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    if distributed:
        candidates = comm.broadcast_object(candidates, 0)
    invalid: list[str] = []
    for iteration in candidates:
        path = _file_to_load(checkpoints_path, iteration, rank, world_size)
        state, verdict = _verdict(path, model, optimizer, lr_scheduler, strict, trust)
        verdicts = comm.all_gather_object(verdict) if distributed else [verdict]
        stop = sorted({text for v in verdicts if v is not None and v[0] != "invalid" for text in v[1:]})
        if stop:
            kinds = {v[0] for v in verdicts if v is not None}
            raise (UntrustedCheckpointError if "refused" in kinds else CheckpointMismatchError)("; ".join(stop))
        problems = sorted({v[1] for v in verdicts if v is not None})
        if not problems:
            if invalid:
                warnings.warn(f"resume_from_checkpoint: skipped invalid checkpoint files {'; '.join(invalid)}; "
                              f"resuming from iteration {iteration}", RuntimeWarning, stacklevel=2)
            _load_state(state, model, optimizer, lr_scheduler, strict, path)
            if distributed:
                comm.barrier()
            return iteration
        invalid += [p for p in problems if p not in invalid]
    if invalid:
        raise CheckpointError(f"no valid checkpoint in {checkpoints_path}: {'; '.join(invalid)}")
    return 0
