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

Nothing is scored that was not generated as asked: a caller's SamplingParams
(or `extra_body`) that disagrees with `n=`, `max_tokens=` or another keyword
raises ValueError; a chat completion without `message.content` (a tool call, a
refusal, a reasoning model that spent max_tokens on reasoning) raises
EmptyCompletionError unless `on_empty="score"`, which verifies it as "" and
counts it in `Rollouts.empty`; a `generate=` callable must return exactly one
group of n completions per prompt.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from bots_client.integrations._core import (
    GroupSizeMismatchError,
    OutcomeValue,
    SelectedBatch,
    aggregate_outcomes,
    group_size_problem,
)
from bots_client.types import ReportResult

if TYPE_CHECKING:
    from bots_client.client import Client

__all__ = [
    "EmptyCompletionError",
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
# What to do with a completion that came back without content: "raise"
# (EmptyCompletionError), or "score" (verify it as "" and count it).
OnEmpty = Literal["raise", "score"]


class EmptyCompletionError(RuntimeError):
    """A completion came back without content (`message.content` is None):
    scoring it would invent a reward. Pass `on_empty="score"` to verify such
    completions as "" and count them in `Rollouts.empty` instead."""


@dataclass
class Rollouts:
    """One batch's rollouts, task by task (same order as `keys`)."""

    keys: list[str]
    prompts: list[Any]
    completions: list[list[str]]
    rewards: list[list[float]]
    outcomes: dict[str, OutcomeValue] = field(default_factory=dict)
    # completions that came back without content, verified as "" (on_empty="score")
    empty: int = 0

    @property
    def success_rate(self) -> dict[str, float]:
        return {k: (v[0] / v[1] if v[1] else 0.0) for k, v in self.outcomes.items()}


def group_flat(flat: Sequence[Any], n: int) -> list[list[Any]]:
    """[p0s0, ..., p0s(n-1), p1s0, ...] -> [[p0's n samples], [p1's], ...]."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if len(flat) % n:
        raise ValueError(
            f"{len(flat)} completions are not a whole number of groups of n = {n}: "
            "pass exactly n completions per prompt, prompt by prompt"
        )
    return [list(flat[i : i + n]) for i in range(0, len(flat), n)]


def score(
    keys: Sequence[str],
    prompts: Sequence[Any],
    completions: Sequence[Sequence[str]],
    verifier: Verifier,
    *,
    success_threshold: float | None = 0.5,
    n: int | None = None,
) -> Rollouts:
    """Verify every completion and count per-task successes and trials
    (a reward >= success_threshold is a success; None: rewards in [0, 1]
    count fractionally). Nothing is filtered: all-correct and all-wrong
    groups are the evidence the posterior needs. With `n`, every group
    must hold exactly n completions (the trials the report counts)."""
    if not len(keys) == len(prompts) == len(completions):
        raise ValueError(
            f"got {len(keys)} keys, {len(prompts)} prompts and {len(completions)} completion groups: "
            "pass one group of completions per task, in key order"
        )
    rewards: list[list[float]] = []
    flat_keys: list[str] = []
    flat_rewards: list[float] = []
    for key, prompt, group in zip(keys, prompts, completions):
        if isinstance(group, str):
            raise TypeError(f"task {key!r}: the completion group is a str; pass a list of completions per task")
        if not group or (n is not None and len(group) != n):
            expected = f"n = {n}" if n is not None else "at least one"
            raise ValueError(
                f"task {key!r}: got {len(group)} completions, expected {expected}: "
                "every task's group must hold the n samples generated for it"
            )
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


def check_caller_params(params: Any, n: int, given: Mapping[str, Any]) -> None:
    """A caller's SamplingParams is used as it is: refuse one whose `n`
    differs from the requested n, or that disagrees with (or lacks) a
    parameter also given as a keyword, which would otherwise be ignored."""
    if getattr(params, "n", n) != n:
        raise ValueError(
            f"sampling_params.n = {params.n} but n = {n}: n is the group size every task's trials are "
            f"counted by; pass SamplingParams(n={n}, ...)"
        )
    for name, value in given.items():
        if not hasattr(params, name):
            raise TypeError(
                f"{name}={value!r} was passed with sampling_params, which has no {name}: "
                "set it on the SamplingParams instead"
            )
        if getattr(params, name) != value:
            raise ValueError(
                f"sampling_params.{name} = {getattr(params, name)!r} but {name}={value!r}: the SamplingParams "
                f"would silently win; make them agree or pass {name} in one place only"
            )


def generate_llm(
    llm: Any, prompts: Sequence[Any], n: int, sampling_params: Any = None, *, chat: bool = False, **sampling: Any
) -> list[list[str]]:
    """n completions per prompt from a vLLM `LLM` (`llm.generate`, or
    `llm.chat` for conversations), in prompt order. Without
    `sampling_params`, builds `vllm.SamplingParams(n=n, **sampling)`, which
    needs `max_tokens`. A caller's `sampling_params` is used as it is; its
    `n` must be n, and keywords given beside it must agree with it."""
    if sampling_params is None:
        require_max_tokens(sampling)
        from vllm import SamplingParams

        sampling_params = SamplingParams(n=n, **sampling)
    else:
        check_caller_params(sampling_params, n, sampling)
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


def content_of(text: Any, on_empty: OnEmpty, where: str, choice: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """A completion's text, and whether it came back without content (None):
    that raises unless on_empty == "score", which makes it ""."""
    if text is not None:
        return text, False
    if on_empty == "score":
        return "", True
    detail = ""
    if choice is not None:
        message = choice.get("message") or {}
        held = [f for f in ("tool_calls", "refusal", "reasoning", "reasoning_content") if message.get(f)]
        detail = f" (finish_reason {choice.get('finish_reason')!r}{'; it holds ' + ', '.join(held) if held else ''})"
    raise EmptyCompletionError(
        f"{where} has no content{detail}: a tool call, a refusal or a reasoning model that spent max_tokens "
        "on reasoning is no answer to verify, and scoring it as a failure would invent a reward. Fix the request "
        '(no tools, a larger max_tokens) or pass on_empty="score" to verify it as "" and count it in Rollouts.empty'
    )


def check_on_empty(on_empty: str) -> None:
    if on_empty not in ("raise", "score"):
        raise ValueError(f'on_empty must be "raise" or "score", got {on_empty!r}')


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
    on_empty: OnEmpty = "raise",
    **params: Any,
) -> list[list[str]]:
    """n completions per prompt from an OpenAI-compatible server (vLLM's
    `vllm serve`). Completions: one request for all prompts; vLLM numbers the
    choices prompt_index * n + sample. Chat: one request per conversation.
    With `openai_client` (an `openai.OpenAI`), requests go through it; else
    through urllib to `endpoint`. vLLM-only sampling parameters belong in
    `extra_body={...}` (merged into the request on both paths; it must not
    contradict `n` or the keywords). `max_tokens` is required. A completion
    without content raises EmptyCompletionError; with `on_empty="score"` it
    becomes "" (counted in `rollout`'s `Rollouts.empty`, logged here)."""
    return _generate_openai(
        endpoint, model, prompts, n, [f"prompt {i}" for i in range(len(prompts))], chat=chat, api_key=api_key,
        timeout=timeout, openai_client=openai_client, on_empty=on_empty, **params,
    )[0]  # fmt: skip


def _generate_openai(
    endpoint: str | None,
    model: str,
    prompts: Sequence[Any],
    n: int,
    labels: Sequence[str],
    *,
    chat: bool = False,
    api_key: str | None = None,
    timeout: float = 600.0,
    openai_client: Any = None,
    on_empty: OnEmpty = "raise",
    **params: Any,
) -> tuple[list[list[str]], int]:
    """generate_openai, naming prompts by `labels` in errors; also returns
    how many completions came back without content."""
    require_max_tokens(params)
    check_on_empty(on_empty)
    if openai_client is None and not endpoint:
        raise TypeError("pass endpoint= or openai_client=")
    extra = dict(params.pop("extra_body", None) or {})
    bounds = {"model": model, "n": n, **params}
    for name, value in extra.items():
        if name in ("prompt", "messages"):
            raise ValueError(f"extra_body[{name!r}] would replace the prompts; pass prompts only")
        if name in bounds and bounds[name] != value:
            raise ValueError(
                f"extra_body[{name!r}] = {value!r} but {name}={bounds[name]!r}: extra_body would silently win; "
                f"make them agree or pass {name} in one place only"
            )
    given = {**bounds, **extra}
    if given.get("max_completion_tokens", given["max_tokens"]) != given["max_tokens"]:
        raise ValueError(
            f"max_completion_tokens = {given['max_completion_tokens']!r} but max_tokens={given['max_tokens']!r}: "
            "vLLM would silently use max_completion_tokens; pass one of them"
        )

    def post(path: str, body: dict[str, Any]) -> Any:
        if openai_client is not None:
            api = openai_client.chat.completions if path == "chat/completions" else openai_client.completions
            return api.create(**body, **({"extra_body": extra} if extra else {}), timeout=timeout).model_dump()
        assert endpoint is not None
        return _post(f"{endpoint.rstrip('/')}/{path}", {**body, **extra}, api_key, timeout)

    reasons: list[Any] = []
    empty = 0
    if chat:
        conversations: list[list[str]] = []
        for label, messages in zip(labels, prompts):
            choices = sorted(
                post("chat/completions", {"model": model, "messages": messages, "n": n, **params})["choices"],
                key=lambda c: c["index"],
            )
            if len(choices) != n:
                raise RuntimeError(f"{label}: the server returned {len(choices)} choices, expected n = {n}")
            group = []
            for c in choices:
                where = f"{label}: chat completion choice {c['index']}"
                text, was_empty = content_of(c["message"]["content"], on_empty, where, c)
                group.append(text)
                empty += was_empty
            conversations.append(group)
            reasons.extend(c.get("finish_reason") for c in choices)
        warn_truncated(reasons, params["max_tokens"])
        warn_empty(empty, len(reasons))
        return conversations, empty
    choices = post("completions", {"model": model, "prompt": list(prompts), "n": n, **params})["choices"]
    if len(choices) != n * len(prompts):
        raise RuntimeError(f"the server returned {len(choices)} choices for {len(prompts)} prompts x n = {n}")
    slots: list[list[str | None]] = [[None] * n for _ in prompts]
    for choice in choices:
        prompt_index, sample = divmod(int(choice["index"]), n)
        if not 0 <= prompt_index < len(prompts) or slots[prompt_index][sample] is not None:
            raise RuntimeError(
                f"the server numbered choices {sorted(int(c['index']) for c in choices)}, expected each of "
                f"0..{n * len(prompts) - 1} once (prompt_index * n + sample, as vLLM does)"
            )
        where = f"{labels[prompt_index]}: completion choice {choice['index']}"
        text, was_empty = content_of(choice["text"], on_empty, where, choice)
        slots[prompt_index][sample] = text
        empty += was_empty
        reasons.append(choice.get("finish_reason"))
    warn_truncated(reasons, params["max_tokens"])
    warn_empty(empty, len(reasons))
    return [[t or "" for t in group] for group in slots], empty


def warn_empty(empty: int, total: int) -> None:
    if empty:
        log.warning('%d of %d completions came back without content and are verified as "" (on_empty="score")',
                    empty, total)  # fmt: skip


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
    on_empty: OnEmpty = "raise",
    **params: Any,
) -> Rollouts:
    """Generate n samples for every task (key -> prompt) with exactly one of
    `llm`, `endpoint` (+ `model`), `openai_client` (an `openai.OpenAI`, +
    `model`) or `generate`, and score them. `max_tokens` is required with
    `llm` (unless `sampling_params` is given), `endpoint` and `openai_client`.
    `sampling_params` goes with `llm` only, and sampling keywords not with
    `generate` (bind them in the callable), which must return one group of
    exactly n completions per prompt, in prompt order. A completion without
    content raises EmptyCompletionError unless `on_empty="score"`: then it is
    verified as "" and counted in `Rollouts.empty`."""
    if sum(x is not None for x in (llm, endpoint, generate, openai_client)) != 1:
        raise TypeError("pass exactly one of llm=, endpoint=, openai_client= or generate=")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    check_on_empty(on_empty)
    if sampling_params is not None and llm is None:
        raise TypeError(
            "sampling_params= is used with llm= only (it would be ignored here); pass its fields as keywords "
            "(max_tokens=..., temperature=...) with endpoint=/openai_client=, or bind them in generate="
        )
    if generate is not None and params:
        raise TypeError(
            f"generate= takes no sampling parameters (got {sorted(params)}, which would be ignored); "
            "bind them in the callable"
        )
    keys = list(prompts)
    texts = [prompts[k] for k in keys]
    empty = 0
    if llm is not None:
        completions = generate_llm(llm, texts, n, sampling_params, chat=chat, **params)
    elif endpoint is not None or openai_client is not None:
        if not model:
            raise TypeError("endpoint= and openai_client= need model=")
        completions, empty = _generate_openai(
            endpoint, model, texts, n, [f"task {k!r}" for k in keys], chat=chat, openai_client=openai_client,
            on_empty=on_empty, **params,
        )  # fmt: skip
    else:
        assert generate is not None
        groups = list(generate(texts, n))
        if len(groups) != len(keys):
            raise ValueError(
                f"generate returned {len(groups)} groups for {len(keys)} prompts: "
                f"it must return one group of n = {n} completions per prompt, in prompt order"
            )
        completions = []
        for key, group in zip(keys, groups):
            if isinstance(group, str):
                raise TypeError(f"task {key!r}: generate returned a str, not a group of n = {n} completions")
            checked = []
            for j, completion in enumerate(group):
                text, was_empty = content_of(completion, on_empty, f"task {key!r}: generate's sample {j}")
                checked.append(text)
                empty += was_empty
            completions.append(checked)
        warn_empty(empty, sum(len(g) for g in completions))
    rollouts = score(keys, texts, completions, verifier, success_threshold=success_threshold, n=n)
    rollouts.empty = empty
    return rollouts


def rollout_and_report(
    client: Client,
    experiment: str,
    batch: Any,
    prompts: Mapping[str, Any],
    n: int,
    verifier: Verifier,
    **kwargs: Any,
) -> tuple[Rollouts, ReportResult]:
    """Roll out a batch from `client.select_batch`, score it and report its
    per-task outcomes against the batch. `prompts` must hold a prompt for
    every key of the batch. A Curriculum's batch (`SelectedBatch`) is
    refused: reported past its Curriculum, it would stay open there, and a
    checkpoint would take it for unreported; roll it out with `rollout` and
    report through the Curriculum. An experiment whose rollouts_per_task is
    not `n` is refused before anything is rolled out
    (GroupSizeMismatchError)."""
    if isinstance(batch, SelectedBatch):
        raise TypeError(
            f"batch {batch.number} was drawn by a Curriculum: roll it out with rollout(...) and report "
            "rollouts.outcomes through curriculum.report(..., batch=batch), so that its checkpoints know it reported"
        )
    missing = [k for k in batch.keys if k not in prompts]
    if missing:
        raise KeyError(f"no prompt for {len(missing)} tasks of the batch, e.g. {missing[:3]}")
    problem = group_size_problem(experiment, client.get_experiment(experiment).config.rollouts_per_task, n, "n")
    if problem is not None:
        raise GroupSizeMismatchError(problem)
    rollouts = rollout({k: prompts[k] for k in batch.keys}, n, verifier, **kwargs)
    result = client.report_outcomes(experiment, batch.batch_id, rollouts.outcomes)
    return rollouts, result
