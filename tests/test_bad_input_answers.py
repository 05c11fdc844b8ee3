"""Bad input gets the answer documented for it: every probe of bad_input_cases (the
exception, a message naming the argument, in time; or, for behaviour that is not an
error, the documented observation) is a test of its own, named after the probe.

Probes that need no process group run here. The others share one pool of gloo
workers for the module (a spawn costs seconds): each test gives its probe to the pool
and judges what every rank saw. A probe that carries a ``known_issue`` documents a real
problem not fixed yet: it is expected to fail (strictly, so that the note goes once the
problem is fixed).
"""

from __future__ import annotations

import pytest

from bad_input_cases import PROBES, Probe
from bad_input_runner import TIME_LIMIT_S, Outcome, judge, page, run_distributed, run_probe, start_pool

SINGLE = [p for p in PROBES if not p.distributed]
DISTRIBUTED = [p for p in PROBES if p.distributed]


def _params(probes):
    return [
        pytest.param(p, id=p.id, marks=[pytest.mark.xfail(strict=True, reason=p.known_issue)] if p.known_issue else [])
        for p in probes
    ]


def _explain(probe, outcome: Outcome) -> str:
    return (f"probe {probe.id!r} ({probe.action}): {outcome.why}; got "
            f"{outcome.raised or 'no error'}: {outcome.full_message[:500]!r} in {outcome.seconds:.2f} s")


def test_the_probe_list_is_well_formed():
    assert 45 <= len(PROBES) <= 150
    assert len({p.id for p in PROBES}) == len(PROBES)
    for p in PROBES:
        assert p.expected is None or (isinstance(p.expected, type) and issubclass(p.expected, BaseException)), p.id
        assert p.match and p.action, p.id
    assert SINGLE and DISTRIBUTED


def test_judging_checks_type_message_and_time():
    probe = Probe("x", "does x", ValueError, "bad x", fn=lambda: None)
    assert judge(probe, ValueError("a bad x here"), None, 0.1).passed
    assert judge(probe, TypeError("bad x"), None, 0.1).why == "expected ValueError"
    assert "does not contain" in judge(probe, ValueError("other"), None, 0.1).why
    assert "nothing was raised" in judge(probe, None, None, 0.1).why
    assert "limit" in judge(probe, ValueError("bad x"), None, TIME_LIMIT_S + 1).why
    observed = Probe("y", "does y", None, "finite", fn=lambda: None)
    assert judge(observed, None, "all finite", 0.1).passed
    assert judge(observed, RuntimeError("boom"), None, 0.1).why == "expected no error"


@pytest.mark.parametrize("probe", _params(SINGLE))
def test_single_process_probe(probe):
    outcome = run_probe(probe)
    assert outcome.passed, _explain(probe, outcome)


@pytest.fixture(scope="module")
def gloo_pool():
    with start_pool() as pool:
        yield pool


@pytest.mark.parametrize("probe", _params(DISTRIBUTED))
def test_distributed_probe(probe, gloo_pool):
    outcome = run_distributed(probe, gloo_pool)
    assert outcome.passed, _explain(probe, outcome)


def test_page_names_the_command_and_the_machine():
    outcomes = [Outcome(p.id, None, "no error", "no error", 0.0, True) for p in PROBES]
    text = page(PROBES, outcomes, "python tests/bad_input_runner.py --out docs/probes.md")
    assert "`python tests/bad_input_runner.py --out docs/probes.md`" in text
    assert "torch " in text and "CPU cores" in text
    assert text.count("\n| ") == len(PROBES) + 1  # header row and one row per probe
