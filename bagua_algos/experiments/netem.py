"""Emulated networks: each "node" of a job in its own Linux network namespace.

The nodes' namespaces are joined by veth pairs to a bridge that lives in a namespace
of its own (the "switch"), so nothing is added to the host's namespace and only
addresses of the benchmarking range 198.18.0.0/15 (RFC 2544) are used. ``tc`` limits
each link in both directions with a token bucket (``tbf``): the node's egress on its
end, the node's ingress on the switch's end. Delay needs the ``netem`` qdisc; where the
kernel lacks it (as on the machine this was written on) ``--delay`` is refused with a
clear message rather than silently ignored.

    node 0 ns  [eth: bn0 198.18.0.1] ──veth── [p0]┐
    node 1 ns  [eth: bn1 198.18.0.2] ──veth── [p1]┤ bridge br0 (switch ns)
    ...                                            ┘

Every namespace and link is created under a name unique to this process and removed
on exit, on an exception, on SIGINT/SIGTERM and when a worker fails (deleting a
namespace deletes the veth ends in it). Needs root (CAP_NET_ADMIN) and ``ip``/``tc``;
without them :func:`check_support` says which is missing.

Command line: run one job across N emulated nodes, each node starting its workers
with the plugin's launcher (``--nnodes N --node_rank i``), bounded by ``--timeout``::

    sudo python benchmarks/netem.py --nodes 2 --nproc-per-node 2 --rate 1gbit -- \\
        benchmarks/synthetic_benchmark.py --model resnet18 ...

As a library: ``with EmulatedNetwork(nodes=2, rate="100mbit") as net:
net.run_job([...])``, or ``net.popen(i, argv)`` for any command in node i's namespace.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# The directory this copy of bagua_algos was imported from (a checkout or site-packages):
# the jobs' processes import the same copy.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]

SUBNET = ipaddress.ip_network("198.18.0.0/24")  # inside 198.18.0.0/15, the benchmarking range
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
_DELAY = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
MAX_NODES = 64


class NetemError(RuntimeError):
    """The emulated network could not be built, or a job on it failed."""


def check_support() -> Optional[str]:
    """None if namespaces and tc can be used here, else why not (for a clean skip)."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network emulation needs Linux network namespaces"
    if os.geteuid() != 0:
        return "network emulation needs root (CAP_NET_ADMIN) to create namespaces and veth links"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network emulation needs the '{tool}' command (iproute2)"
    return None


def check_rate(rate: str) -> str:
    if not isinstance(rate, str) or not _RATE.match(rate.lower()):
        raise ValueError(f"rate must be a tc rate such as '100mbit', '1gbit' or '10gbit', got {rate!r}")
    return rate.lower()


def check_delay(delay: Optional[str]) -> Optional[str]:
    if delay is None:
        return None
    if not isinstance(delay, str) or not _DELAY.match(delay.lower()):
        raise ValueError(f"delay must be a time such as '500us' or '2ms', got {delay!r}")
    return delay.lower()


def rate_bits(rate: str) -> float:
    number, unit = re.match(r"^([\d.]+)([a-z]+)$", rate).groups()
    return float(number) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[unit]


def _burst_bytes(rate: str) -> int:
    """A token bucket deep enough for the rate at the kernel's timer resolution
    (rate / 250 Hz), and at least a few jumbo frames, so the link reaches its rate."""
    return max(64 * 1024, int(rate_bits(rate) / 8 / 250))


class EmulatedNetwork:
    """``nodes`` network namespaces on one bridge, links limited to ``rate``.

    Node i's address is ``address(i)`` (198.18.0.i+1) on interface ``interface(i)``;
    each namespace also has its loopback up, so workers of one node talk over it.
    """

    def __init__(self, nodes: int, rate: str = "1gbit", delay: Optional[str] = None, tag: Optional[str] = None):
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an int in [1, {MAX_NODES}], got {nodes!r}")
        self.nodes = nodes
        self.rate = check_rate(rate)
        self.delay = check_delay(delay)
        self.tag = tag or f"bn{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-n{i}" for i in range(nodes)]
        self._created: List[str] = []
        self._processes: List[subprocess.Popen] = []

    # --- names -----------------------------------------------------------------------
    @staticmethod
    def interface(node: int) -> str:
        return f"bn{node}"

    @staticmethod
    def address(node: int) -> str:
        return str(SUBNET.network_address + node + 1)

    # --- life cycle ------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        reason = check_support()
        if reason:
            raise NetemError(reason)
        # SIGTERM (a timeout, `kill`, a scheduler) takes the same clean-up path as
        # Ctrl-C; without it the interpreter dies at once, leaving the namespaces and
        # the workers (in sessions of their own) behind. Signals go to the main thread.
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_on_signal)
        try:
            self._build()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def _ip(self, *args: str, namespace: Optional[str] = None) -> None:
        command = ["ip"] + (["-n", namespace] if namespace else []) + list(args)
        self._check(command)

    def _tc(self, namespace: str, *args: str) -> None:
        self._check(["ip", "netns", "exec", namespace, "tc", *args])

    @staticmethod
    def _check(command: Sequence[str]) -> None:
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if result.returncode:
            raise NetemError(f"{' '.join(command)} failed: {result.stderr.strip() or result.stdout.strip()}")

    def _limit(self, namespace: str, device: str) -> None:
        burst = _burst_bytes(self.rate)
        self._tc(namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "tbf",
                 "rate", self.rate, "burst", str(burst), "latency", "50ms")
        if self.delay:
            try:
                self._tc(namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:",
                         "netem", "delay", self.delay)
            except NetemError as error:
                raise NetemError(
                    f"delay={self.delay!r} needs the kernel's netem qdisc, which is not available here ({error}); "
                    "run without --delay"
                ) from None

    def _build(self) -> None:
        for namespace in [self.switch, *self.namespaces]:
            if namespace in existing_namespaces():
                raise NetemError(f"network namespace {namespace!r} exists already (another run with tag {self.tag!r}?)")
            self._ip("netns", "add", namespace)
            self._created.append(namespace)
            self._ip("link", "set", "lo", "up", namespace=namespace)
        self._ip("link", "add", "br0", "type", "bridge", namespace=self.switch)
        self._ip("link", "set", "br0", "up", namespace=self.switch)
        for i, namespace in enumerate(self.namespaces):
            port, interface = f"p{i}", self.interface(i)
            # Both ends are made inside our namespaces: nothing appears in the host's.
            self._ip("link", "add", port, "type", "veth", "peer", "name", interface, "netns", namespace,
                     namespace=self.switch)
            self._ip("link", "set", port, "master", "br0", namespace=self.switch)
            self._ip("link", "set", port, "up", namespace=self.switch)
            self._ip("addr", "add", f"{self.address(i)}/{SUBNET.prefixlen}", "dev", interface, namespace=namespace)
            self._ip("link", "set", interface, "up", namespace=namespace)
            self._limit(namespace, interface)  # node → switch
            self._limit(self.switch, port)  # switch → node

    def close(self) -> None:
        """Stop our processes, then delete every namespace we created (their links go with them)."""
        for process in self._processes:
            if process.poll() is None:
                _kill_group(process)
        self._processes.clear()
        for namespace in reversed(self._created):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        self._created.clear()

    # --- running things --------------------------------------------------------------
    def environment(self, node: int) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
            env.pop(name, None)  # a launcher's variables from an outer job would confuse ours
        env["GLOO_SOCKET_IFNAME"] = self.interface(node)  # gloo: use the emulated link, not loopback
        env["NCCL_SOCKET_IFNAME"] = self.interface(node)
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
        return env

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``'s namespace (its own process group)."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in [0, {self.nodes}), got {node!r}")
        process = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv],
                                   env=kwargs.pop("env", self.environment(node)), start_new_session=True, **kwargs)
        self._processes.append(process)
        return process

    def run_job(self, script_argv: Sequence[str], nproc_per_node: int = 1, timeout: float = 600.0,
                master_port: int = 29500, log_dir: Optional[Path] = None) -> List[int]:
        """One job over all nodes: node i runs the plugin's launcher with ``--nnodes N
        --node_rank i`` and the master at node 0's address. Returns the launchers' exit
        codes; raises NetemError if one fails or the job outlives ``timeout``."""
        launcher = [sys.executable, "-m", "bagua_algos.launch", "--nnodes", str(self.nodes),
                    "--nproc_per_node", str(nproc_per_node), "--master_addr", self.address(0),
                    "--master_port", str(master_port)]
        processes = []
        logs = []
        for node in range(self.nodes):
            out = None
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                out = open(log_dir / f"node{node}.log", "w")
                logs.append(out)
            processes.append(self.popen(node, [*launcher, "--node_rank", str(node), *script_argv],
                                        stdout=out, stderr=subprocess.STDOUT if out else None))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in processes):
                failed = [i for i, p in enumerate(processes) if p.returncode not in (None, 0)]
                if failed:
                    raise NetemError(f"node {failed[0]}'s launcher exited with {processes[failed[0]].returncode}")
                if time.monotonic() > deadline:
                    raise NetemError(f"the job did not finish within {timeout:.0f} s")
                time.sleep(0.2)
            codes = [p.returncode for p in processes]
            if any(codes):
                raise NetemError(f"launcher exit codes per node: {codes}")
            return codes
        finally:
            for p in processes:
                if p.poll() is None:
                    _kill_group(p)
            for out in logs:
                out.close()


def _kill_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def existing_namespaces() -> List[str]:
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _raise_on_signal(signum, frame):  # SIGTERM → the same clean-up path as Ctrl-C
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (namespaces), default 2")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per node, default 1")
    parser.add_argument("--rate", default="1gbit", help="link rate per direction (tc syntax), default 1gbit")
    parser.add_argument("--delay", default=None, help="one-way delay per link (needs the netem qdisc)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is stopped")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--log-dir", type=Path, default=None, help="write each node's output to DIR/nodeI.log")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS]: the training script and its arguments")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the training script after --")
    reason = check_support()
    if reason:
        print(f"netem: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_on_signal)
    try:
        with EmulatedNetwork(args.nodes, args.rate, args.delay) as net:
            print(f"netem: {args.nodes} nodes × {args.nproc_per_node} workers, links {net.rate}"
                  f"{' + ' + net.delay if net.delay else ''} each way", file=sys.stderr, flush=True)
            net.run_job(script, args.nproc_per_node, args.timeout, args.master_port, args.log_dir)
    except (NetemError, ValueError) as error:
        print(f"netem: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netem: interrupted; namespaces removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
