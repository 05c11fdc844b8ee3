"""Bagua 0.9's communication API on torch.distributed (gloo): every collective checked
against a direct computation, over the whole job, new_group subgroups, torch groups and
node communicators; rank conventions; bad input; timeouts; asynchronous two-level
allreduce; clean exits of jobs that use the neighbour exchange.

Each spawn of 4 workers costs seconds, so one spawn runs many checks and returns the
results; the expectations are computed here, in the test process, from the same
deterministic inputs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch

from bagua_algos.runtime import comm

from collective_cases import TWO_NODES, all_collectives, expected_collectives, inp
from bagua_algos.experiments.gloo_workers import run_workers
from subprocesses import REPO, child_env, run_python

N = 4


def _collectives_worker(rank, n):
    default = comm._get_default_group()
    sub = comm.new_group([3, 1, 2])
    objects = {
        "world": None,
        "default_pg": default,
        "sub": sub,
        "sub_global": sub.get_global_communicator(),
        "torch": sub.torch_group,
        "intra": default.get_intra_node_communicator(),
        "inter": default.get_inter_node_communicator(),
        "sub_intra": sub.get_intra_node_communicator(),
        "sub_inter": sub.get_inter_node_communicator(),
    }
    out = {"collectives": {cn: all_collectives(cn, obj) for cn, obj in objects.items()}}

    # group= takes global ranks (the project's convention), comm= ranks inside it.
    g = {}
    t = inp("g/broadcast", rank, 3)
    comm.broadcast(t, src=3, group=sub)
    g["broadcast"] = t
    send, recv = inp("g/reduce", rank, 3), torch.full((3,), 99)
    comm.reduce(send, recv, dst=2, op=comm.ReduceOp.SUM, group=sub)
    g["reduce"] = recv
    send, recv = inp("g/gather", rank, 2), torch.full((6,), 99)
    comm.gather(send, recv, dst=1, group=sub)
    g["gather"] = recv
    send, recv = inp("g/scatter", rank, 6), torch.zeros(2, dtype=torch.int64)
    comm.scatter(send, recv, src=3, group=sub)
    g["scatter"] = recv
    if rank == 1:
        comm.send(inp("g/send", rank, 2), dst=3, group=sub)
    if rank == 3:
        t = torch.zeros(2, dtype=torch.int64)
        comm.recv(t, src=1, group=sub)
        g["recv"] = t
    t = inp("g/local_src", rank, 3)
    comm.broadcast(t, 1, sub)  # comm= (positional): rank 1 of [1, 2, 3] is global rank 2
    g["local_src"] = t
    out["group"] = g

    out["ids"] = {
        "env": (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_local_size(),
                comm.get_node_rank()),
        "sub": (comm.get_rank(sub), comm.get_world_size(sub), comm.group_rank(sub), comm.group_ranks(sub),
                sub.ranks, sub.rank(), sub.size()),
        "default": (default.ranks, comm._get_default_group() is default, comm.group_ranks(None)),
        "module_intra": comm.group_ranks(comm.intra_node_group()),
        "module_inter": comm.group_ranks(comm.inter_node_group()),
        "backend": (comm.get_backend_name(), comm.get_backend_name(sub) if rank else None),
        "torch_group_rank": comm.get_rank(sub.torch_group),
    }
    wrapped = comm.from_torch_group(sub.torch_group) if rank else None
    out["ids"]["from_torch_group"] = None if wrapped is None else (wrapped.ranks, wrapped.rank())
    out["non_member"] = (
        comm.allreduce_inplace(torch.ones(2), comm.ReduceOp.SUM, sub),
        type(comm.allreduce_inplace(torch.ones(2), comm.ReduceOp.SUM, sub, async_op=True)).__name__,
        comm.broadcast(torch.ones(2), 99, sub),  # not checked on a non-member, as in Bagua
    ) if rank == 0 else None
    out["errors"] = _bad_input(rank, sub)
    out["hierarchical"] = _hierarchical_async(rank, n)
    return out


# Cases that rank 0 skips: it is not a member of sub, where these calls return at once.
NOT_A_MEMBER_OF_SUB = ("src_not_in_group", "dst_local_out_of_range", "comm_and_group")


def _bad_input(rank, sub) -> dict:
    f, i64 = torch.zeros(8), torch.zeros(8, dtype=torch.int64)
    cases = {
        "allreduce_shape": lambda: comm.allreduce(torch.zeros(3), torch.zeros(4)),
        "allreduce_dtype": lambda: comm.allreduce(torch.zeros(3), torch.zeros(3, dtype=torch.int64)),
        "op_unknown": lambda: comm.allreduce_inplace(f, 5),
        "op_string": lambda: comm.allreduce_inplace(f, "sum"),
        "op_bitwise_float": lambda: comm.allreduce_inplace(f, comm.ReduceOp.BXOR),
        "allgather_size": lambda: comm.allgather(torch.zeros(2), torch.zeros(7)),
        "allgather_inplace_size": lambda: comm.allgather_inplace(torch.zeros(7)),
        "reduce_scatter_size": lambda: comm.reduce_scatter(torch.zeros(7), torch.zeros(2)),
        "reduce_scatter_inplace_size": lambda: comm.reduce_scatter_inplace(torch.zeros(6)),
        "alltoall_size": lambda: comm.alltoall(torch.zeros(6), torch.zeros(6)),
        "alltoall_recv_size": lambda: comm.alltoall(torch.zeros(8), torch.zeros(4)),
        "gather_size": lambda: comm.gather(torch.zeros(2), torch.zeros(7), comm.get_rank()),
        "scatter_size": lambda: comm.scatter(torch.zeros(7), torch.zeros(2), comm.get_rank()),
        "gather_inplace_size": lambda: comm.gather_inplace(torch.zeros(3), 2, (comm.get_rank() + 1) % N),
        "v_len": lambda: comm.alltoall_v(i64, [1, 1, 1], [0, 1, 2, 3], i64, [1] * 4, [0, 1, 2, 3]),
        "v_displs_total": lambda: comm.alltoall_v(i64, [1] * 4, [0, 1, 2, 3, 5], i64, [1] * 4, [0, 1, 2, 3]),
        "v_displs_len": lambda: comm.alltoall_v(i64, [1] * 4, [0, 1, 2, 3, 4, 5], i64, [1] * 4, [0, 1, 2, 3]),
        "v_negative": lambda: comm.alltoall_v(i64, [1, -1, 1, 1], [0, 1, 2, 3], i64, [1] * 4, [0, 1, 2, 3]),
        "v_not_int": lambda: comm.alltoall_v(i64, [1, 1.5, 1, 1], [0, 1, 2, 3], i64, [1] * 4, [0, 1, 2, 3]),
        "v_overflow": lambda: comm.alltoall_v(i64, [1, 1, 1, 3], [0, 1, 2, 6], i64, [1] * 4, [0, 1, 2, 3]),
        "v_overlap": lambda: comm.alltoall_v(i64, [1] * 4, [0, 1, 2, 3], i64, [2, 2, 1, 1], [0, 1, 4, 5]),
        "v_inplace_overlap": lambda: comm.alltoall_v_inplace(i64, [2, 2, 1, 1], [0, 1, 4, 5]),
        "src_out_of_range": lambda: comm.broadcast(f, 4),
        "src_not_in_group": lambda: comm.broadcast(f, src=0, group=sub),
        "dst_local_out_of_range": lambda: comm.reduce_inplace(f, 3, comm.ReduceOp.SUM, sub),
        "send_to_self": lambda: comm.send(f, comm.get_rank()),
        "comm_and_group": lambda: comm.allreduce_inplace(f, comm.ReduceOp.SUM, None if rank == 0 else sub, group=sub),
        "not_contiguous": lambda: comm.allreduce_inplace(torch.zeros(4, 4).t()),
        "not_a_tensor": lambda: comm.allreduce_inplace([1.0, 2.0]),
        "bad_comm": lambda: comm.allreduce_inplace(f, comm.ReduceOp.SUM, "world"),
        "new_group_rank": lambda: comm.new_group([0, 4]),
        "new_group_dup": lambda: comm.new_group([1, 1]),
        "hierarchical_op": lambda: comm.hierarchical_allreduce_inplace(f, comm.ReduceOp.MAX),
    }
    errors = {}
    for key, call in cases.items():
        if key in NOT_A_MEMBER_OF_SUB and rank == 0:
            continue  # rank 0 is not a member of sub: these return at once there
        try:
            call()
            errors[key] = None
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    return errors


def _hierarchical_async(rank, n) -> dict:
    """Several two-level allreduces in flight at once while rank 3 is late."""
    out = {}
    warm = torch.full((3,), float(rank))
    comm.hierarchical_allreduce_inplace(warm, comm.ReduceOp.SUM)  # creates the groups
    out["warm"] = warm
    comm.barrier()
    if rank == 3:
        time.sleep(1.5)
    tensors = [inp(f"hier/{k}", rank, 1000 + k, torch.float64) for k in range(3)]
    started = time.monotonic()
    handles = [comm.hierarchical_allreduce_inplace(t, op, async_op=True)
               for t, op in zip(tensors, [comm.ReduceOp.SUM, comm.ReduceOp.AVG, comm.ReduceOp.SUM])]
    out["return_s"] = time.monotonic() - started
    out["completed_at_return"] = [h.is_completed() for h in handles]
    # Meanwhile the caller's thread uses the public node groups.
    side = torch.full((2,), float(rank + 1))
    comm.allreduce_inplace(side, comm.ReduceOp.SUM, group=comm.inter_node_group())
    out["side"] = side
    for h in handles:
        h.wait()
    out["wait_s"] = time.monotonic() - started
    out["tensors"] = tensors
    out["done"] = [h.done for h in handles]
    t = inp("hier/sync", rank, 7, torch.float64)
    assert comm.hierarchical_allreduce_inplace(t, comm.ReduceOp.AVG) is None
    out["sync"] = t
    return out


# Which global ranks each communicator spans, seen from each rank (-1: not a member).
EXPECTED_MEMBERS = {
    "world": {r: [0, 1, 2, 3] for r in range(N)},
    "default_pg": {r: [0, 1, 2, 3] for r in range(N)},
    "sub": {r: [1, 2, 3] for r in range(N)},
    "sub_global": {r: [1, 2, 3] for r in range(N)},
    "torch": {0: [], 1: [1, 2, 3], 2: [1, 2, 3], 3: [1, 2, 3]},
    "intra": {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]},
    "inter": {r: [0, 2] for r in range(N)},  # Bagua: the ranks with ranks[0]'s local rank
    "sub_intra": {0: [1], 1: [1], 2: [2, 3], 3: [2, 3]},
    "sub_inter": {r: [1, 3] for r in range(N)},
}


@pytest.fixture(scope="module")
def four_workers():
    started = time.monotonic()
    results = run_workers(_collectives_worker, N, env=TWO_NODES, timeout=240)
    print(f"4-worker collective spawn: {time.monotonic() - started:.1f} s")
    return results


@pytest.mark.parametrize("cn", sorted(EXPECTED_MEMBERS))
def test_every_collective_matches_a_direct_computation(four_workers, cn):
    checked = 0
    for rank, result in enumerate(four_workers):
        got = result["collectives"][cn]
        members = EXPECTED_MEMBERS[cn][rank]
        assert got["ranks"] == members
        i = members.index(rank) if rank in members else -1
        assert got["rank"] == i
        if i < 0:
            continue
        for key, want in expected_collectives(cn, members, i).items():
            have = got[key]
            if isinstance(want, tuple):
                for w, h in zip(want, have):
                    torch.testing.assert_close(h, w, msg=lambda m: f"{cn} {key} on rank {rank}: {m}")
            else:
                torch.testing.assert_close(have, want, msg=lambda m: f"{cn} {key} on rank {rank}: {m}")
            checked += 1
    assert checked > 0


def test_group_keyword_takes_global_ranks_and_comm_takes_communicator_ranks(four_workers):
    for rank, result in enumerate(four_workers):
        g = result["group"]
        if rank == 0:  # not a member of sub: untouched
            assert torch.equal(g["broadcast"], inp("g/broadcast", 0, 3))
            continue
        assert torch.equal(g["broadcast"], inp("g/broadcast", 3, 3))
        assert torch.equal(g["local_src"], inp("g/local_src", 2, 3))
        want = sum(inp("g/reduce", r, 3) for r in (1, 2, 3)) if rank == 2 else torch.full((3,), 99)
        assert torch.equal(g["reduce"], want)
        want = torch.cat([inp("g/gather", r, 2) for r in (1, 2, 3)]) if rank == 1 else torch.full((6,), 99)
        assert torch.equal(g["gather"], want)
        assert torch.equal(g["scatter"], inp("g/scatter", 3, 6)[2 * (rank - 1):2 * rank])
    assert torch.equal(four_workers[3]["group"]["recv"], inp("g/send", 1, 2))


def test_ranks_sizes_and_groups(four_workers):
    for rank, result in enumerate(four_workers):
        ids = result["ids"]
        assert ids["env"] == (rank, N, rank % 2, 2, rank // 2)
        member = rank != 0
        assert ids["sub"] == (rank - 1 if member else -1, 3, rank - 1 if member else -1, [1, 2, 3], [1, 2, 3],
                              rank - 1 if member else -1, 3)
        assert ids["default"] == ([0, 1, 2, 3], True, [0, 1, 2, 3])
        assert ids["module_intra"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert ids["module_inter"] == [rank % 2, rank % 2 + 2]
        assert ids["backend"] == ("gloo", "gloo" if member else None)
        assert ids["torch_group_rank"] == (rank - 1 if member else -1)
        assert ids["from_torch_group"] == (([1, 2, 3], rank - 1) if member else None)
    assert four_workers[0]["non_member"] == (None, "CommHandle", None)


def _bad_input_answers() -> dict:
    """Text that each of _bad_input's calls must raise (a ValueError, or the TypeError
    named); each case is a test of its own, all on the one spawn of four_workers."""
    expect = {
        "allreduce_shape": "recv_tensor shape (4,) differs from send_tensor shape (3,)",
        "allreduce_dtype": "recv_tensor has dtype torch.int64 but send_tensor has dtype torch.float32",
        "op_unknown": "op must be one of ReduceOp.SUM",
        "op_string": "got 'sum'",
        "op_bitwise_float": "op=ReduceOp.BXOR needs an integer or bool tensor",
        "allgather_size": "recv_tensor must have nranks x send_tensor.numel() = 4 x 2 = 8 elements",
        "allgather_inplace_size": "tensor.numel() = 7 must be divisible by the number of ranks (4)",
        "reduce_scatter_size": "send_tensor must have nranks x recv_tensor.numel() = 4 x 2 = 8",
        "reduce_scatter_inplace_size": "tensor.numel() = 6 must be divisible",
        "alltoall_size": "send_tensor.numel() = 6 must be divisible by the number of ranks (4)",
        "alltoall_recv_size": "recv_tensor must have as many elements as send_tensor (8), got 4",
        "gather_size": "recv_tensor must have nranks x send_tensor.numel() = 4 x 2 = 8 elements on the dst rank",
        "scatter_size": "send_tensor must have nranks x recv_tensor.numel() = 4 x 2 = 8 elements on the src rank",
        "gather_inplace_size": "tensor must have count = 2 elements on this rank, got 3",
        "v_len": "send_counts must have one entry per rank of the communicator (4), got 3",
        "v_displs_total": "send_displs has 5 entries, so its last must be the total of the counts (4)",
        "v_displs_len": "send_displs must have one entry per rank of the communicator (4) (or 5, the last being the total",
        "v_negative": "send_counts[1] must be a non-negative integer, got -1",
        "v_not_int": "send_counts[1] must be a non-negative integer, got 1.5",
        "v_overflow": "send_displs[3] + send_counts[3] = 6 + 3 = 9 exceeds send_tensor.numel() = 8",
        "v_overlap": "recv_tensor regions of ranks 0 and 1 overlap",
        "v_inplace_overlap": "tensor regions of ranks 0 and 1 overlap",
        "src_out_of_range": "src=4 is not a rank of this communicator",
        "src_not_in_group": "src=0 is not a member of the group: with group= it is a global rank, one of [1, 2, 3]",
        "dst_local_out_of_range": "dst=3 is not a rank of this communicator: with comm= it is a rank inside the "
                                  "communicator, 0..2",
        "send_to_self": "is this process's own rank",
        "comm_and_group": "pass comm= or group=, not both",
        "not_contiguous": "tensor must be contiguous",
        "not_a_tensor": "TypeError: tensor must be a torch.Tensor, got list",
        "bad_comm": "TypeError: comm/group must be a communicator",
        "new_group_rank": "invalid rank 4, ranks must be in [0, 4)",
        "new_group_dup": "duplicate ranks",
        "hierarchical_op": "supports ReduceOp.SUM and ReduceOp.AVG, got ReduceOp.MAX",
    }
    return expect


BAD_INPUT_ANSWERS = _bad_input_answers()


def test_every_bad_input_case_has_an_expected_answer(four_workers):
    for rank, result in enumerate(four_workers):
        skipped = set(NOT_A_MEMBER_OF_SUB) if rank == 0 else set()
        assert set(result["errors"]) == set(BAD_INPUT_ANSWERS) - skipped, rank


@pytest.mark.parametrize("case", list(BAD_INPUT_ANSWERS))
def test_bad_input_is_a_clear_value_error(four_workers, case):
    text = BAD_INPUT_ANSWERS[case]
    for rank, result in enumerate(four_workers):
        errors = result["errors"]
        if case not in errors:
            assert rank == 0 and case in NOT_A_MEMBER_OF_SUB
            continue
        assert errors[case] is not None, f"{case} was accepted on rank {rank}"
        assert text in errors[case], f"{case} on rank {rank}: {errors[case]}"
        assert errors[case].startswith("TypeError" if text.startswith("TypeError") else "ValueError"), errors[case]


def test_hierarchical_allreduce_is_asynchronous_and_right(four_workers):
    def total(name, size):
        return sum(inp(name, r, size, torch.float64) for r in range(N))

    for rank, result in enumerate(four_workers):
        h = result["hierarchical"]
        torch.testing.assert_close(h["warm"], torch.full((3,), 6.0, dtype=torch.float64).float())
        # Rank 3 is 1.5 s late: the others' calls return at once, before completion.
        if rank != 3:
            assert h["return_s"] < 0.75, h["return_s"]
            assert h["completed_at_return"] == [False] * 3
            assert h["wait_s"] > 1.0
        assert h["done"] == [True] * 3
        for k, (t, scale) in enumerate(zip(h["tensors"], [1, N, 1])):
            torch.testing.assert_close(t, total(f"hier/{k}", 1000 + k) / scale)
        torch.testing.assert_close(h["side"], torch.full((2,), float((rank % 2 + 1) + (rank % 2 + 3))))
        torch.testing.assert_close(h["sync"], total("hier/sync", 7) / N)


# ---------------------------------------------------------------- environment, init


ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _without(monkeypatch, keys=ENV_KEYS) -> None:
    """``keys`` unset for this test, and unset again after it: ``monkeypatch.delenv`` of
    an unset variable records nothing, so the RANK, WORLD_SIZE, ... that a successful
    ``init_process_group`` writes would outlive the test; set first, it is removed."""
    for key in keys:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_environment_getters_work_before_init_with_baguas_defaults(monkeypatch):
    assert not comm.is_initialized()
    _without(monkeypatch)
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_local_size(),
            comm.get_node_rank()) == (0, 1, 0, 1, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_local_size(),
            comm.get_node_rank()) == (5, 8, 1, 4, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(RuntimeError, match="RANK='x' is not an integer"):
        comm.get_rank()
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm.get_rank(object())
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm._get_default_group()


def test_init_process_group_takes_baguas_signature(monkeypatch, tmp_path):
    _without(monkeypatch)
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ValueError, match="also needs rank= and world_size="):
        comm.init_process_group(store)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        comm.init_process_group(store, 2, 2)
    with pytest.raises(ValueError, match=r"local_world_size must be in \[1, 2\]"):
        comm.init_process_group(store, 0, 2, 3)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        comm.init_process_group(store, 0, 1, timeout=-1)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        comm.init_process_group(store, 0, 1, timeout=True)
    # Ranks and sizes are integers, never truncated: 1.5 is not rank 1.
    for name, args in (("rank", (1.5, 2)), ("world_size", (0, 2.0)), ("local_world_size", (0, 2, "2"))):
        with pytest.raises(ValueError, match=rf"^{name} must be an int >= 0 \(or -1: from \$"):
            comm.init_process_group(store, *args)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'gloo', 'nccl'"):
        comm.init_process_group(store, 0, 1, backend="mpi")
    assert not comm.is_initialized()
    comm.init_process_group(store, 0, 1, 1, backend="gloo", timeout=5)
    try:
        assert comm.is_initialized()
        assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank(), comm.get_local_size()) == (0, 1, 0, 1)
        assert comm._state["timeout"] == timedelta(seconds=5)
        with pytest.raises(RuntimeError, match="called twice"):
            comm.init_process_group(store, 0, 1)
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds or a timedelta, got 0"):
            comm.new_group([0], timeout=0)
        t = torch.arange(4.0)
        comm.allreduce_inplace(t, comm.ReduceOp.AVG)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        comm.destroy_process_group()
    assert not comm.is_initialized()


# ------------------------------------------------------------------------ timeouts

PG_TIMEOUT = 3.0


def _silent_peer(rank, n):
    """Rank 3 stops answering; hierarchical and subgroup collectives must fail within
    about the timeout given to init_process_group."""
    sub = comm.new_group([0, 1, 3])
    t = torch.ones(2)
    comm.hierarchical_allreduce_inplace(t)  # all groups exist and work
    comm.allreduce_inplace(t, comm.ReduceOp.SUM, sub)
    comm.barrier()
    out = {}
    if rank == 3:
        time.sleep(2 * PG_TIMEOUT + 6)
        return out
    for name, call in [("hierarchical", lambda: comm.hierarchical_allreduce_inplace(torch.ones(3))),
                       ("subgroup", lambda: comm.allreduce_inplace(torch.ones(3), comm.ReduceOp.SUM, sub))]:
        started = time.monotonic()
        try:
            call()
            out[name] = ("returned", time.monotonic() - started)
        except RuntimeError as exc:
            out[name] = ("raised", time.monotonic() - started, str(exc)[:200])
    return out


def _synced_worker(rank, n, tmp, fn, env, pg_timeout, results):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank % int(env["LOCAL_WORLD_SIZE"])),
                       "LOCAL_WORLD_SIZE": env["LOCAL_WORLD_SIZE"]})
    try:
        torch.set_num_threads(1)
        # With a timeout of seconds, a worker still importing torch would make the
        # rendezvous time out: start together.
        open(os.path.join(tmp, f"ready{rank}"), "w").close()
        while not all(os.path.exists(os.path.join(tmp, f"ready{r}")) for r in range(n)):
            time.sleep(0.05)
        store = torch.distributed.FileStore(os.path.join(tmp, "store"), n)
        comm.init_process_group(store, rank, n, backend="gloo", timeout=pg_timeout)
        try:
            value = fn(rank, n)
        finally:
            comm.destroy_process_group()
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001
        results.put((rank, "error", traceback.format_exc()))


def _run_synced(fn, n, env, pg_timeout, timeout):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_synced_worker, args=(r, n, tmp, fn, env, pg_timeout, results), daemon=True)
                 for r in range(n)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout
        try:
            while len(got) < n and time.monotonic() < deadline:
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    continue
                got[rank] = (status, value)
        finally:
            for p in procs:
                p.join(timeout=1.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    failures = [f"worker {r}: {v}" for r, (s, v) in got.items() if s != "ok"]
    missing = sorted(set(range(n)) - set(got))
    if missing:
        failures.append(f"workers {missing} did not finish within {timeout:.0f} s (a hang?)")
    if failures:
        raise AssertionError("\n".join(failures))
    return [pickle.loads(got[r][1]) for r in range(n)]


def test_a_silent_peer_fails_node_and_sub_groups_within_the_init_timeout():
    results = _run_synced(_silent_peer, N, TWO_NODES, PG_TIMEOUT, timeout=90)
    for rank, out in enumerate(results[:3]):
        # Raised by the timeout (rank 3 is alive and silent until 2 x timeout + 6 s).
        kind, elapsed, *message = out["hierarchical"]
        assert kind == "raised", out
        assert 0.5 * PG_TIMEOUT < elapsed < PG_TIMEOUT + 5, out
        if rank in (0, 1):
            kind, elapsed, *message = out["subgroup"]
            assert kind == "raised", out
            assert 0.5 * PG_TIMEOUT < elapsed < PG_TIMEOUT + 5, out
        else:
            assert out["subgroup"][0] == "returned"  # rank 2 is not a member of [0, 1, 3]


# ------------------------------------------------------------------- exits, repeated


def test_neighbor_exchange_jobs_exit_cleanly_every_time():
    """8 jobs of 5 workers, 15 neighbour-exchange steps each, all exit with code 0
    (half destroy the group themselves, half leave it to the module's exit hook).

    A guard rather than a reproduction: the reported abort at exit ("terminate called
    without an active exception", 13 of 30 launches with batch_isend_irecv) did not
    occur here with torch 2.14.1, before or after the change (0 of 40 launches of the
    old code), and torch 2.14's batch_isend_irecv on gloo already posts one isend /
    irecv per op (gloo does not support coalescing).
    """
    launches, workers = 8, 5
    started = time.monotonic()
    code, out, err = run_python([REPO / "tests" / "launch_workers" / "neighbor_exit.py", launches, workers],
                                env=child_env(), timeout=240)
    assert code == 0, err
    codes = json.loads(out.strip().splitlines()[-1])["codes"]
    assert len(codes) == launches
    bad = [(launch, c) for launch, c in enumerate(codes) if c != [0] * workers]
    assert not bad, f"launches with a failed worker (launch, exit codes): {bad}\n{err[-3000:]}"
    assert "terminate called" not in err
    print(f"{launches} launches of {workers} workers: {time.monotonic() - started:.1f} s")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="lists threads through /proc")
@pytest.mark.parametrize("mode", ["comm", "torch"])
def test_the_group_is_freed_even_after_the_first_optimizer_was_built(mode):
    """The first optimizer built after init imports torch.distributed.nn.functional,
    whose collectives keep the live default group as a default argument. The group must
    still be freed, and no gloo thread outlive it (before the fix, 3 per worker ran on
    into interpreter finalization): by comm.destroy_process_group() itself ("comm"; the
    rewritten defaults still reach the next job's default group), or by comm's exit
    hook when the script called torch's dist.destroy_process_group() ("torch")."""
    code, out, err = run_python([REPO / "tests" / "launch_workers" / "group_release.py", 2, mode],
                                env=child_env(), timeout=120)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    workers = json.loads(out.strip().splitlines()[-1])["workers"]
    assert [w["gloo_threads"] for w in workers] == [[], []]
    if mode == "comm":
        assert [w["second_group_sum"] for w in workers] == [3.0, 3.0]
    assert "terminate called" not in err


def test_backend_choice_names_the_gpu_count_before_any_cuda_call(monkeypatch, tmp_path):
    """More workers on a node than GPUs: a clear error with both counts and the ways out,
    raised before torch.cuda.set_device (never "invalid device ordinal")."""
    monkeypatch.delenv(comm.BACKEND_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_cuda_call(*args, **kwargs):
        raise AssertionError("a CUDA call before the worker count was checked")

    monkeypatch.setattr(torch.cuda, "set_device", no_cuda_call)
    with pytest.raises(RuntimeError) as shortage:
        comm.choose_backend(None, 8)
    assert str(shortage.value) == (
        "backend='auto' puts each worker on its own GPU (device cuda:LOCAL_RANK), but this node runs 8 workers and "
        "has 1 visible GPU; start at most 1 per node (--nproc_per_node 1), or run on the CPU: "
        "init_process_group(backend='gloo'), BAGUA_ALGOS_BACKEND=gloo, or the launcher's --backend gloo")
    _without(monkeypatch, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    store = torch.distributed.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(RuntimeError, match=r"runs 2 workers and has 1 visible GPU;"):
        comm.init_process_group(store, 0, 2, 2)
    assert not comm.is_initialized()
    assert comm.choose_backend(None, 1) == "cpu:gloo,cuda:nccl"  # CUDA over NCCL, CPU tensors over gloo
    assert comm.choose_backend("nccl", 1) == comm.choose_backend("cpu:gloo,cuda:nccl", 1) == "cpu:gloo,cuda:nccl"
    assert comm.choose_backend("gloo", 8) == "gloo"
    monkeypatch.setenv(comm.BACKEND_ENV, "gloo")
    assert comm.choose_backend(None, 8) == "gloo"
    monkeypatch.setenv(comm.BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match=r"\$BAGUA_ALGOS_BACKEND must be one of 'auto', 'gloo', 'nccl'"):
        comm.choose_backend(None, 1)
    monkeypatch.delenv(comm.BACKEND_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert comm.choose_backend(None, 8) == "gloo"
    with pytest.raises(RuntimeError) as no_gpu:
        comm.choose_backend("nccl", 1)
    assert str(no_gpu.value) == (  # no GPU at all: only the CPU is a way out
        "backend='nccl' puts each worker on its own GPU (device cuda:LOCAL_RANK), but this node has no visible GPU; "
        "run on the CPU instead: init_process_group(backend='gloo'), BAGUA_ALGOS_BACKEND=gloo, or the launcher's "
        "--backend gloo")


def test_launcher_backend_flag_sets_the_workers_default(monkeypatch):
    from bagua_algos.launcher import launch

    assert launch.parse_args(["--backend", "gloo", "train.py"]).backend == "gloo"
    assert launch.parse_args(["train.py"]).backend is None
    with pytest.raises(SystemExit):
        launch.parse_args(["--backend", "mpi", "train.py"])


def test_only_the_comm_package_calls_torch_distributed():
    """The rule of the runtime: communication goes through bagua_algos.runtime.comm (the
    launcher's modules import torch.distributed.run and its elastic errors, the agent,
    which is not communication, and binding.py starts the agent's rendezvous store on
    loopback; the experiments, above the runtime, time torch.distributed
    itself as a baseline and start the test harness's process groups)."""
    import ast

    root = REPO / "bagua_algos"
    allowed = {root / "launcher" / "launch.py", root / "launcher" / "report.py", root / "launcher" / "binding.py"}
    offenders = []
    for path in root.rglob("*.py"):
        if ((root / "runtime" / "comm") in path.parents or (root / "experiments") in path.parents
                or path in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders
