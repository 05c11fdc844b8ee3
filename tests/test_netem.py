"""Emulated networks (benchmarks/netem.py): argument checks everywhere; with root and
iproute2, a real two-node job over rate-limited veth links, compared with one node.

The two-node job is the plugin's launcher on each of two network namespaces
(--nnodes 2, two workers each), gloo over the emulated links. gradient_allreduce and
decentralized(hierarchical=True) must end, rank by rank, where a one-node,
four-worker run on loopback ends: both average exactly whatever the node layout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bagua_algos.experiments.netem import EmulatedNetwork, NetemError, check_delay, check_rate, check_support, existing_namespaces
from subprocesses import REPO, child_env, free_port, run_python

WORKER = Path(__file__).resolve().parent / "launch_workers" / "train_and_dump.py"
needs_netns = pytest.mark.skipif(check_support() is not None, reason=str(check_support()))


@pytest.mark.parametrize("rate", ["1 gbit", "fast", "", "10gbps", None])
def test_bad_rate_is_named(rate):
    with pytest.raises(ValueError, match="rate must be a tc rate"):
        check_rate(rate)


@pytest.mark.parametrize("delay", ["1", "2 ms", "-1ms"])
def test_bad_delay_is_named(delay):
    with pytest.raises(ValueError, match="delay must be a time"):
        check_delay(delay)


@pytest.mark.parametrize("nodes", [0, -1, 1000, 2.0, True])
def test_bad_node_count_is_named(nodes):
    with pytest.raises(ValueError, match="nodes must be an int"):
        EmulatedNetwork(nodes)


def test_command_line_without_script_is_an_error(capsys):
    from bagua_algos.experiments import netem

    with pytest.raises(SystemExit) as exc:
        netem.main(["--nodes", "2"])
    assert exc.value.code == 2
    assert "give the training script" in capsys.readouterr().err


def _run_two_nodes(tmp_path: Path, algorithm: str, tag: str) -> list:
    out = tmp_path / f"two_nodes_{algorithm}"
    out.mkdir()
    with EmulatedNetwork(nodes=2, rate="1gbit", tag=tag) as net:
        net.run_job([str(WORKER), str(out), algorithm], nproc_per_node=2, timeout=150,
                    master_port=free_port(), log_dir=tmp_path / f"logs_{algorithm}")
    return [torch.load(out / f"rank_{r}.pt") for r in range(4)]


def _run_one_node(tmp_path: Path, algorithm: str) -> list:
    out = tmp_path / f"one_node_{algorithm}"
    out.mkdir()
    code, _, err = run_python(["-m", "bagua_algos.launch", "--nproc_per_node", "4", "--master_port",
                               str(free_port()), str(WORKER), str(out), algorithm], timeout=150)
    assert code == 0, err[-3000:]
    return [torch.load(out / f"rank_{r}.pt") for r in range(4)]


@needs_netns
@pytest.mark.parametrize("algorithm", ["gradient_allreduce", "decentralized_hierarchical"])
def test_two_nodes_over_emulated_links_end_as_one_node(tmp_path, algorithm):
    tag = f"bt{free_port()}"
    two = _run_two_nodes(tmp_path, algorithm, tag)
    # only our own: other tests may build networks at the same time (pytest -n)
    assert not [ns for ns in existing_namespaces() if ns.startswith(tag + "-")], "namespaces left behind"
    assert sorted(r["layout"] for r in two) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    one = _run_one_node(tmp_path, algorithm)
    for r in range(4):  # D-PSGD's workers differ (each adds its own gradient): compare rank by rank
        torch.testing.assert_close(two[r]["params"], one[r]["params"], atol=1e-6, rtol=1e-5)
    if algorithm == "gradient_allreduce":
        for r in range(1, 4):
            torch.testing.assert_close(two[r]["params"], two[0]["params"], atol=0, rtol=0)


@needs_netns
def test_links_are_limited_and_everything_is_removed_on_failure():
    """A rate limit slows a bulk transfer between two nodes; an exception inside the
    context still removes every namespace."""
    tag = f"bt{free_port()}"
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedNetwork(nodes=2, rate="20mbit", tag=tag) as net:
            assert set(net.namespaces) | {net.switch} <= set(existing_namespaces())
            server = net.popen(1, ["python3", "-c", (
                "import socket; s=socket.socket(); s.bind(('0.0.0.0', 5201)); s.listen(1); c,_=s.accept();\n"
                "n=0\nwhile True:\n d=c.recv(1<<16)\n if not d: break\n n+=len(d)\nprint(n)")],
                stdout=subprocess.PIPE, text=True)
            client = net.popen(0, ["python3", "-c", (
                "import socket, time\n"
                "for _ in range(50):\n"
                "  try:\n    c=socket.create_connection(('%s', 5201)); break\n"
                "  except OSError: time.sleep(0.1)\n"
                "t=time.time(); c.sendall(b'x'*(5<<20)); c.close(); print(time.time()-t)") % net.address(1)],
                stdout=subprocess.PIPE, text=True)
            seconds = float(client.communicate(timeout=60)[0])
            received = int(server.communicate(timeout=60)[0])
            assert received == 5 << 20
            # 5 MiB at 20 Mbit/s takes ≈ 2.1 s; unlimited loopback-speed veth takes ≪ 0.5 s.
            assert seconds > 1.0, seconds
            raise RuntimeError("boom")
    assert not [ns for ns in existing_namespaces() if ns.startswith(tag + "-")]


@needs_netns
def test_sigterm_to_a_library_user_removes_namespaces_and_workers(tmp_path):
    """A script that uses EmulatedNetwork as a library (as network_sweep.py does), killed
    with SIGTERM while its job runs: its namespaces and its workers are gone after it.
    Before, only netem.py's own command line turned SIGTERM into the clean-up path."""
    tag = f"bt{free_port()}"
    marker = tmp_path / "started"
    script = tmp_path / "user.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from bagua_algos.experiments.netem import EmulatedNetwork\n"
        f"with EmulatedNetwork(nodes=2, rate='1gbit', tag={tag!r}) as net:\n"
        "    worker = net.popen(1, ['sleep', '300'])\n"
        f"    open({str(marker)!r}, 'w').write(str(worker.pid))\n"
        "    worker.wait()\n"
    )
    log = open(tmp_path / "user.log", "w")
    user = subprocess.Popen([sys.executable, str(script)], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))  # as from a shell
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert user.poll() is None, (tmp_path / "user.log").read_text()
            assert time.monotonic() < deadline, "the script did not start its worker"
            time.sleep(0.1)
        worker_pid = int(marker.read_text())
        assert f"{tag}-n0" in existing_namespaces()
        user.send_signal(signal.SIGTERM)
        user.wait(timeout=60)
    finally:
        if user.poll() is None:
            user.kill()
        log.close()
    assert not [ns for ns in existing_namespaces() if ns.startswith(tag + "-")], "namespaces left behind"
    with pytest.raises(ProcessLookupError):  # the worker's session was killed too
        os.kill(worker_pid, 0)


def test_network_sweep_arguments_are_checked():
    from bagua_algos.experiments import network_sweep

    for argv, match in ((["--rates", "fast"], "--rates"), (["--rates", ","], "--rates"),
                        (["--configs", "no_such_algo"], "--configs"), (["--nodes", "0"], "--nodes")):
        with pytest.raises(SystemExit):
            network_sweep.parse_args(argv)


def test_network_sweep_plot_draws_every_config(tmp_path):
    from bagua_algos.experiments.network_sweep import plot_throughput

    reports = {rate: {"results": [{"config": f"c{i}", "images_per_s": (i + 1) * scale} for i in range(12)]}
               for rate, scale in (("100mbit", 1.0), ("1gbit", 10.0))}
    path = tmp_path / "plot.png"
    plot_throughput(reports, "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_netns
def test_network_sweep_runs_over_emulated_links(tmp_path):
    before = set(existing_namespaces())
    code, out, err = run_python([str(REPO / "benchmarks" / "network_sweep.py"), "--nodes", "2", "--rates", "10gbit",
                                 "--model", "cnn", "--batch-size", "4", "--steps", "2", "--warmup", "1",
                                 "--rounds", "1", "--timeout", "150", "--out-dir", str(tmp_path),
                                 "--configs", "gradient_allreduce;terngrad:bits=2"], timeout=200)
    assert code == 0, err[-3000:]
    # the sweep's networks take EmulatedNetwork's default tag, "bn<pid>"; other tests'
    # networks (pytest -n) have tags of their own
    assert not [ns for ns in set(existing_namespaces()) - before if ns.startswith("bn")]
    report = json.loads((tmp_path / "results.json").read_text())
    rows = {row["config"]: row for row in report["10gbit"]["results"]}
    assert set(rows) == {"gradient_allreduce", "terngrad:bits=2"}
    assert rows["terngrad:bits=2"]["bytes_per_step"] < rows["gradient_allreduce"]["bytes_per_step"] / 10
    assert (tmp_path / "throughput_vs_bandwidth.png").stat().st_size > 0
    assert "10gbit: baseline gradient_allreduce" in out
