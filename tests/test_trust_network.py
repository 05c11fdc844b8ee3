"""Trust and the network (docs/elastic.md): a job on one machine listens on loopback only,
healing takes tensors from the job's own replicas only, and a Bagua script under
``--torchft`` gets its replica's share of the data.

The job tests start real launchers, each in its own session with a hard timeout
(tests/subprocesses.py), and read the listening sockets of the launcher's process tree
from /proc (Linux)."""

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from subprocesses import REPO, child_env, finish, free_port, start_python

WORKERS = Path(__file__).resolve().parent / "launch_workers"
LINUX = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")


# --- listening sockets of a process tree --------------------------------------------------

def _tree(pid: int) -> list:
    """``pid`` and every descendant, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def _socket_inodes(pids) -> set:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_addr: str) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # /proc writes each 32-bit word host-ordered
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def listening(pid: int) -> list:
    """The local addresses of every TCP socket in LISTEN state held by ``pid``'s tree."""
    inodes = _socket_inodes(_tree(pid))
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                found.append(_address(fields[1]))
    return sorted(found)


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host.startswith("127.") or host in ("::1", "::ffff:127.0.0.1")


def _listening_when_ready(proc, ready_dir: Path, count: int, timeout: float = 150) -> list:
    deadline = time.time() + timeout
    while len(list(ready_dir.glob("ready.*"))) < count:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"the workers did not start within {timeout} s"
        time.sleep(0.3)
    time.sleep(1.0)  # the lighthouse and the managers are up before init returns; let the rest settle
    return listening(proc.pid)


@LINUX
@pytest.mark.parametrize("flags", [
    ["--nproc_per_node", "2", "--master_port", "{port}"],          # static, the default master 127.0.0.1
    ["--standalone", "--nproc_per_node", "2"],
    ["--torchft", "--nproc_per_node", "2", "--min_replicas", "2"],
], ids=["static", "standalone", "torchft"])
def test_a_job_on_one_machine_listens_on_loopback_only(tmp_path, flags):
    flags = [f.format(port=free_port()) for f in flags]
    env = child_env()
    env["RUST_LOG"] = "error"
    proc = start_python(["-m", "bagua_algos.launch", "--backend", "gloo", *flags, str(WORKERS / "trust_sleeper.py"),
                         str(tmp_path)], env)
    try:
        addresses = _listening_when_ready(proc, tmp_path, 2)
    finally:
        (tmp_path / "go").touch()
    code, out, err = finish(proc, 120)
    assert code == 0, err[-3000:]
    assert addresses, "no listening socket was found in the job's processes"
    assert all(_loopback(a) for a in addresses), f"listening beyond loopback: {addresses}"


def test_the_rendezvous_address_decides_the_binding():
    from bagua_algos.launcher import binding, launch

    assert binding.rendezvous_address(launch.parse_args(["t.py"]))[0] == "127.0.0.1"
    assert binding.rendezvous_address(launch.parse_args(["--master_addr", "localhost", "t.py"]))[0] == "127.0.0.1"
    assert binding.rendezvous_address(launch.parse_args(["--standalone", "t.py"])) == ("127.0.0.1", 0)
    assert binding.rendezvous_address(launch.parse_args(["--nnodes", "2", "--master_addr", "10.0.0.1", "t.py"])) \
        is None
    c10d = ["--rdzv_backend", "c10d", "--rdzv_endpoint"]
    assert binding.rendezvous_address(launch.parse_args([*c10d, "[::1]:5000", "t.py"])) == ("::1", 5000)
    assert binding.rendezvous_address(launch.parse_args([*c10d, "10.0.0.1", "t.py"])) is None


# --- a Bagua script under --torchft: its replica's share -----------------------------------

def test_a_bagua_script_under_torchft_gets_its_replicas_share(tmp_path):
    """Samplers built right after init_process_group(): torch's DistributedSampler given
    bagua.get_rank()/get_world_size(), the same by torch.distributed's default group, and
    DistributedHeterogeneousSampler by its defaults: every replica a disjoint share; the
    rank and size stay the slot's after the quorum, the collectives span the quorum."""
    from bagua_algos.compat import compat_path

    env = child_env()
    env["RUST_LOG"] = "error"
    env["PYTHONPATH"] = os.pathsep.join([compat_path(), str(REPO), env.get("PYTHONPATH", "")])
    proc = start_python(["-m", "bagua_algos.launch", "--torchft", "--nproc_per_node", "3", "--min_replicas", "3",
                         "--backend", "gloo", str(WORKERS / "trust_share_worker.py"), str(tmp_path)], env)
    code, out, err = finish(proc, 240)
    assert code == 0, err[-3000:]
    recs = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("node0_replica*.json"))]
    assert [(r["rank"], r["world"]) for r in recs] == [(0, 3), (1, 3), (2, 3)]
    assert all(r["after"] == [r["rank"], 3] and r["quorum"] == 3 for r in recs), recs
    for key in ("plain", "torch_default", "hetero"):
        shares = [set(r[key]) for r in recs]
        n = 40
        for i in range(3):
            for j in range(i + 1, 3):
                # torch's samplers pad to equal shares by repeating the first indices (40 = 3 x 14 - 2)
                assert len(shares[i] & shares[j]) <= 2, (key, i, j, sorted(shares[i] & shares[j]))
        assert set().union(*shares) == set(range(n)), key


# --- healing carries tensors only -----------------------------------------------------------

class _Evil:
    """A pickle that, loaded with weights_only=False, creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _serve(body: bytes, headers=None):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"


@pytest.fixture
def ft_state():
    pytest.importorskip("torchft")
    from bagua_algos.runtime.comm import fault_tolerance as ft

    saved = dict(ft._ft)
    ft._ft.update(checks={"bagua": lambda s: None if isinstance(s, dict) and "w" in s else "no 'w'"},
                  refused=None, replica_id="r0")
    yield ft
    ft._ft.clear()
    ft._ft.update(saved)


def test_healing_loads_tensors_only_and_checks_the_signature(tmp_path, ft_state):
    import torch

    ft = ft_state
    transport_class = ft._tensor_transport_class()
    ours = transport_class("127.0.0.1", "127.0.0.1", timedelta(seconds=5), "s3cret")
    theirs = transport_class("127.0.0.1", "127.0.0.1", timedelta(seconds=5), "s3cret")
    try:
        state = {"user": {"bagua": {"w": torch.arange(3.0)}}, "torchft": {"step": 7, "batches_committed": 7}}
        theirs.send_checkpoint([0], 7, state, timedelta(seconds=5))
        got = ours.recv_checkpoint(1, theirs.metadata(), 7, timedelta(seconds=5))
        assert torch.equal(got["user"]["bagua"]["w"], torch.arange(3.0)) and got["torchft"]["step"] == 7

        marker = tmp_path / "pwned"
        evil = io.BytesIO()
        torch.save({"user": {"bagua": _Evil(str(marker))}, "torchft": {"step": 7}}, evil)
        cases = {  # what a foreign server sends -> what the refusal says
            "unsigned": (evil.getvalue(), {}, "not signed with the job's secret"),
            "signed code": (evil.getvalue(), {ft.SIGNATURE_HEADER: ft._sign("s3cret", 7, evil.getvalue())},
                            "more than tensors and plain values"),
        }
        for name, (body, headers, says) in cases.items():
            server, url = _serve(body, headers)
            try:
                if name == "unsigned":  # the payload is live: torchft's own HTTP transport runs it
                    from torch.distributed._serialization import _streaming_save
                    from torchft.checkpointing.http_transport import HTTPTransport

                    live = tmp_path / "live"
                    sent = io.BytesIO()
                    _streaming_save({"x": _Evil(str(live))}, sent)
                    other, other_url = _serve(sent.getvalue())
                    HTTPTransport._load_from_address(other_url + "7/full", timedelta(seconds=5))
                    other.shutdown()
                    assert live.exists()
                with pytest.raises(RuntimeError, match=says):
                    ours.recv_checkpoint(1, url, 7, timedelta(seconds=5))
            finally:
                server.shutdown()
            assert not marker.exists(), f"{name}: the peer's code ran"
            assert says in ft._ft["refused"]
        wrong = {"user": {"bagua": {"x": torch.zeros(1)}}, "torchft": {"step": 7, "batches_committed": 7}}
        theirs.send_checkpoint([0], 7, wrong, timedelta(seconds=5))
        with pytest.raises(RuntimeError, match="does not fit this replica: state 'bagua': no 'w'"):
            ours.recv_checkpoint(1, theirs.metadata(), 7, timedelta(seconds=5))
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_a_healing_state_that_does_not_fit_the_model_is_named():
    import torch

    from bagua_algos.runtime.fault_tolerant_step import FaultTolerantStep

    step = FaultTolerantStep.__new__(FaultTolerantStep)  # only the checks: no manager needed
    model = torch.nn.Linear(3, 2)
    step.ddp = type("D", (), {"module": model})()
    step.optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    good = {"model": model.state_dict(), "optimizer": step.optimizer.state_dict(), "bagua": {}}
    assert step._healing_problem(good) is None
    bad_shape = dict(good, model={**model.state_dict(), "weight": torch.zeros(2, 4)})
    assert "model['weight'] is torch.float32 (2, 4)" in step._healing_problem(bad_shape)
    assert "keys differ" in step._healing_problem(dict(good, model={"weight": torch.zeros(2, 3)}))
    assert "expected {'model', 'optimizer', 'bagua'}" in step._healing_problem({"x": 1})
    momentum = {"state": {0: {"momentum_buffer": torch.zeros(5)}}, "param_groups": good["optimizer"]["param_groups"]}
    assert "'momentum_buffer' of parameter 0 is (5,)" in step._healing_problem(dict(good, optimizer=momentum))


def test_a_foreign_replica_is_refused_and_its_code_never_runs(tmp_path):
    """A process that is not one of the job's joins the lighthouse, announces a step far
    ahead and serves a pickle that would create a marker file: every replica refuses the
    quorum with one line naming it, before any group or heal; the marker never appears."""
    pytest.importorskip("torchft")
    env = child_env()
    env["RUST_LOG"] = "error"
    marker = tmp_path / "pwned"
    proc = start_python(["-m", "bagua_algos.launch", "--torchft", "--nproc_per_node", "2", "--min_replicas", "2",
                         "--join_timeout", "3", "--backend", "gloo", str(WORKERS / "trust_sleeper.py"), str(tmp_path),
                         "--train"], env)
    try:
        _listening_when_ready(proc, tmp_path, 2)
        lighthouse = next(p.read_text() for p in tmp_path.glob("lighthouse.*"))
        evil = subprocess.Popen([sys.executable, str(WORKERS / "trust_foreign_replica.py"), lighthouse, str(marker)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2.0)  # it heartbeats and asks for a quorum
    finally:
        (tmp_path / "go").touch()
    try:
        code, out, err = finish(proc, 150)
    finally:
        evil.kill()
        evil.wait(timeout=10)
    assert not marker.exists(), "a replica ran the foreign process's code"
    refusals = [line for line in err.splitlines() if "not this job's" in line]
    assert code == 1 and len(refusals) == 2 and all("['evil']" in line for line in refusals), err[-3000:]
