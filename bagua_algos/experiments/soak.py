"""A fault-tolerance soak (``bagua-algos soak``, ``benchmarks/soak.py``): for each algorithm
in turn, a job of ``--replicas`` CPU replicas under ``python -m bagua_algos.launch --torchft
--backend gloo`` (loopback only) trains the sweep's digits task (``soak_worker``) while a
random replica is SIGKILLed, or with ``--hang`` SIGSTOPped for a while and then
SIGCONTinued or SIGKILLed, every ``--kill-every A:B`` seconds (seeded). The launcher does not
start a lost replica again (torchft leaves that to the scheduler), so the soak does, with the
same command line and environment: the job keeps its replicas, and the returning one heals
from a live peer. Before it, a fault-free job of the same algorithm (``--baseline-fraction``
of its share) gives the throughput to compare with.

Per algorithm it reports: the committed steps (none lost: each replica's committed steps only
go forward, every step up to the last was committed by some replica, and every replica that
finished ends at the same last step), the stalls (gaps between consecutive committed steps
over ``--stall-seconds``), the committed steps per second against the fault-free job's, and
whether the survivors agree (the allreduce family: equal parameters required; gossip, relay
and DiLoCo: the consensus distance, reported). A JSON file and a table.

The soak owns every process it starts (the launcher in a process group of its own, each
replica it starts again in one too) and the lighthouse; on an error or Ctrl-C all of them are
stopped (SIGCONT, then SIGKILL) before it returns.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = "bagua_algos.experiments.soak_worker"
PROG = "bagua-algos soak"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage plus a line
        self.exit(2, f"{PROG}: {message}\n")


def _range(text: str):
    try:
        a, b = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B (seconds, A < B)") from None
    if not 0 < a < b:
        raise argparse.ArgumentTypeError(f"{text!r}: give 0 < A < B seconds")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the soak's length, shared by the algorithms (> 0)")
    p.add_argument("--replicas", type=int, default=4, help="replicas per job (>= 2)")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="the fewest replicas a step commits with (1 .. replicas-1; default max(1, replicas-2))")
    p.add_argument("--algorithms", default="gradient_allreduce,decentralized_ring,relay_binary_tree,diloco",
                   help="comma-separated rows of the algorithm table (bagua_algos/algorithms/table.py)")
    p.add_argument("--kill-every", type=_range, default=(20.0, 40.0), metavar="A:B",
                   help="seconds between faults, drawn uniformly in [A, B] (default 20:40)")
    p.add_argument("--hang", action="store_true",
                   help="half the faults are hangs: SIGSTOP for --hang-seconds, then SIGCONT or SIGKILL")
    p.add_argument("--hang-seconds", type=_range, default=(3.0, 12.0), metavar="A:B")
    p.add_argument("--stall-seconds", type=float, default=3.0,
                   help="a gap between consecutive committed steps longer than this is a stall")
    p.add_argument("--baseline-fraction", type=float, default=0.25,
                   help="share of each algorithm's time for its fault-free job (0 <= f < 1; 0: none)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a collective waits for a silent peer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="results/soak")
    return p


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[str]:
    """The checks argparse's types cannot do; one line naming the flag on the first failure."""
    from bagua_algos.algorithms.table import ALGORITHM_TABLE

    labels = [row.label for row in ALGORITHM_TABLE if row.label != "async"]  # async is refused under torchft
    if not a.minutes > 0:
        p.error(f"argument --minutes: must be > 0 (got {a.minutes:g})")
    if a.replicas < 2:
        p.error(f"argument --replicas: must be >= 2 (got {a.replicas})")
    if a.min_replicas is None:
        a.min_replicas = max(1, a.replicas - 2)
    if not 1 <= a.min_replicas < a.replicas:
        p.error(f"argument --min-replicas: must be in 1..{a.replicas - 1} (got {a.min_replicas})")
    algorithms = [x.strip() for x in a.algorithms.split(",") if x.strip()]
    unknown = [x for x in algorithms if x not in labels]
    if not algorithms or unknown:
        p.error(f"argument --algorithms: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(labels)}")
    if not 0 <= a.baseline_fraction < 1:
        p.error(f"argument --baseline-fraction: must be in [0, 1) (got {a.baseline_fraction:g})")
    if not a.stall_seconds > 0 or not a.timeout > 0:
        p.error("argument --stall-seconds/--timeout: must be > 0")
    return algorithms


# --- processes ------------------------------------------------------------------------------

def _proc_alive(pid: int) -> bool:
    """Running (or stopped), not gone nor a zombie, and still a soak worker (a pid may be reused)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and WORKER.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def _children(ppid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == ppid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Job:
    """One launcher job, its replicas (by replica id: the pid now serving it) and the lighthouse."""

    def __init__(self, workdir: Path, label: str, args, seconds: float):
        from torchft.coordination import LighthouseServer

        from bagua_algos.experiments.elastic_faults import worker_env

        self.workdir, self.logs, self.stop_file = workdir, workdir / "logs", workdir / "stop"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.replicas, self.restarted, self.spec = {}, [], {}
        # the soak's own lighthouse (the launcher joins it with --lighthouse): it outlives the
        # launcher, which ends once its first replicas have all ended, while restarted ones go on
        self.lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=args.min_replicas,
                                           join_timeout_ms=int(1000 * min(args.timeout, 5.0)),
                                           heartbeat_timeout_ms=2000)
        address = f"http://127.0.0.1:{self.lighthouse.address().rstrip('/').rpartition(':')[2]}"
        env = worker_env()
        env.update(RUST_LOG="error", BAGUA_ALGOS_JOB_SECRET=secrets.token_hex(32))  # the healing state signed
        env.pop("BAGUA_ALGOS_FAULT_TOLERANCE", None)
        argv = [sys.executable, "-m", "bagua_algos.launch", "--torchft", "--lighthouse", address,
                "--nproc_per_node", str(args.replicas), "--min_replicas", str(args.min_replicas),
                "--backend", "gloo", "-m", WORKER, "--log_dir", str(self.logs), "--stop_file", str(self.stop_file),
                "--until", str(time.time() + seconds + 600), "--label", label, "--seed", str(args.seed),
                "--timeout", str(args.timeout)]
        self.out = open(workdir / "launcher.out", "w")
        try:
            self.launcher = subprocess.Popen(argv, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        except BaseException:
            self.out.close()
            self.lighthouse.shutdown()
            raise

    def discover(self) -> None:
        """The launcher's replicas: their pids, command lines and environments (read once, kept
        in memory only: the environment holds the job's secret), to start one again."""
        from bagua_algos.runtime.comm import fault_tolerance as ft

        for pid in _children(self.launcher.pid):
            if pid in self.replicas.values() or not _proc_alive(pid):
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
                raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                env = dict(kv.split(b"=", 1) for kv in raw if b"=" in kv)
            except OSError:
                continue
            who = env.get(ft.REPLICA_ID_ENV.encode(), b"").decode()
            if who and who not in self.spec:
                self.spec[who] = ([c.decode() for c in cmd], {k.decode(): v.decode() for k, v in env.items()})
                self.replicas[who] = pid

    def restart(self, who: str) -> None:
        cmd, env = self.spec[who]
        proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        self.restarted.append(proc)
        self.replicas[who] = proc.pid

    def reap(self) -> None:
        for proc in self.restarted:
            proc.poll()

    def stop(self) -> None:
        """Every process of the job ended: the stopped ones continued first so that they die."""
        pids = list(self.replicas.values()) + [p.pid for p in self.restarted]
        for pid in pids:
            _signal(pid, signal.SIGCONT)
        for pgid in [self.launcher.pid] + [p.pid for p in self.restarted]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            if _proc_alive(pid):
                _signal(pid, signal.SIGKILL)
        for proc in [self.launcher] + self.restarted:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.out.close()
        self.lighthouse.shutdown()


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return out


def _records(logs: Path) -> dict[str, list[dict]]:
    return {f.stem: _read_jsonl(f) for f in sorted(logs.glob("*.jsonl"))}


def _wait_first_step(job: Job, replicas: int, limit: float) -> float:
    """Wait (at most ``limit`` s) for a step committed by all ``replicas``: the clock starts there,
    not at the imports nor at a first quorum formed before every replica had joined."""
    t = time.time()
    while time.time() - t < limit:
        job.discover()
        if any(r.get("world") == replicas for rs in _records(job.logs).values() for r in rs):
            return time.time()
        if job.launcher.poll() is not None:
            break
        time.sleep(0.3)
    tail = (job.workdir / "launcher.out").read_text()[-2000:]
    raise RuntimeError(f"no step committed by all {replicas} replicas within {limit:.0f} s:\n{tail}")


def _inject(job: Job, args, seconds: float, rng: random.Random, log) -> list[dict]:
    """Faults for ``seconds``: a random replica killed (and started again at once) or, with
    --hang, stopped for a while and then continued or killed (and started again). A replica
    that dies of itself is started again too (counted as such)."""
    faults, hung, killed, t_end = [], {}, set(), time.time() + seconds
    next_fault = time.time() + rng.uniform(*args.kill_every)
    while time.time() < t_end:
        time.sleep(0.1)
        job.reap()
        now = time.time()
        for who, (until, fault) in list(hung.items()):
            if now >= until:
                del hung[who]
                fault["then"] = rng.choice(("SIGCONT", "SIGKILL"))
                if fault["then"] == "SIGKILL":
                    killed.add(who)
                _signal(job.replicas[who], getattr(signal, fault["then"]))
                log(f"  {fault['then']} {who} after {fault['seconds']:.1f} s stopped")
        for who, pid in list(job.replicas.items()):
            if who not in hung and not _proc_alive(pid):
                if who not in killed:
                    faults.append({"victim": who, "kind": "died", "t": now})
                    log(f"  {who} died of itself: started again")
                killed.discard(who)
                job.restart(who)
        if now < next_fault:
            continue
        next_fault = now + rng.uniform(*args.kill_every)
        candidates = sorted(w for w in job.replicas if w not in hung)
        if not candidates:  # every replica is stopped already (hangs longer than the gaps)
            continue
        victim = rng.choice(candidates)
        kind = "hang" if args.hang and rng.random() < 0.5 else "kill"
        fault = {"victim": victim, "kind": kind, "t": now}
        faults.append(fault)
        if kind == "kill":
            killed.add(victim)
            _signal(job.replicas[victim], signal.SIGKILL)
            log(f"  SIGKILL {victim}")
        else:
            fault["seconds"] = rng.uniform(*args.hang_seconds)
            hung[victim] = (now + fault["seconds"], fault)
            _signal(job.replicas[victim], signal.SIGSTOP)
            log(f"  SIGSTOP {victim} for {fault['seconds']:.1f} s")
    for who, (_, fault) in hung.items():  # the window is over: a stopped replica goes on
        fault["then"] = "SIGCONT (at the end)"
        _signal(job.replicas[who], signal.SIGCONT)
    return faults


def _finish(job: Job, args, rejoin_limit: float = 120.0, finish_limit: float = 120.0) -> dict:
    """Every replica told one step to stop at, once each has rejoined (bounded): the survivors
    then end at one committed state. What did not rejoin or finish in time is named."""
    t = time.time()
    while time.time() - t < rejoin_limit:
        job.reap()
        for who, pid in list(job.replicas.items()):
            if not _proc_alive(pid) and not (job.logs / f"{who}.final.pt").exists():
                job.restart(who)
        # in the quorum now: a step committed since the faults ended
        joined = [w for w, rs in _records(job.logs).items() if any("step" in r and r["t"] >= t for r in rs)]
        if len(joined) == len(job.replicas):
            break
        time.sleep(0.3)
    steps = [(r["t"], r["step"]) for rs in _records(job.logs).values() for r in rs if "step" in r]
    last = max((s for _, s in steps), default=0)
    # past the step the replicas will have reached when they read it: 2 s at the recent rate
    # (a replica reading it late would train a step its peers do not, which they then discard)
    recent = {s for t, s in steps if t > time.time() - 5.0}
    stop_at = last + 5 + int(2 * len(recent) / 5.0)
    job.stop_file.write_text(str(stop_at))
    t = time.time()
    while time.time() - t < finish_limit and any(_proc_alive(p) for p in job.replicas.values()):
        job.reap()
        time.sleep(0.3)
    unfinished = sorted(w for w, p in job.replicas.items() if _proc_alive(p))
    return {"stop_at": stop_at, "not_rejoined": sorted(set(job.replicas) - set(joined)), "unfinished": unfinished,
            "seconds_to_finish": round(time.time() - t, 1)}


def _agreement(logs: Path, final: int, must_agree: bool) -> dict:
    """The replicas that finished at committed step ``final``: the largest parameter difference from the
    first, and the consensus distance (1/n) sum_i ||x_i - mean||^2, also relative to ||mean||^2."""
    import torch

    finals = {}
    for f in sorted(logs.glob("*.final.pt")):
        state = torch.load(f, weights_only=True)
        if state["committed"] == final:
            finals[f.name[:-len(".final.pt")]] = state["params"].double()
    if not finals:
        return {"replicas_compared": 0, "must_agree": must_agree, "agree": False if must_agree else None}
    xs = torch.stack(list(finals.values()))
    mean = xs.mean(0)
    distance = float(((xs - mean) ** 2).sum(1).mean())
    spread = float((xs - xs[0]).abs().max())
    return {"replicas_compared": len(finals), "max_abs_difference": spread, "consensus_distance": distance,
            "consensus_distance_relative": distance / max(float((mean ** 2).sum()), 1e-30),
            "must_agree": must_agree, "agree": (spread == 0.0) if must_agree else None}


def measure(logs: Path, t0: float, t_end: float, stall_seconds: float, stop_at: int, must_agree: bool) -> dict:
    """The committed steps and their times, from the replicas' logs (see the module's docstring)."""
    recs = _records(logs)
    first = {}  # step -> when the first replica logged it committed
    backwards = {}
    for who, rs in recs.items():
        steps = [r["step"] for r in rs if "step" in r]
        backwards[who] = sum(b <= a for a, b in zip(steps, steps[1:]))
        for r in rs:
            if "step" in r:
                first[r["step"]] = min(first.get(r["step"], r["t"]), r["t"])
    top = max(first, default=-1)
    lost = [s for s in range(top + 1) if s not in first]
    finals = {w: [r for r in rs if "final" in r][-1] for w, rs in recs.items() if any("final" in r for r in rs)}
    window = sorted((t, s) for s, t in first.items() if t0 <= t <= t_end)
    gaps = [(t1 - t0_, t0_) for (t0_, _), (t1, _) in zip(window, window[1:])]
    stalls = sorted(((g, at) for g, at in gaps if g > stall_seconds), key=lambda x: x[1])
    seconds = max(t_end - t0, 1e-9)
    return {
        "seconds": round(seconds, 1), "committed_in_window": len(window),
        "steps_per_second": round(len(window) / seconds, 3),
        "last_committed_step": top, "steps_lost": len(lost), "lost": lost[:20],
        "went_backwards": {w: n for w, n in backwards.items() if n},
        "finals": {w: f["final"] for w, f in finals.items()},
        # the replicas stop at the first step >= stop_at that they see (the same one: one quorum)
        "final_is_max": bool(finals) and all(f["final"] == top + 1 >= stop_at for f in finals.values()),
        "discarded": sum(1 for rs in recs.values() for r in rs if "discarded" in r),
        "starts": sum(1 for rs in recs.values() for r in rs if "start" in r),
        "stalls": len(stalls), "stall_seconds_max": round(max((g for g, _ in stalls), default=0.0), 2),
        "stall_seconds_total": round(sum(g for g, _ in stalls), 2),
        "stall_list": [{"at": round(at - t0, 1), "seconds": round(g, 2)} for g, at in stalls],
        "step_gap_median": round(statistics.median(g for g, _ in gaps), 4) if gaps else None,
        "accuracy": round(statistics.mean(f["accuracy"] for f in finals.values()), 4) if finals else None,
        "agreement": _agreement(logs, top + 1, must_agree),
    }


def run_job(workdir: Path, label: str, args, seconds: float, faults: bool, rng: random.Random, log) -> dict:
    """One job of ``seconds`` measured (after every replica's first step), with or without faults."""
    from bagua_algos.algorithms.table import config_by_label

    job = Job(workdir, label, args, seconds)
    try:
        t0 = _wait_first_step(job, args.replicas, limit=240.0)
        if faults:
            injected = _inject(job, args, seconds, rng, log)
        else:
            injected = []
            while time.time() < t0 + seconds:
                time.sleep(0.2)
                if any(not _proc_alive(p) for p in job.replicas.values()):
                    injected.append({"victim": "?", "kind": "died", "t": time.time()})
                    break
        t_end = time.time()
        finish = _finish(job, args)
    finally:
        job.stop()
    row = measure(job.logs, t0, t_end, args.stall_seconds, finish["stop_at"],
                  config_by_label(label).replicas == "equal")
    row.update(finish, faults=[{**f, "t": round(f["t"] - t0, 1)} for f in injected],
               kills=sum(f["kind"] == "kill" or f.get("then") == "SIGKILL" for f in injected),
               hangs=sum(f["kind"] == "hang" for f in injected),
               died=sum(f["kind"] == "died" for f in injected))
    return row


def _verdict(row: dict) -> str:
    ok = not row["steps_lost"] and not row["went_backwards"] and row["final_is_max"] and not row["unfinished"]
    return "ok" if ok else "FAILED"


def table(rows: list[dict]) -> str:
    head = (f"{'algorithm':<22} {'steps':>6} {'lost':>4} {'kills':>5} {'hangs':>5} {'stalls':>6} {'max s':>6} "
            f"{'steps/s':>8} {'free':>8} {'kept':>5} {'survivors':>30} committed")
    lines = [head, "-" * len(head)]
    for row in rows:
        s, base = row["soak"], row.get("baseline") or {}
        ag = s["agreement"]
        if not ag["replicas_compared"]:
            agree = "none finished"
        elif ag["must_agree"]:
            agree = (f"equal ({ag['replicas_compared']})" if ag["agree"]
                     else f"DIFFER {ag.get('max_abs_difference', 0):.1e}")
        else:
            agree = f"consensus {ag.get('consensus_distance_relative', float('nan')):.1e} rel"
        free = f"{base['steps_per_second']:8.2f}" if base else f"{'-':>8}"
        kept = f"{row['throughput_kept']:5.2f}" if row.get("throughput_kept") is not None else f"{'-':>5}"
        lines.append(f"{row['algorithm']:<22} {s['last_committed_step'] + 1:>6} {s['steps_lost']:>4} {s['kills']:>5} "
                     f"{s['hangs']:>5} {s['stalls']:>6} {s['stall_seconds_max']:>6.1f} {s['steps_per_second']:>8.2f} "
                     f"{free} {kept} {agree:>30} {_verdict(s)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    algorithms = check_args(parser, args)
    os.environ.setdefault("RUST_LOG", "error")  # before torchft's import: its lighthouse logs every quorum otherwise
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        parser.exit(2, f"{PROG}: needs torchft ({exc}); install it: pip install 'bagua-algos[torchft]'\n")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    share = 60.0 * args.minutes / len(algorithms)
    report = {"command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]),
              "machine": {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()]},
              "settings": {k: v for k, v in vars(args).items()}, "rows": []}

    def log(line):
        print(line, flush=True)

    def on_term(signum, frame):  # SIGTERM as Ctrl-C: the finally blocks stop every process
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        for label in algorithms:
            row = {"algorithm": label, "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
            base_seconds = share * args.baseline_fraction
            if base_seconds > 0:
                log(f"{label}: fault-free job, {base_seconds:.0f} s, {args.replicas} replicas")
                row["baseline"] = run_job(out_dir / label / "baseline", label, args, base_seconds, False, rng, log)
            log(f"{label}: soak, {share - base_seconds:.0f} s, a fault every {args.kill_every[0]:g}-"
                f"{args.kill_every[1]:g} s{' (kills and hangs)' if args.hang else ' (kills)'}")
            row["soak"] = run_job(out_dir / label / "soak", label, args, share - base_seconds, True, rng, log)
            base = row.get("baseline")
            row["throughput_kept"] = (round(row["soak"]["steps_per_second"] / base["steps_per_second"], 3)
                                      if base and base["steps_per_second"] else None)
            row["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            report["rows"].append(row)
            (out_dir / "soak.json").write_text(json.dumps(report, indent=1))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; every process it started is stopped; partial report in "
              f"{out_dir / 'soak.json'}", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
        report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        (out_dir / "soak.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report["rows"]), flush=True)
    print(f"wrote {out_dir / 'soak.json'}", flush=True)
    return 0 if all(_verdict(r["soak"]) == "ok" and r["soak"]["agreement"]["agree"] is not False
                    for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
