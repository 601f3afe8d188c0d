"""bench/real_learner.py: small transformers trained by GRPO with batches from
a real server. A smoke test of --quick (every family, every arm), plus the
things that cannot fail by chance: a seed's uniform run is bit-identical when
repeated, and family c reports fractional successes to the server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench import real_learner
from bench.real_learner_tasks import SPECS, make_family, score


def test_quick_run_covers_every_family_and_arm(tmp_path: Path) -> None:
    out = tmp_path / "rl"
    assert real_learner.main(["--quick", "--output", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["families"]) == {"a", "b", "c"}
    assert list(result["arms"]) == list(real_learner.DEFAULT_ARMS)
    for fam, data in result["families"].items():
        curves = data["curves"]
        assert sorted(c["arm"] for c in curves) == sorted(real_learner.DEFAULT_ARMS), fam
        for c in curves:
            assert c["seed"] == 0
            assert c["steps"][0] == 0 and len(c["steps"]) >= 2, (fam, c["arm"])
            assert len(c["acc"]) == len(c["steps"]) and all(0.0 <= a <= 1.0 for a in c["acc"])
            assert len(c["informative"]) == len(c["steps"]) - 1
            assert bool(c["heldout"]) == (fam == "b")
            if not real_learner.uses_service(real_learner.ARMS[c["arm"]]):
                assert c["reported_outcomes"] == 0
            else:  # every service arm reported every step's tasks, and the server took them
                assert c["reported_outcomes"] >= SPECS[fam].batch * c["steps"][-1], (fam, c["arm"])
                if fam == "c":  # partial credit goes to the server as fractional successes
                    assert c["fractional_outcomes"] > 0, c["arm"]
                else:
                    assert c["fractional_outcomes"] == 0, (fam, c["arm"])
        # one row per metric, target and arm; ratios to both baselines per seed
        metrics = len(SPECS[fam].targets) + len(SPECS[fam].heldout_targets)
        assert len(data["summary"]) == metrics * len(real_learner.DEFAULT_ARMS)
        for row in data["summary"]:
            assert len(row["steps"]) == len(row["ratio_to_uniform"]) == len(row["ratio_to_bots"]) == 1
            if row["arm"] == "uniform":
                assert row["ratio_to_uniform"] == [1.0]
        assert data["references"] and set(data["references"][0]["mean_by_tier"]) == set(data["curves"][0]["tier_share"][0])
    text = out.with_suffix(".md").read_text()
    assert "python -m bench.real_learner --quick" in text
    for name in ("Family a: chain", "Family b: tiers", "Family c: partial", "| held-out |", "| bots-plus-ref |"):
        assert name in text


def test_quick_never_writes_the_committed_results() -> None:
    output = Path(real_learner.parse_args(["--quick"]).output)
    assert output.parent != real_learner.RESULTS and real_learner.RESULTS not in output.parents
    assert Path(real_learner.parse_args([]).output) == real_learner.RESULTS / "real-learner"


def test_task_embeddings_describe_the_prompt_and_differ_by_encoder() -> None:
    family = make_family("a", 2)
    init = real_learner.initial_policy(family, 2)
    hidden = real_learner.task_embeddings("hidden", family, init)
    encoder = real_learner.task_embeddings("encoder", family, init)
    assert hidden.shape == encoder.shape == (len(family.pool), 64) and hidden.dtype == np.float32
    assert np.isfinite(hidden).all() and not np.allclose(hidden, encoder)
    # the same prompt, the same embedding; a fixed encoder whatever the seed's policy
    other_policy = real_learner.initial_policy(family, 3)
    assert np.array_equal(encoder, real_learner.task_embeddings("encoder", family, other_policy))
    lengths = family.pool.lengths.numpy()
    # the prompt's length is in the embedding: a linear read-out separates short and long chains
    x = np.c_[np.ones(len(hidden)), hidden]
    coef, *_ = np.linalg.lstsq(x, lengths.astype(float), rcond=None)
    assert np.corrcoef(x @ coef, lengths)[0, 1] > 0.9


def test_same_seed_gives_identical_uniform_curves() -> None:
    family = make_family("a", 3)
    init = real_learner.initial_policy(family, 3)
    runs = [real_learner.train(family, "uniform", None, 3, 30, init, None, stop_early=False) for _ in range(2)]
    assert runs[0].acc == runs[1].acc and runs[0].mean_reward == runs[1].mean_reward
    assert runs[0].steps == list(range(0, 31, 10))


def test_the_oracle_picks_the_tasks_whose_sampled_groups_are_most_often_informative() -> None:
    # Checked against the policy's own samples: 64 rollouts of every task
    # give each task's empirical pass rate and chance of a mixed group of 8.
    spec = SPECS["a"]
    family = make_family("a", 1)
    policy = real_learner.initial_policy(family, 1)
    pool, m = family.pool, spec.rollouts
    rows = torch.arange(len(pool)).repeat_interleave(64)
    generator = torch.Generator().manual_seed(5)
    rewards = score(pool, rows, policy.generate(pool, rows, generator), False).view(len(pool), 64).double().numpy()
    sampled = rewards.mean(axis=1)
    exact = real_learner.pass_rates(policy, pool, False)
    assert abs(sampled.mean() - exact.mean()) < 0.005 and np.corrcoef(sampled, exact)[0, 1] > 0.9
    chance = 1 - sampled**m - (1 - sampled) ** m
    picked = real_learner.oracle_batch(policy, pool, spec, "informative", np.random.default_rng(0)).numpy()
    assert len(set(picked.tolist())) == spec.batch
    rest = np.setdiff1d(np.arange(len(pool)), picked)
    assert chance[picked].mean() > 0.7 > 5 * chance[rest].mean(), (chance[picked].mean(), chance[rest].mean())
    with pytest.raises(ValueError, match="unknown oracle rule"):
        real_learner.oracle_batch(policy, pool, spec, "best", np.random.default_rng(0))


def test_the_unsolved_oracle_draws_at_random_among_the_tasks_not_solved() -> None:
    # Family b's base policy already solves its r = 0 tasks (30% of the pool)
    spec = SPECS["b"]
    family = make_family("b", 1)
    policy = real_learner.initial_policy(family, 1)
    exact = real_learner.pass_rates(policy, family.pool, False)
    solved = exact >= real_learner.SOLVED
    assert solved.sum() == 240
    draws = [
        real_learner.oracle_batch(policy, family.pool, spec, "unsolved", np.random.default_rng(s)).numpy()
        for s in range(20)
    ]
    assert not any(solved[d].any() for d in draws)
    assert all(len(set(d.tolist())) == spec.batch for d in draws)
    # uniform among the 560 unsolved tasks: 20 batches of 32 touch most of them
    # (expected distinct: 560 (1 - (1 - 32/560)^20) = 387)
    assert len(set(np.concatenate(draws).tolist())) > 300


def test_an_oracle_arm_trains_without_a_server() -> None:
    family = make_family("a", 2)
    init = real_learner.initial_policy(family, 2)
    curve = real_learner.train(family, "oracle", real_learner.ARMS["oracle"], 2, 10, init, None, stop_early=False)
    assert curve.steps == [0, 10] and curve.reported_outcomes == 0
    # its batches are the most informative ones: 32 tasks, more than half mixed
    # (uniform batches hold about a quarter, bench/results/real-learner.md)
    assert curve.informative[0] > 0.5, curve.informative


def test_partial_credit_is_fractional_and_exact_match_is_binary() -> None:
    family = make_family("c", 0)
    pool = family.pool
    rows = (pool.lengths == 4).nonzero().flatten()[:1]
    completion = pool.y[rows][:, :4].clone()
    completion[0, 0] = (completion[0, 0] + 1) % SPECS["c"].vocab  # one of 4 symbols wrong
    assert score(pool, rows, completion, fractional=True).tolist() == [0.75]
    assert score(pool, rows, completion, fractional=False).tolist() == [0.0]


def test_arm_table_takes_one_more_engine_from_the_command_line() -> None:
    assert real_learner.parse_arm("lambda05:forgetting=0.05,selection_mode=expected,seed=3") == (
        "lambda05",
        {"forgetting": 0.05, "selection_mode": "expected", "seed": 3},
    )


def test_sources_run_mixes_two_sources_in_the_shares_each_arm_sets(tmp_path: Path) -> None:
    out = tmp_path / "sources"
    argv = ["--sources", "--families", "b", "--seeds", "1", "--steps", "20", "--arms", "fixed,adaptive", "--output", str(out)]
    assert real_learner.main(argv) == 0
    data = json.loads(out.with_suffix(".json").read_text())["families"]["b"]
    sources = real_learner.SOURCES["b"]
    assert data["sources"] == sources
    for curve in data["curves"]:
        assert curve["reported_outcomes"] >= SPECS["b"].batch * 20
        curated = [sum(v for t, v in window.items() if sources[t] == "curated") for window in curve["tier_share"]]
        if curve["arm"] == "fixed":  # SetGroupShares 0.5 / 0.5: 16 of every 32 tasks
            assert curated == [0.5, 0.5]
        else:  # adaptive within [0.1, 0.9]: never below 4 or above 28 of 32
            assert all(0.1 <= c <= 0.9 for c in curated) and curated != [0.5, 0.5]
    assert all(len(row["ratio_to_fixed"]) == 1 for row in data["summary"])
    text = out.with_suffix(".md").read_text()
    assert "| curated: share, first / second half |" in text and "/ fixed: median (range)" in text


def test_an_arm_sets_its_sources_shares() -> None:
    sources = real_learner.SOURCES["a"]
    assert real_learner.source_shares({"first_share": 0.875}, sources) == {"short": (0.875, 0.875), "long": (0.125, 0.125)}
    assert real_learner.source_shares({"share_min": 0.1, "share_max": 0.9}, sources) == {
        "short": (0.1, 0.9), "long": (0.1, 0.9),
    }  # fmt: skip
    assert real_learner.source_shares({"adaptive_shares": 1.0}, sources) == {}
    with pytest.raises(ValueError, match="--sources"):
        real_learner.source_shares({"first_share": 0.5}, None)


def _run(cpu: str, curves: list[dict[str, object]]) -> dict[str, object]:
    return {"machine": {"cpu": cpu}, "families": {"a": {"curves": curves}}}


def _curve(arm: str, seed: int, acc: list[float]) -> dict[str, object]:
    steps = [10 * i for i in range(len(acc))]
    return {"family": "a", "arm": arm, "seed": seed, "budget": steps[-1], "steps": steps, "acc": acc}


def test_merge_compares_one_runs_arm_with_another_runs_base() -> None:
    from bench import real_learner_summary

    targets = SPECS["a"].targets  # reached at the first evaluation at or above each
    bots = _curve("bots", 0, [0.0] + [targets[0]] * 2 + [targets[1]] * 2 + [targets[2]] * 3)  # 10, 30, 50
    new = _curve("new", 0, [0.0, targets[0], targets[1], targets[2]])  # 10, 20, 30
    result = real_learner_summary.merged([_run("x", [bots]), _run("x", [new, bots])])
    [line] = [x for x in real_learner_summary.mean_ratios(result) if x["arm"] == "new"]
    assert line["ratios"]["bots"] == pytest.approx(((10 / 10 + 20 / 30 + 30 / 50) / 3, 0.0))
    # A second seed where the new arm takes bots's steps: the mean of the two
    # seeds' means, and the standard error of those two (|a - b| / 2).
    again = [_curve(arm, 1, bots["acc"]) for arm in ("bots", "new")]  # type: ignore[arg-type]
    result = real_learner_summary.merged([_run("x", [bots, *again]), _run("x", [new])])
    [line] = [x for x in real_learner_summary.mean_ratios(result) if x["arm"] == "new"]
    first = (10 / 10 + 20 / 30 + 30 / 50) / 3
    assert line["ratios"]["bots"] == pytest.approx(((first + 1) / 2, (1 - first) / 2))
    with pytest.raises(SystemExit, match="different CPUs"):
        real_learner_summary.merged([_run("x", [bots]), _run("y", [new])])
    with pytest.raises(SystemExit, match="arm bots, seed 0 differs"):
        real_learner_summary.merged([_run("x", [bots]), _run("x", [_curve("bots", 0, [0.0, 1.0])])])
