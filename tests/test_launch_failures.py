"""Which worker the launcher names when a job fails.

torchrun's agent stops the other workers with SIGTERM as soon as one fails and then
reports all of them, with timestamps in whole seconds; the summary must name the
worker that failed first, not one the agent stopped (see ``launch.first_failure``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from subprocesses import finish, start_python
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from bagua_algos.launcher import launch

# Real launches per worker mode (each takes some seconds); raise it to measure.
REPEATS = int(os.environ.get("BAGUA_TEST_LAUNCH_REPEATS", "2"))

TERM, KILL = -int(signal.SIGTERM), -int(signal.SIGKILL)


def failure(local_rank, exitcode, timestamp):
    f = ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
                       error_file="<N/A>")
    f.timestamp = timestamp
    return f


def failures(*entries):
    """{global rank: failure} in the given (detection) order; entries are
    (rank, exitcode, timestamp)."""
    return {rank: failure(rank, code, ts) for rank, code, ts in entries}


# ------------------------------------------------------------------ the choice itself


@pytest.mark.parametrize("entries, expected", [
    # the bug: the same second for all, the agent's SIGTERMs listed around the real one
    ([(0, TERM, 100), (1, KILL, 100), (2, TERM, 100)], 1),
    ([(1, KILL, 100), (0, TERM, 100)], 1),
    ([(0, TERM, 101), (1, KILL, 100), (2, TERM, 101)], 1),
    # an exit code among the agent's SIGTERMs
    ([(0, TERM, 100), (1, 3, 100)], 1),
    # earliest first, even a SIGTERM (sent by someone else, before the rest)
    ([(0, TERM, 99), (1, KILL, 100)], 0),
    ([(0, 1, 99), (1, KILL, 100)], 0),
    # the same second: a crash signal before an exit code (often a peer's collective
    # failing because the crashed worker is gone)
    ([(0, 1, 100), (1, KILL, 100)], 1),
    ([(3, 1, 100), (2, int(-signal.SIGSEGV), 100)], 2),
    # otherwise the order in which the agent recorded them, not the lowest rank
    ([(2, 3, 100), (0, 1, 100)], 2),
    ([(2, TERM, 100), (0, TERM, 100)], 2),
    ([(5, 7, 100)], 5),
])
def test_first_failure(entries, expected):
    assert launch.first_failure(failures(*entries)) == expected


def test_first_failure_of_nothing():
    with pytest.raises(ValueError):
        launch.first_failure({})


def test_summary_line_and_status():
    err = ChildFailedError("train.py", failures((0, TERM, 100), (1, KILL, 100), (2, TERM, 100)))
    line, status = launch._failure_summary(err)
    assert line == ("bagua_algos.launch: job failed: worker rank 1 (local_rank 1, pid 1001) "
                    "was killed by signal SIGKILL; the node's workers were stopped; "
                    "other local ranks ended: 0 (SIGTERM), 2 (SIGTERM)")
    assert status == 1
    err = ChildFailedError("train.py", failures((0, TERM, 100), (1, 3, 100)))
    line, status = launch._failure_summary(err)
    assert "worker rank 1 (local_rank 1, pid 1001) exited with code 3" in line
    assert line.endswith("other local ranks ended: 0 (SIGTERM)")
    assert status == 3


# ----------------------------------------------------------------------- real jobs


@pytest.mark.parametrize("mode", ["sleep", "barrier"])
@pytest.mark.parametrize("attempt", range(REPEATS))
def test_sigkilled_worker_is_named(mode, attempt, launch_workers_dir, free_port):
    """Rank 1 of 3 kills itself with SIGKILL while ranks 0 and 2 are blocked; the agent
    then stops those with SIGTERM. The summary names rank 1 and SIGKILL."""
    start = time.monotonic()
    proc = start_python(["-m", "bagua_algos.launch", "--nproc_per_node", "3",
                         "--master_port", free_port,
                         launch_workers_dir / "sigkill_rank1.py", mode])
    code, out, err = finish(proc, timeout=120)
    elapsed = time.monotonic() - start
    summary = [line for line in err.splitlines() if line.startswith("bagua_algos.launch: job failed:")]
    assert len(summary) == 1, err
    assert "worker rank 1 (local_rank 1," in summary[0], summary[0]
    assert "was killed by signal SIGKILL" in summary[0], summary[0]
    assert summary[0].endswith("other local ranks ended: 0 (SIGTERM), 2 (SIGTERM)"), summary[0]
    assert code == 1
    # the blocked ranks would wait 60 s; the agent stopped them long before
    assert elapsed < 50, f"took {elapsed:.1f}s"
