"""How the sweep's runs are scheduled: how many train at a time by default (the CPUs
idle now, :func:`idle_cpus`), and :func:`run_jobs`, which trains them in this process
or, with ``--jobs`` above 1, in a pool of processes forked from it (on GPUs the pool is
``executors.run_gpu_jobs``'s)."""

from __future__ import annotations

import os
import time

__all__ = ["idle_cpus", "busy_cpus", "run_jobs"]


def idle_cpus(sample_s: float = 0.25) -> int:
    """The CPUs this process may use, less those the machine keeps busy now, rounded:
    runs in parallel gain only from cores nobody else keeps busy (on the 2-core machine
    at a load of 9-14, two runs at a time took 0.8-2x the wall time of one at a time;
    docs/benchmarks.md). "Now" is the last ``sample_s`` seconds of /proc/stat
    (:func:`busy_cpus`); where that cannot be read, the last minute's load average, which
    lags: right after a heavy command (an install, the processes engine) it still counts
    that command's load on an idle machine."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cpus(sample_s)
    if busy is None:
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cpus, round(cpus - busy)))


def busy_cpus(sample_s: float, stat_path: str = "/proc/stat") -> float | None:
    """How many of the machine's CPUs were busy, on average, over the next ``sample_s``
    seconds: 1 − idle / total of the jiffies on /proc/stat's first line (idle and iowait
    count as idle), times the CPU count; None where the file cannot be read or parsed."""

    def jiffies() -> tuple:
        with open(stat_path) as f:
            fields = f.readline().split()
        if not fields or fields[0] != "cpu" or len(fields) < 5:
            raise ValueError(f"{stat_path}: no aggregate cpu line")
        values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(values), values[3] + values[4]

    try:
        total0, idle0 = jiffies()
        time.sleep(sample_s)
        total1, idle1 = jiffies()
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


# What the forked job processes of run_jobs run: set just before they fork (a fork
# inherits it; nothing is pickled but the job's index and its record).
_FORKED: dict = {}


def _forked_job_start() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _forked_job(index: int) -> tuple:
    return index, _FORKED["work"](_FORKED["jobs"][index])


def run_jobs(work, jobs: list, processes: int):
    """(index, ``work(job)``) of every job, as each ends: in this process, or with
    ``processes`` > 1 that many at a time in processes forked from this one, each with
    ``--threads`` torch threads (the runs are independent: every run seeds what it
    draws, so its record is the same wherever it runs)."""
    if processes <= 1:
        for index, job in enumerate(jobs):
            yield index, work(job)
        return
    import multiprocessing

    _FORKED.update(work=work, jobs=jobs)
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_forked_job_start)
    try:
        yield from pool.imap_unordered(_forked_job, range(len(jobs)))
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        _FORKED.clear()

