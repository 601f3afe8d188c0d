"""The posterior summary monitoring reads: bands relative to p* by where the
posterior's mass is, which forgetting cannot blur into "near"."""

from __future__ import annotations

import numpy as np
import pytest

from bots_server.engine import EngineParams, PosteriorState, apply_outcomes, posterior_summary, select


def state(alpha: list[float], beta: list[float]) -> PosteriorState:
    n = len(alpha)
    return PosteriorState(np.asarray(alpha, float), np.asarray(beta, float), np.full(n, np.nan), np.full(n, np.nan))


@pytest.mark.parametrize(
    ("alpha", "beta", "band"),
    [
        (1, 1, 3),  # the flat prior: no evidence, uncertain (a normal approximation would say near)
        (3, 27, 0),  # mean 0.1, wide: below (grid)
        (270, 30, 2),  # mean 0.9, narrow: above (normal approximation)
        (50, 50, 1),  # near
        (6, 4, 1),  # wide (grid), 0.70 of its mass in [0.3, 0.7] (a fine-grid integral): near
    ],
)
def test_each_task_goes_to_the_band_holding_most_of_its_mass(alpha: float, beta: float, band: int) -> None:
    shares = posterior_summary(state([alpha], [beta]), target=0.5).shares
    assert shares[band] == 1.0 and sum(shares) == pytest.approx(1.0)


def test_quantiles_are_of_the_posterior_means() -> None:
    alpha = np.arange(1, 101, dtype=float)
    summary = posterior_summary(state(list(alpha), list(101 - alpha)), target=0.5)
    assert summary.mean_quantiles == pytest.approx(tuple(np.quantile(alpha / 101, (0.1, 0.5, 0.9))))


def test_forgetting_does_not_hide_hard_and_easy_tasks() -> None:
    """The issue's case: a quarter of the pool almost never solved, a quarter
    almost always, under the default forgetting. Fixed bands on the means
    (< 0.1, > 0.9) call > 90% "in between"; the summary calls none of the
    hard or easy tasks near the target."""
    params = EngineParams()
    rng = np.random.default_rng(0)
    p = np.concatenate([np.full(100, 0.03), np.full(100, 0.97), rng.uniform(0.35, 0.65, 200)])
    n = p.shape[0]
    s = PosteriorState.from_prior(params, np.full(n, np.nan), np.full(n, np.nan))
    for _ in range(300):
        idx = np.asarray(select(params, s.alpha, s.beta, np.ones(n, bool), 32, rng))
        s = apply_outcomes(params, s, idx, rng.binomial(16, p[idx]).astype(float), np.full(idx.shape[0], 16.0)).state
    mean = s.alpha / (s.alpha + s.beta)
    assert np.mean((mean >= 0.1) & (mean <= 0.9)) > 0.9  # what the old metric saw

    def part(sl: slice) -> tuple[float, float, float, float]:
        return posterior_summary(PosteriorState(s.alpha[sl], s.beta[sl], s.weak[sl], s.strong[sl]), 0.5).shares

    hard, easy, middle = part(slice(0, 100)), part(slice(100, 200)), part(slice(200, 400))
    assert hard[1] == 0 and hard[0] > 0.5
    assert easy[1] == 0 and easy[2] > 0.5
    assert middle[1] > 0.8
