"""A report's checks (core/validation.py) run over whole columns first and
fall back to a loop over the tasks only to name a problem: every problem,
wherever it sits in a long report, must still be found and named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bots_server.core import limits, validation
from bots_server.core.domain import Outcomes
from bots_server.errors import InvalidArgument

N = 300


def report(rng: np.random.Generator) -> list[tuple[str, float, int, float | None]]:
    trials = rng.integers(1, 17, N).tolist()
    return [(f"task-{i}", float(rng.integers(0, t + 1)), t, None) for i, t in enumerate(trials)]


# A problem planted in one row, and what the error says about it.
PROBLEMS = {
    "empty key": (lambda r: ("", *r[1:]), "reported task key is empty"),
    "NUL in key": (lambda r: (r[0] + "\x00", *r[1:]), "contains a NUL character"),
    "long key": (lambda r: ("k" * (limits.MAX_KEY_LENGTH + 1), *r[1:]), "is longer than"),
    "no trials": (lambda r: (r[0], 0.0, 0, None), "trials = 0 is outside"),
    "too many trials": (lambda r: (r[0], 1.0, limits.MAX_TRIALS + 1, None), "trials = 2147483648 is outside"),
    "NaN successes": (lambda r: (r[0], math.nan, r[2], None), "successes = nan is outside"),
    "infinite successes": (lambda r: (r[0], math.inf, r[2], None), "successes = inf is outside"),
    "negative successes": (lambda r: (r[0], -0.5, r[2], None), "successes = -0.5 is outside"),
    "more successes than trials": (lambda r: (r[0], r[2] + 0.5, r[2], None), "is outside [0, trials"),
    "sum_squares above successes": (lambda r: (r[0], 1.0, 4, 1.5), "sum_squares = 1.5 is outside"),
    "NaN sum_squares": (lambda r: (r[0], 1.0, 4, math.nan), "sum_squares = nan is outside"),
}


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("seed", range(3))
def test_a_problem_anywhere_in_a_long_report_is_named(problem: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = report(rng)
    at = int(rng.integers(0, N))
    plant, says = PROBLEMS[problem]
    rows[at] = plant(rows[at])
    with pytest.raises(InvalidArgument) as raised:
        validation.outcomes("b", Outcomes.of(rows))
    assert says in str(raised.value)
    assert problem in ("empty key", "long key") or f"task-{at}" in str(raised.value)


def test_a_key_reported_twice_is_named_wherever_the_second_is() -> None:
    rows = report(np.random.default_rng(0))
    rows[250] = ("task-17", *rows[250][1:])
    with pytest.raises(InvalidArgument, match="task 'task-17' is reported more than once"):
        validation.outcomes("b", Outcomes.of(rows))


def test_reports_in_range_pass_with_and_without_sum_squares() -> None:
    rng = np.random.default_rng(1)
    rows = report(rng)
    validation.outcomes("b", Outcomes.of(rows))
    # Graded groups: rewards in [0, 1], their sums as a trainer reports them.
    graded = []
    for key, _, n, _ in rows:
        rewards = rng.random(n)
        graded.append((key, math.fsum(rewards), n, math.fsum(rewards * rewards)))
    validation.outcomes("b", Outcomes.of(graded))
    # Every bound itself is in range.
    validation.outcomes(
        "b", Outcomes.of([("k" * limits.MAX_KEY_LENGTH, 0.0, limits.MAX_TRIALS, None), ("x", 1.0, 1, None)])
    )


def test_an_empty_report_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="has no outcomes"):
        validation.outcomes("b", Outcomes.of([]))
