"""Bagua's env module: rank, world size, local rank and size, node rank (from the
process group once it exists, else from the launcher's environment variables)."""

from __future__ import annotations

import os

import torch.distributed as dist


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set; start the workers with "
                "`python -m bagua_algos.launch` or torchrun, or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT yourself"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_init(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs the process group: call bagua_algos.init_process_group() first "
            "(in workers started by `python -m bagua_algos.launch` or torchrun)"
        )


def get_rank() -> int:
    """This process's rank in the job (RANK, default 0, also before
    :func:`init_process_group`)."""
    return dist.get_rank() if is_initialized() else _env_int("RANK", 0)


def get_world_size() -> int:
    """Number of processes in the job (WORLD_SIZE, default 1, also before
    :func:`init_process_group`)."""
    return dist.get_world_size() if is_initialized() else _env_int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    """Rank among the processes of this node (LOCAL_RANK; default 0 before
    :func:`init_process_group`, which sets it to the rank when it is missing)."""
    return _env_int("LOCAL_RANK", get_rank() if is_initialized() else 0)


def leads_node() -> bool:
    """Whether this process's workers lead their node in Bagua's hierarchical pattern
    (local rank 0: reduce within the node, the leaders' work, broadcast back). On the
    one-process engine, whose workers are one node in one process, True: its rows do
    the leader's work together."""
    return get_local_rank() == 0


def get_local_size() -> int:
    """Number of processes on this node (LOCAL_WORLD_SIZE; default 1 before
    :func:`init_process_group`, which sets it to the world size when it is missing)."""
    return _env_int("LOCAL_WORLD_SIZE", get_world_size() if is_initialized() else 1)


def get_node_rank() -> int:
    """Index of this node: ``get_rank() // get_local_size()`` (nodes hold consecutive
    ranks, as under Bagua's launcher and torchrun)."""
    return get_rank() // get_local_size()
