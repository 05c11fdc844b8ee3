"""Bagua's ``save_checkpoint`` / ``load_checkpoint``, in Bagua's file layout.

``CHECKPOINTS/iter_{iteration:07d}/mp_rank_00_model_states.pt`` holds the first rank's
model, optimizer and LR-scheduler state; ``latest_checkpointed_iteration.txt`` names the
newest iteration. In addition each rank saves its own model, optimizer and algorithm
state (``bagua_rank_{rank:05d}_states.pt``: step counter, relay messages, error
buffers, ...) and loads that one back, so decentralized algorithms, whose workers hold
different models and state, resume exactly. Every rank must call both.
"""

from __future__ import annotations

import os

import torch

from ..arguments import check_int
from . import comm

__all__ = ["save_checkpoint", "load_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"


def _iteration_dir(path: str, iteration: int) -> str:
    return os.path.join(path, f"iter_{iteration:07d}")


def _rank_file(path: str, iteration: int, rank: int) -> str:
    return os.path.join(_iteration_dir(path, iteration), f"bagua_rank_{rank:05d}_states.pt")


def save_checkpoint(iteration: int, checkpoints_path: str, model, optimizer=None, lr_scheduler=None) -> None:
    """Save ``model`` (and optimizer, scheduler) at ``iteration``; collective."""
    iteration = check_int("iteration", iteration, 0)
    rank = comm.get_rank() if comm.is_initialized() else 0
    os.makedirs(_iteration_dir(checkpoints_path, iteration), exist_ok=True)
    state = {"iteration": iteration, "model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if "bagua_ddp" in model.__dict__:
        state["bagua"] = model.bagua_state_dict()
    if rank == 0:
        torch.save(state, os.path.join(_iteration_dir(checkpoints_path, iteration), "mp_rank_00_model_states.pt"))
    torch.save(state, _rank_file(checkpoints_path, iteration, rank))
    if comm.is_initialized():
        comm.barrier()
    if rank == 0:
        with open(os.path.join(checkpoints_path, TRACKER), "w") as f:
            f.write(str(iteration))
    if comm.is_initialized():
        comm.barrier()


def load_checkpoint(checkpoints_path: str, model, optimizer=None, lr_scheduler=None, strict: bool = True) -> int:
    """Load the newest checkpoint into ``model`` (etc.) and return its iteration (0 if
    there is none); collective. Each rank reads the state it saved itself."""
    tracker = os.path.join(checkpoints_path, TRACKER)
    if not os.path.isfile(tracker):
        return 0
    with open(tracker) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise ValueError(f"{tracker} must hold an iteration number, got {text!r}") from None
    rank = comm.get_rank() if comm.is_initialized() else 0
    path = _rank_file(checkpoints_path, iteration, rank)
    if not os.path.isfile(path):
        path = os.path.join(_iteration_dir(checkpoints_path, iteration), "mp_rank_00_model_states.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if "bagua" in state and "bagua_ddp" in model.__dict__:
        model.load_bagua_state_dict(state["bagua"])
    if comm.is_initialized():
        comm.barrier()
    return iteration
