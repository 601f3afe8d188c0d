"""vLLM rollouts: n samples per task, a verifier, per-task outcomes, one report.

    from vllm import LLM
    from bots_client.integrations.vllm import rollout_and_report

    llm = LLM("Qwen/Qwen2.5-1.5B-Instruct")
    batch = client.select_batch("exp", batch_size=64, request_key=f"step-{step}")
    rollouts, result = rollout_and_report(
        client, "exp", batch, prompts={k: prompt_of[k] for k in batch.keys}, n=16,
        verifier=lambda key, prompt, completion: completion.strip().endswith(answer_of[key]),
        llm=llm, temperature=1.0, max_tokens=1024)
    # rollouts.completions[i][j], rollouts.rewards[i][j], rollouts.outcomes[key] == (successes, trials)

Or against a running OpenAI-compatible vLLM server (`vllm serve ...`):
`endpoint="http://gpu-node:8000/v1", model="Qwen/Qwen2.5-1.5B-Instruct"` instead
of `llm=`. The grouping, scoring and reporting are plain functions (`score`,
`group_flat`); generation is a thin layer (`generate_llm`,
`generate_openai`), and any `generate(prompts, n) -> [[completion] * n]`
callable can replace it. vLLM itself is imported only by `generate_llm`
when no SamplingParams is passed; the endpoint path needs no extra package
(or pass `openai_client=openai.OpenAI(base_url=..., api_key=...)` to go through the
official client).

`max_tokens` is required on the `llm=` and `endpoint=` paths: vLLM's
default is 16 tokens (SamplingParams and /v1/completions alike), which
silently truncates every rollout and turns the verifier's answer into noise.
Completions that stop at the limit (finish_reason "length") are counted and
logged as a WARNING.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bots_client.integrations._core import aggregate_outcomes
from bots_client.types import ReportResult

if TYPE_CHECKING:
    from bots_client.client import Client

__all__ = [
    "Rollouts",
    "generate_llm",
    "generate_openai",
    "group_flat",
    "rollout",
    "rollout_and_report",
    "score",
]

log = logging.getLogger("bots_client.integrations.vllm")

# (task key, prompt, completion) -> reward (bool or float)
Verifier = Callable[[str, Any, str], Any]
Generate = Callable[[Sequence[Any], int], Sequence[Sequence[str]]]


@dataclass
class Rollouts:
    """One batch's rollouts, task by task (same order as `keys`)."""

    keys: list[str]
    prompts: list[Any]
    completions: list[list[str]]
    rewards: list[list[float]]
    outcomes: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def success_rate(self) -> dict[str, float]:
        return {k: (s / n if n else 0.0) for k, (s, n) in self.outcomes.items()}


def group_flat(flat: Sequence[Any], n: int) -> list[list[Any]]:
    """[p0s0, ..., p0s(n-1), p1s0, ...] -> [[p0's n samples], [p1's], ...]."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if len(flat) % n:
        raise ValueError(f"{len(flat)} completions are not a whole number of groups of n = {n}")
    return [list(flat[i : i + n]) for i in range(0, len(flat), n)]


def score(
    keys: Sequence[str],
    prompts: Sequence[Any],
    completions: Sequence[Sequence[str]],
    verifier: Verifier,
    *,
    success_threshold: float | None = 0.5,
) -> Rollouts:
    """Verify every completion and count per-task successes and trials
    (a reward >= success_threshold is a success; None: rewards in [0, 1]
    count fractionally). Nothing is filtered: all-correct and all-wrong
    groups are the evidence the posterior needs."""
    if not len(keys) == len(prompts) == len(completions):
        raise ValueError(f"got {len(keys)} keys, {len(prompts)} prompts and {len(completions)} completion groups")
    rewards: list[list[float]] = []
    flat_keys: list[str] = []
    flat_rewards: list[float] = []
    for key, prompt, group in zip(keys, prompts, completions):
        group_rewards = [float(verifier(key, prompt, completion)) for completion in group]
        rewards.append(group_rewards)
        flat_keys.extend([key] * len(group))
        flat_rewards.extend(group_rewards)
    outcomes = aggregate_outcomes(flat_keys, flat_rewards, success_threshold=success_threshold)
    return Rollouts(list(keys), list(prompts), [list(g) for g in completions], rewards, outcomes)


def require_max_tokens(params: Mapping[str, Any]) -> None:
    """Refuse generation parameters without a positive `max_tokens`."""
    value = params.get("max_tokens")
    if value is None:
        raise TypeError(
            "pass max_tokens=: vLLM's default is 16 tokens, which silently truncates rollouts "
            "(use the longest answer you accept, e.g. max_tokens=1024)"
        )
    if int(value) <= 0:
        raise ValueError(f"max_tokens must be positive, got {value}")


def warn_truncated(finish_reasons: Sequence[Any], max_tokens: Any) -> int:
    """Log how many completions stopped at max_tokens; returns the count."""
    truncated = sum(1 for r in finish_reasons if r == "length")
    if truncated:
        log.warning(
            "%d of %d completions stopped at max_tokens = %s (finish_reason 'length'): "
            "their rewards judge cut-off answers",
            truncated,
            len(finish_reasons),
            max_tokens,
        )
    return truncated


def generate_llm(
    llm: Any, prompts: Sequence[Any], n: int, sampling_params: Any = None, *, chat: bool = False, **sampling: Any
) -> list[list[str]]:
    """n completions per prompt from a vLLM `LLM` (`llm.generate`, or
    `llm.chat` for conversations), in prompt order. Without
    `sampling_params`, builds `vllm.SamplingParams(n=n, **sampling)`, which
    needs `max_tokens`."""
    if sampling_params is None:
        require_max_tokens(sampling)
        from vllm import SamplingParams

        sampling_params = SamplingParams(n=n, **sampling)
    elif getattr(sampling_params, "n", n) != n:
        raise ValueError(f"sampling_params.n = {sampling_params.n} but n = {n}")
    outputs = (llm.chat if chat else llm.generate)(list(prompts), sampling_params)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    groups = []
    reasons: list[Any] = []
    for request in outputs:
        samples = sorted(request.outputs, key=lambda o: getattr(o, "index", 0))
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected n = {n}")
        groups.append([s.text for s in samples])
        reasons.extend(getattr(s, "finish_reason", None) for s in samples)
    warn_truncated(reasons, getattr(sampling_params, "max_tokens", None))
    return groups


def _post(url: str, body: Mapping[str, Any], api_key: str | None, timeout: float) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} failed with HTTP {e.code}: {e.read()[:500]!r}") from None


def generate_openai(
    endpoint: str | None,
    model: str,
    prompts: Sequence[Any],
    n: int,
    *,
    chat: bool = False,
    api_key: str | None = None,
    timeout: float = 600.0,
    openai_client: Any = None,
    **params: Any,
) -> list[list[str]]:
    """n completions per prompt from an OpenAI-compatible server (vLLM's
    `vllm serve`). Completions: one request for all prompts; vLLM numbers the
    choices prompt_index * n + sample. Chat: one request per conversation.
    With `openai_client` (an `openai.OpenAI`), requests go through it (vLLM-only
    sampling parameters then belong in `extra_body={...}`); else through
    urllib to `endpoint`. `max_tokens` is required."""
    require_max_tokens(params)
    if openai_client is None and not endpoint:
        raise TypeError("pass endpoint= or openai_client=")

    def post(path: str, body: dict[str, Any]) -> Any:
        if openai_client is not None:
            api = openai_client.chat.completions if path == "chat/completions" else openai_client.completions
            return api.create(**body, timeout=timeout).model_dump()
        assert endpoint is not None
        return _post(f"{endpoint.rstrip('/')}/{path}", body, api_key, timeout)

    reasons: list[Any] = []
    if chat:
        conversations: list[list[str]] = []
        for messages in prompts:
            choices = sorted(
                post("chat/completions", {"model": model, "messages": messages, "n": n, **params})["choices"],
                key=lambda c: c["index"],
            )
            if len(choices) != n:
                raise RuntimeError(f"the server returned {len(choices)} choices, expected n = {n}")
            conversations.append([c["message"]["content"] or "" for c in choices])
            reasons.extend(c.get("finish_reason") for c in choices)
        warn_truncated(reasons, params["max_tokens"])
        return conversations
    choices = post("completions", {"model": model, "prompt": list(prompts), "n": n, **params})["choices"]
    if len(choices) != n * len(prompts):
        raise RuntimeError(f"the server returned {len(choices)} choices for {len(prompts)} prompts x n = {n}")
    groups: list[list[str]] = [[""] * n for _ in prompts]
    for choice in choices:
        prompt_index, sample = divmod(int(choice["index"]), n)
        groups[prompt_index][sample] = choice["text"]
        reasons.append(choice.get("finish_reason"))
    warn_truncated(reasons, params["max_tokens"])
    return groups


def rollout(
    prompts: Mapping[str, Any],
    n: int,
    verifier: Verifier,
    *,
    llm: Any = None,
    endpoint: str | None = None,
    model: str | None = None,
    generate: Generate | None = None,
    openai_client: Any = None,
    sampling_params: Any = None,
    chat: bool = False,
    success_threshold: float | None = 0.5,
    **params: Any,
) -> Rollouts:
    """Generate n samples for every task (key -> prompt) with exactly one of
    `llm`, `endpoint` (+ `model`), `openai_client` (an `openai.OpenAI`, +
    `model`) or `generate`, and score them. `max_tokens` is required with
    `llm` (unless `sampling_params` is given), `endpoint` and `openai_client`."""
    if sum(x is not None for x in (llm, endpoint, generate, openai_client)) != 1:
        raise TypeError("pass exactly one of llm=, endpoint=, openai_client= or generate=")
    keys = list(prompts)
    texts = [prompts[k] for k in keys]
    if llm is not None:
        completions = generate_llm(llm, texts, n, sampling_params, chat=chat, **params)
    elif endpoint is not None or openai_client is not None:
        if not model:
            raise TypeError("endpoint= and openai_client= need model=")
        completions = generate_openai(endpoint, model, texts, n, chat=chat, openai_client=openai_client, **params)
    else:
        assert generate is not None
        completions = [list(g) for g in generate(texts, n)]
    return score(keys, texts, completions, verifier, success_threshold=success_threshold)


def rollout_and_report(
    client: Client,
    experiment: str,
    batch: Any,
    prompts: Mapping[str, Any],
    n: int,
    verifier: Verifier,
    **kwargs: Any,
) -> tuple[Rollouts, ReportResult]:
    """Roll out a selected batch (`bots_client.Batch` or `SelectedBatch`),
    score it and report its per-task outcomes against the batch. `prompts`
    must hold a prompt for every key of the batch."""
    missing = [k for k in batch.keys if k not in prompts]
    if missing:
        raise KeyError(f"no prompt for {len(missing)} tasks of the batch, e.g. {missing[:3]}")
    rollouts = rollout({k: prompts[k] for k in batch.keys}, n, verifier, **kwargs)
    result = client.report_outcomes(experiment, batch.batch_id, rollouts.outcomes)
    return rollouts, result
