"""bagua_algos/arguments.py: one rule per kind of argument, messages that name the
argument, the value and what is valid; and the algorithms that take a seed, a flag or
an interval all follow the same rule."""

from __future__ import annotations

import ast
import math
import pathlib
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bagua_algos import arguments as A
from bagua_algos.algorithms import (
    AllreduceAverageAlgorithm,
    DecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithm,
    PowerSGDAlgorithm,
    RelayAlgorithm,
    TernGradAlgorithm,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
anything = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3),
                     st.lists(st.integers(), max_size=2))


# --------------------------------------------------------------------------- flags
@given(anything)
def test_a_flag_is_true_or_false_and_nothing_else(value):
    if isinstance(value, bool):
        assert A.check_flag("f", value) is value
    else:
        with pytest.raises(TypeError, match=re.escape(f"f must be True or False, got {value!r}")):
            A.check_flag("f", value)


# ------------------------------------------------------------------------ integers
@given(anything, st.integers(-5, 5))
def test_an_int_is_an_integral_at_least_low(value, low):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok:
        assert A.check_int("n", value, low) == value
    else:
        with pytest.raises(ValueError, match=re.escape(f"n must be an int >= {low}, got {value!r}")):
            A.check_int("n", value, low)


def test_int_accepts_numpy_integers_and_returns_a_python_int():
    out = A.check_int("n", np.int64(3), 1)
    assert out == 3 and type(out) is int
    for bad in (2.0, np.float64(2.0), True, "2", torch.tensor(2)):
        with pytest.raises(ValueError, match="n must be an int >= 1"):
            A.check_int("n", bad, 1)


def test_int_upper_bound_and_own_wording():
    assert A.check_int("n", 4, 0, 5) == 4
    with pytest.raises(ValueError, match=re.escape("n must be an int >= 0 and < 5, got 5")):
        A.check_int("n", 5, 0, 5)
    with pytest.raises(ValueError, match=re.escape("size must be a positive number of bytes, got 0")):
        A.check_int("size", 0, 1, what="a positive number of bytes")


@given(anything)
def test_an_interval_is_an_int_of_at_least_one(value):
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        assert A.check_interval(value) == value
    else:
        with pytest.raises(ValueError, match=re.escape(f"communication_interval must be an int >= 1, got {value!r}")):
            A.check_interval(value)


# --------------------------------------------------------------------- real numbers
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10), st.booleans(), st.text(max_size=2)),
       st.booleans(), st.booleans())
def test_a_real_is_finite_and_in_its_interval(value, low_open, high_open):
    low, high = 0.0, 1.0
    finite = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    inside = finite and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if inside:
        out = A.check_real("x", value, low, high, low_open=low_open, high_open=high_open)
        assert out == value and type(out) is float
    else:
        interval = f"{'(' if low_open else '['}0.0, 1.0{')' if high_open else ']'}"
        with pytest.raises(ValueError, match=re.escape(f"x must be a finite number in {interval}, got {value!r}")):
            A.check_real("x", value, low, high, low_open=low_open, high_open=high_open)


def test_real_wording_with_one_bound_and_own_wording():
    with pytest.raises(ValueError, match=re.escape("x must be a finite number >= 1.0, got 0.5")):
        A.check_real("x", 0.5, 1.0)
    with pytest.raises(ValueError, match=re.escape("x must be a finite number > 0.0, got 0")):
        A.check_real("x", 0, 0.0, low_open=True)
    with pytest.raises(ValueError, match=re.escape("p must be a probability in [0, 1), got nan")):
        A.check_real("p", float("nan"), 0.0, 1.0, high_open=True, what="a probability in [0, 1)")
    assert A.check_real("x", np.float32(0.5), 0.0, 1.0) == 0.5


# --------------------------------------------------------------------------- seeds
@given(st.one_of(st.integers(-2**70, 2**70), anything))
def test_a_seed_is_an_int_in_0_to_2_63_and_torch_takes_it_with_a_rank_added(value):
    valid = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    if valid:
        seed = A.check_seed(value)
        torch.Generator().manual_seed(seed + 1023)  # room for a rank
    else:
        with pytest.raises(ValueError, match=re.escape(f"seed must be an int >= 0 and < 2**63, got {value!r}")):
            A.check_seed(value)


@pytest.mark.parametrize("make", [
    lambda seed: RelayAlgorithm(seed=seed),
    lambda seed: TernGradAlgorithm(seed=seed),
    lambda seed: PowerSGDAlgorithm(seed=seed),
], ids=["relay", "terngrad", "powersgd"])
def test_every_algorithm_takes_seeds_by_the_same_rule(make):
    assert make(np.int64(5)).seed == 5
    assert make(2**63 - 1).seed == 2**63 - 1
    for bad in (-1, 2**63, 1.0, True, "1", None):
        with pytest.raises(ValueError, match=re.escape(f"seed must be an int >= 0 and < 2**63, got {bad!r}")):
            make(bad)


# ------------------------------------------------------------------------- choices
def test_a_choice_returns_the_canonical_element():
    assert A.check_choice("bits", np.int64(4), (1, 2, 4, 8)) == 4
    assert type(A.check_choice("bits", np.int64(4), (1, 2, 4, 8))) is int
    assert A.check_choice("mode", None, (None, "full")) is None
    assert A.check_choice("b", True, [False, True, "first_step"]) is True


@pytest.mark.parametrize("value,choices", [
    (True, (1, 2, 4, 8)), (1, (False, True)), (0, [False, True, "first_step"]), (2.0, (1, 2, 4, 8)),
    ("x", ("all",)), (torch.tensor([1, 2]), (1, 2)), (np.array([1, 2]), (1, 2)), ([1], (1,)),
])
def test_a_choice_never_confuses_kinds(value, choices):
    with pytest.raises(ValueError, match=re.escape(f"v must be one of {list(choices)}, got {value!r}")):
        A.check_choice("v", value, choices)


# ---------------------------------------------------------- one rule per kind of argument
@pytest.mark.parametrize("make", [
    lambda v: AllreduceAverageAlgorithm(communication_interval=v),
    lambda v: DecentralizedAlgorithm(communication_interval=v),
    lambda v: LowPrecisionDecentralizedAlgorithm(communication_interval=v),
], ids=["allreduce_average", "decentralized", "low_precision_decentralized"])
def test_every_interval_follows_one_rule(make):
    assert make(np.int64(2)).communication_interval == 2
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match=re.escape(f"communication_interval must be an int >= 1, got {bad!r}")):
            make(bad)


def test_the_module_imports_the_standard_library_only():
    tree = ast.parse((ROOT / "bagua_algos" / "arguments.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "math", "numbers", "typing"}, imported


def test_no_algorithm_defines_its_own_argument_check():
    for path in sorted((ROOT / "bagua_algos" / "algorithms").glob("*.py")):
        tree = ast.parse(path.read_text())
        own = [node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("check")]
        assert not own, f"{path.name} defines {own}; put argument checks in bagua_algos/arguments.py"


def test_a_timeout_is_positive_seconds_or_a_timedelta():
    from datetime import timedelta

    from bagua_algos.arguments import check_timeout

    assert check_timeout(5) == 5.0 and check_timeout(timedelta(minutes=1)) == 60.0
    for bad in (0, -1, True, float("nan"), float("inf"), "3", timedelta(0), None):
        expected = f"timeout must be a positive number of seconds or a timedelta, got {bad!r}"
        with pytest.raises(ValueError, match=re.escape(expected)):
            check_timeout(bad)
