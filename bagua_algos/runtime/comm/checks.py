"""Argument checks of the collectives: the communicator and rank arguments, tensors,
reduction operators, counts and displacements (one rule for each kind; integers by
:mod:`bagua_algos.arguments`'s rule)."""

from __future__ import annotations

import torch

from ...arguments import check_int, is_int
from .env import _require_init
from .fault_tolerance import _ft
from .groups import _NON_MEMBER, BaguaCommunicator, _as_communicator
from .reduce_op import _BITWISE_OPS, ReduceOp


# What a rank argument (src, dst, a peer) means, chosen by the keyword that names the
# communicator; each keyword reads as in the library it comes from:
COMMUNICATOR_RANKS = "communicator ranks"  # comm= (Bagua's API): 0 … nranks() − 1 inside it
GLOBAL_RANKS = "global ranks"  # group= (torch.distributed's keyword): the job's ranks, members of the group


def _target(comm, group, what: str) -> tuple[BaguaCommunicator, str]:
    """(the communicator, what its rank arguments are: COMMUNICATOR_RANKS or GLOBAL_RANKS)."""
    _require_init(f"{what}()")
    if comm is not None and group is not None:
        raise ValueError(f"{what}(): pass comm= or group=, not both")
    if _ft["errored"] is not None:  # under torchft, a step whose collective failed skips the rest
        return BaguaCommunicator(_NON_MEMBER, [], "skipped"), GLOBAL_RANKS
    if group is not None:
        return _as_communicator(group), GLOBAL_RANKS
    return _as_communicator(comm), COMMUNICATOR_RANKS


def _global_rank(c: BaguaCommunicator, ranks: str, rank, what: str) -> int:
    """The global rank meant by rank argument ``what`` (one of ``ranks``)."""
    if ranks == COMMUNICATOR_RANKS:
        return c.global_rank(rank, what)
    if not is_int(rank) or rank not in c.ranks:
        raise ValueError(
            f"{what}={rank!r} is not a member of the group: with group= it is a global rank, one of {c.ranks}"
        )
    return rank


def _peer_rank(peer, what: str):
    """A peer as a job's process takes it: a rank (Bagua's API), or the one worker's
    peer as the plugin's algorithms give it everywhere, a ``[1]`` integer tensor (the
    ``[W]`` peers of W workers, W = 1 in a job; -1: no peer, returned as None)."""
    if isinstance(peer, torch.Tensor):
        if peer.numel() != 1 or peer.dtype.is_floating_point or peer.dtype.is_complex or peer.dtype == torch.bool:
            raise ValueError(f"{what}: a peer given as a tensor is every worker's peer, a [1] integer tensor in a "
                             f"job (one worker), got {peer.dtype} of shape {tuple(peer.shape)}")
        peer = int(peer.reshape(()))
        return None if peer == -1 else peer
    return peer


def _check_tensor(name: str, t, contiguous: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it), got strides {t.stride()}")


def _check_same_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{b_name} has dtype {b.dtype} but {a_name} has dtype {a.dtype}; they must match")


def _reduce_op(op, tensor: torch.Tensor) -> ReduceOp:
    names = ", ".join(f"ReduceOp.{o.name}" for o in ReduceOp)
    if isinstance(op, ReduceOp):
        pass
    elif isinstance(op, int) and not isinstance(op, bool):
        try:
            op = ReduceOp(op)
        except ValueError:
            raise ValueError(f"op must be one of {names}, got {op!r}") from None
    elif getattr(op, "name", None) in ReduceOp.__members__:  # torch.distributed.ReduceOp.X
        op = ReduceOp[op.name]
    else:
        raise ValueError(f"op must be one of {names}, got {op!r}")
    if op in _BITWISE_OPS and (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"op=ReduceOp.{op.name} needs an integer or bool tensor, got dtype {tensor.dtype}")
    return op


def _counts(name: str, value, n: int, total: int | None = None) -> list[int]:
    """``value`` (a sequence, tensor or NumPy array of non-negative integers, one per
    rank) as a list. Displacements pass ``total`` = the sum of their counts: like Bagua,
    they may then also have n + 1 entries, the last being that total (the offsets of an
    MPI-style prefix sum); it is dropped."""
    if hasattr(value, "tolist"):  # torch.Tensor, numpy.ndarray
        value = value.tolist()
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of {n} non-negative integers (one per rank), got {value!r}") from None
    out = []
    for i, v in enumerate(items):
        out.append(check_int(f"{name}[{i}]", v, 0, what="a non-negative integer"))
    if total is not None and len(out) == n + 1:
        if out[n] != total:
            raise ValueError(
                f"{name} has {n + 1} entries, so its last must be the total of the counts ({total}) as in "
                f"Bagua's prefix-sum form, got {out[n]}; or give {n} entries, one per rank"
            )
        out = out[:n]
    if len(out) != n:
        extra = f" (or {n + 1}, the last being the total of the counts)" if total is not None else ""
        raise ValueError(f"{name} must have one entry per rank of the communicator ({n}){extra}, got {len(out)}")
    return out


def _regions(counts_name: str, counts: list[int], displs_name: str, displs: list[int], tensor_name: str, numel: int,
             disjoint: bool) -> bool:
    """Check that the regions fit in the tensor; True if they are packed in rank order from 0."""
    for i, (c, d) in enumerate(zip(counts, displs)):
        if d + c > numel:
            raise ValueError(
                f"{displs_name}[{i}] + {counts_name}[{i}] = {d} + {c} = {d + c} exceeds {tensor_name}.numel() = {numel}"
            )
    if disjoint:
        spans = sorted((d, d + c, i) for i, (c, d) in enumerate(zip(counts, displs)) if c)
        for (s0, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
            if s1 < e0:
                raise ValueError(
                    f"{tensor_name} regions of ranks {i0} and {i1} overlap ({displs_name}, {counts_name}); "
                    "every rank's region must be distinct"
                )
    offset = 0
    for c, d in zip(counts, displs):
        if c and d != offset:
            return False
        offset += c
    return True
