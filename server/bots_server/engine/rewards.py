"""What a group of rollout rewards in [0, 1] says about its task: its
variance, and the Bernoulli evidence the posterior takes from it.

A GRPO group carries a gradient when its rewards differ. With rewards of 0
or 1 that is 0 < successes < trials, and the group's variance is
r (1 - r) (r the mean reward), largest at r = 1/2: that is why BOTS picks
tasks near the target p* = 1/2. With partial credit the mean says little
about the spread: eight rollouts that all score 0.5 have mean 0.5 and teach
nothing. So a group reported with its sum of squared rewards counts in the
posterior as the Bernoulli rate with the same variance v, on the side of
1/2 where its mean lies:

    p = 1/2 + sign(r - 1/2) sqrt(1/4 - v),   v = sum_squares / n - r^2,

ties (r = 1/2) taken on the upper side. For rewards of 0 or 1 (sum_squares
equal to successes) p is r itself, taken as reported so that the floats are
those of a report without sum_squares; a group with no spread (v = 0) gives
p = 0 or 1, like an all-wrong or all-right binary group; the widest spread
(v = 1/4) gives p = 1/2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# A variance this small is rounding in the sums of equal rewards (eight
# rewards of 0.3 sum to 2.4000000000000004), not a spread: it counts as 0.
NO_SPREAD = 1e-9


def group_variance(successes: float, trials: int, sum_squares: float) -> float:
    """The population variance of a group's rewards, sum_squares / n - r^2;
    0 when it is at most NO_SPREAD."""
    mean = successes / trials
    variance = sum_squares / trials - mean * mean
    return variance if variance > NO_SPREAD else 0.0


def evidence_successes(successes: float, trials: int, sum_squares: float | None) -> float:
    """The successes the posterior takes from a group: `successes` as they
    are without `sum_squares` or when every reward was 0 or 1, else `trials`
    times the Bernoulli rate with the group's variance (module docstring)."""
    if sum_squares is None or sum_squares == successes:
        return successes
    mean = successes / trials
    distance = math.sqrt(max(0.0, 0.25 - group_variance(successes, trials, sum_squares)))
    rate = 0.5 + distance if mean >= 0.5 else 0.5 - distance
    return trials * min(1.0, max(0.0, rate))


def evidence_of(successes: Sequence[float], trials: Sequence[int], sum_squares: Sequence[float | None]) -> np.ndarray:
    """evidence_successes of each group of a report, as float64: the
    successes as reported, but for the groups with sum_squares."""
    evidence = np.array(successes, dtype=np.float64)
    if sum_squares.count(None) != len(sum_squares):
        for i, (s, n, q) in enumerate(zip(successes, trials, sum_squares, strict=True)):
            if q is not None:
                evidence[i] = evidence_successes(float(s), int(n), q)
    return evidence


def informative(successes: float, trials: int, sum_squares: float | None) -> bool:
    """Whether the group's rewards differ: 0 < successes < trials for 0/1
    rewards (whatever the trials: no threshold), a variance above 0 with
    sum_squares otherwise."""
    if sum_squares is None or sum_squares == successes:
        return 0.0 < successes < trials
    return group_variance(successes, trials, sum_squares) > 0.0
