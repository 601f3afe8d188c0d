"""The simulator reports how closely its reference models track the learner."""

from __future__ import annotations

import numpy as np

from bench.simmodel import World, WorldConfig, reference_correlations


def test_reference_correlations_is_pearson_of_measured_rates_with_initial_pass_rates() -> None:
    world = World.generate(WorldConfig(num_tasks=400, num_heldout=50), seed=3)
    weak, strong = reference_correlations(world)
    # A plain re-statement of Pearson's r: covariance over the product of the spreads.
    p0 = 1.0 / (1.0 + np.exp(-(world.discrimination * (world.theta0[world.skill] - world.difficulty) + world.affinity)))

    def pearson(x: np.ndarray, y: np.ndarray) -> float:
        dx, dy = x - x.mean(), y - y.mean()
        return float((dx * dy).sum() / np.sqrt((dx * dx).sum() * (dy * dy).sum()))

    assert abs(weak - pearson(world.weak_ref, p0)) < 1e-12
    assert abs(strong - pearson(world.strong_ref, p0)) < 1e-12
    assert -1.0 <= strong <= 1.0 and -1.0 <= weak <= 1.0
