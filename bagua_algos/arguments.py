"""Checks for arguments, one function per kind of argument, one rule per kind.

Every layer (runtime, algorithms, compression) refuses bad input where it enters with
these, so one kind of argument is refused the same way everywhere, with a message
that names the argument, the value given and what would be valid. Each check returns
the value in its canonical form (``int``, ``float``, the matching choice). This module
imports the standard library only, so any module of the package may import it.

The rules:

- a flag is ``True`` or ``False`` (TypeError otherwise; the string ``"false"``, which
  ``bool()`` reads as True, and 0/1 are refused);
- an integer is an ``int`` or any ``numbers.Integral`` (NumPy's too), never a bool,
  and never a float, even a whole one;
- a real number is a finite ``numbers.Real`` (an integer too), never a bool;
- a seed is an integer in [0, 2**63): what ``torch.Generator.manual_seed`` takes
  without wrapping; a worker's own stream of random choices (rounding, drops) is
  seeded with ``rank_seed(seed, rank)``, the one rule for per-rank seeds, so a rank
  draws the same numbers as a process and as a worker of the one-process engine;
- a timeout is a positive finite number of seconds (never a bool) or a
  ``datetime.timedelta`` of a positive length, returned as seconds;
- a choice must equal one of the choices, a bool never standing for 0 or 1 (nor an
  int for True or False).
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional

__all__ = [
    "SEED_LIMIT",
    "check_flag",
    "check_int",
    "check_interval",
    "check_real",
    "check_seed",
    "rank_seed",
    "check_timeout",
    "check_choice",
    "is_int",
    "is_real",
]

SEED_LIMIT = 2**63
"""Seeds lie in [0, SEED_LIMIT)."""


def is_int(value) -> bool:
    """Whether ``value`` is an integer in the module's sense (not a bool, not a float)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """Whether ``value`` is a finite real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_flag(name: str, value) -> bool:
    """``value`` if it is True or False; anything else is a TypeError."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_int(name: str, value, low: int = 0, high: Optional[int] = None, what: str = "") -> int:
    """``value`` as an ``int`` if it is an integer with low <= value (< high when given).

    ``what`` replaces the rule's wording in the message (e.g. "a positive number of
    bytes"); the message is "<name> must be <what>, got <value>"."""
    if not is_int(value) or value < low or (high is not None and value >= high):
        if not what:
            what = f"an int >= {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def check_interval(value, name: str = "communication_interval") -> int:
    """A communication interval: an integer >= 1 (communicate every k-th step)."""
    return check_int(name, value, 1)


def _bounds(low: float, high: float, low_open: bool, high_open: bool) -> str:
    if high == math.inf:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"


def check_real(name: str, value, low: float = -math.inf, high: float = math.inf, *,
               low_open: bool = False, high_open: bool = False, what: str = "") -> float:
    """``value`` as a ``float`` if it is a finite real number in the interval from
    ``low`` to ``high`` (closed ends unless ``low_open`` / ``high_open``).

    The message reads "<name> must be a finite number >= 0.0, got ..." or "... in
    [0.0, 1.0), got ..."; ``what`` replaces the part after "must be"."""
    ok = is_real(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        what = what or f"a finite number {_bounds(low, high, low_open, high_open)}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def check_seed(value, name: str = "seed") -> int:
    """A seed: an integer in [0, 2**63), as an ``int``."""
    return check_int(name, value, 0, SEED_LIMIT, what="an int >= 0 and < 2**63")


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s own random stream under the run's ``seed``: an int in
    [0, 2**63), different for every (seed, rank) pair in practice (a SplitMix64 mix of
    the two, so that seed s + 1 of rank 0 is not seed s of rank 1), and the same on
    every machine and in every run. The one rule for per-rank seeds: every algorithm
    that draws per worker takes ``torch.Generator().manual_seed(rank_seed(seed, rank))``.

    Example::

        >>> rank_seed(0, 0) != rank_seed(0, 1) != rank_seed(1, 0)
        True
    """
    seed = check_seed(seed)
    rank = check_int("rank", rank, 0, None, what="an int >= 0")
    mask = 2**64 - 1
    x = (seed + (rank + 1) * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return (x ^ (x >> 31)) % SEED_LIMIT


def check_timeout(value, name: str = "timeout") -> float:
    """A timeout, in seconds (a float > 0): a positive finite number of seconds, or a
    ``datetime.timedelta`` (anything with ``total_seconds()``) of a positive length."""
    total_seconds = getattr(value, "total_seconds", None)
    seconds = total_seconds() if callable(total_seconds) else value
    if not is_real(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive number of seconds or a timedelta, got {value!r}")
    return float(seconds)


def _same_kind(value, choice) -> bool:
    # A bool stands only for a bool; an integer choice takes only integers (no 2.0).
    if isinstance(value, bool) or isinstance(choice, bool):
        return isinstance(value, bool) and isinstance(choice, bool)
    if is_int(choice):
        return is_int(value)
    return True


def check_choice(name: str, value, choices: Iterable):
    """The element of ``choices`` equal to ``value``; otherwise a ValueError listing
    them. A bool never matches 0 or 1 (nor an int True or False), a float never an
    integer choice."""
    choices = list(choices)
    for choice in choices:
        if value is choice:
            return choice
        if not _same_kind(value, choice):
            continue
        try:
            if bool(value == choice):
                return choice
        except Exception:  # noqa: BLE001 — e.g. a tensor or an array: not a choice
            continue
    raise ValueError(f"{name} must be one of {choices}, got {value!r}")
