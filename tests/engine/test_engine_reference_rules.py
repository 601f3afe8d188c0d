"""The reference implementation's rules that the paper's defaults leave off
(Trinity-RFT's DifficultyBasedSelector and its estimator; MoPPS), each an
opt-in setting, against values worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from bots_server.engine import EngineParams, PosteriorState, apply_outcomes


def arr(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# --------------------------------------------------------------------------
# Integer priors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["mopps", "bots"])
def test_integer_prior_gives_float_arrays_and_no_truncation(strategy: str) -> None:
    # a0 = b0 = 2 given as Python ints, lambda = 0.5, task 0 reports 1.5 of 4.
    # MoPPS: alpha0 = 0.5*2 + 0.5*2 + 1.5 = 3.5, beta0 = 0.5*2 + 0.5*2 + 2.5 = 4.5.
    # BOTS without features (rho acts as 0): alpha0 = 2 + 16*0.375 = 8.0,
    # beta0 = 2 + 16*0.625 = 12.0; task 1: 0.5*2 + 0.5*2 = 2.0.
    params = EngineParams(strategy=strategy, prior_alpha=2, prior_beta=2, forgetting=0.5)
    state = PosteriorState.from_prior(params, arr(np.nan, np.nan), arr(np.nan, np.nan))
    assert state.alpha.dtype == np.float64 and state.beta.dtype == np.float64
    grown = state.extended(params, arr(np.nan), arr(np.nan))
    assert grown.alpha.dtype == np.float64 and grown.beta.dtype == np.float64
    new = apply_outcomes(params, state, ints(0), arr(1.5), arr(4.0)).state
    if strategy == "mopps":
        assert new.alpha.tolist() == [3.5, 2.0]
        assert new.beta.tolist() == [4.5, 2.0]
    else:
        assert new.alpha.tolist() == [8.0, 2.0]
        assert new.beta.tolist() == [12.0, 2.0]

