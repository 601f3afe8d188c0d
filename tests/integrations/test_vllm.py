"""bots_client.integrations.vllm.

vLLM needs a GPU (and its own torch build), so it is not installed here.
The grouping, scoring and reporting are plain functions tested directly; the
generation layer is tested against vLLM's documented shapes: `LLM.generate`
returns one RequestOutput per prompt, in prompt order, whose `.outputs` are
n CompletionOutputs (`.index`, `.text`); the OpenAI-compatible server
(`vllm serve`) answers /v1/completions with choices numbered
prompt_index * n + sample, and /v1/chat/completions with n choices of
`message.content`. The server side runs as a real HTTP server on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

import bots_client
from bots_client.integrations import GroupSizeMismatchError
from bots_client.integrations.vllm import (
    EmptyCompletionError,
    generate_llm,
    generate_openai,
    group_flat,
    rollout,
    rollout_and_report,
    score,
)
from tests.integrations.conftest import EXACT, counts, need

ANSWERS = {"t0": "4", "t1": "9", "t2": "16"}
# The runs below roll out n = 2 completions per task.
EXACT_2 = dataclasses.replace(EXACT, rollouts_per_task=2)


def verifier(key: str, prompt: Any, completion: str) -> bool:
    return completion.strip() == ANSWERS[key]


def test_group_flat_and_score_count_every_sample() -> None:
    assert group_flat(list("aabbcc"), 2) == [["a", "a"], ["b", "b"], ["c", "c"]]
    with pytest.raises(ValueError, match="whole number"):
        group_flat(list("abc"), 2)
    completions = [["4", "5", " 4 "], ["9", "9", "9"], ["1", "2", "3"]]
    r = score(list(ANSWERS), ["2*2", "3*3", "4*4"], completions, verifier)
    assert r.rewards == [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    # All-correct and all-wrong groups are reported too: that is the evidence.
    assert r.outcomes == {"t0": (2.0, 3), "t1": (3.0, 3), "t2": (0.0, 3)}
    assert r.success_rate["t0"] == pytest.approx(2 / 3)
    partial = score(["t0"], ["p"], [["a", "b"]], lambda k, p, c: 0.25 if c == "a" else 1.0, success_threshold=None)
    assert partial.outcomes == {"t0": (1.25, 2, 1.0625)}  # with the sum of squared rewards


class FakeLLM:
    """vLLM's LLM.generate / LLM.chat shapes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def _outputs(self, prompts: list[Any], params: Any) -> list[Any]:
        outs = []
        for p_i, prompt in enumerate(prompts):
            samples = [SimpleNamespace(index=j, text=f"{p_i}:{j}") for j in range(params.n)]
            random.Random(p_i).shuffle(samples)  # completion order is not guaranteed
            outs.append(SimpleNamespace(prompt=prompt, outputs=samples))
        return outs

    def generate(self, prompts: list[Any], params: Any) -> list[Any]:
        self.calls.append(("generate", prompts, params))
        return self._outputs(prompts, params)

    def chat(self, conversations: list[Any], params: Any) -> list[Any]:
        self.calls.append(("chat", conversations, params))
        return self._outputs(conversations, params)


def test_generate_llm_groups_by_prompt_and_sample_index() -> None:
    llm = FakeLLM()
    params = SimpleNamespace(n=3, temperature=1.0)
    groups = generate_llm(llm, ["a", "b"], 3, params)
    assert groups == [["0:0", "0:1", "0:2"], ["1:0", "1:1", "1:2"]]
    assert llm.calls[0][0] == "generate"
    generate_llm(llm, [[{"role": "user", "content": "hi"}]], 3, params, chat=True)
    assert llm.calls[1][0] == "chat"
    with pytest.raises(ValueError, match="sampling_params.n"):
        generate_llm(llm, ["a"], 4, params)


class OpenAIHandler(BaseHTTPRequestHandler):
    """Answers like `vllm serve`: the response bodies of vLLM's
    CompletionResponse and ChatCompletionResponse (vllm/entrypoints/openai/
    {completion,chat_completion}/protocol.py), every field included, choices
    in completion order. A sample stops at max_tokens ("length") when its
    text would be longer; a request without max_tokens gets vLLM's default
    for completions, 16. Chat samples listed in `no_content` come back the
    way vLLM answers a tool call or a reasoning model cut off at max_tokens:
    `message.content` None."""

    requests: ClassVar[list[dict[str, Any]]] = []
    no_content: ClassVar[dict[int, str]] = {}  # chat sample -> "tool_calls" | "reasoning"
    index_per_prompt: ClassVar[bool] = False  # number completion choices 0..n-1 for each prompt (not vLLM's way)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        OpenAIHandler.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
        n, limit = body.get("n", 1), body.get("max_tokens", 16)
        usage = {"prompt_tokens": 7, "total_tokens": 7 + 3 * n, "completion_tokens": 3 * n,
                 "prompt_tokens_details": None}  # fmt: skip

        def finish(text: str) -> tuple[str, str]:
            words = text.split()
            return (" ".join(words[:limit]), "length") if len(words) > limit else (text, "stop")

        if self.path.endswith("/chat/completions"):
            last = body["messages"][-1]["content"]
            choices = []
            for j in range(n):
                text, reason = finish(f"{last}#{j}")
                choices.append({
                    "index": j, "logprobs": None, "finish_reason": reason, "stop_reason": None, "token_ids": None,
                    "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                "audio": None, "function_call": None, "tool_calls": [], "reasoning": None},
                })  # fmt: skip
                kind = OpenAIHandler.no_content.get(j)
                if kind == "tool_calls":
                    choices[-1]["finish_reason"] = "tool_calls"
                    choices[-1]["message"].update(content=None, tool_calls=[{
                        "id": f"chatcmpl-tool-{j}", "type": "function",
                        "function": {"name": "calculator", "arguments": json.dumps({"expression": last})},
                    }])  # fmt: skip
                elif kind == "reasoning":
                    choices[-1]["finish_reason"] = "length"
                    choices[-1]["message"].update(content=None, reasoning="Let me think step by step")
            response = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1767225600,
                        "model": body["model"], "choices": choices, "service_tier": None,
                        "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
                        "prompt_token_ids": None, "kv_transfer_params": None}  # fmt: skip
        else:
            choices = []
            for p, prompt in enumerate(body["prompt"]):
                for j in range(n):
                    text, reason = finish(f"{prompt}#{j}" if j else f"{prompt}#{j} and more words")
                    index = j if OpenAIHandler.index_per_prompt else p * n + j
                    choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                                    "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                                    "prompt_token_ids": None})  # fmt: skip
            response = {"id": "cmpl-1", "object": "text_completion", "created": 1767225600, "model": body["model"],
                        "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": usage,
                        "kv_transfer_params": None}  # fmt: skip
        random.Random(0).shuffle(response["choices"])  # vLLM streams choices as they finish
        data = json.dumps(response).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    OpenAIHandler.requests = []
    OpenAIHandler.no_content = {}
    OpenAIHandler.index_per_prompt = False
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), OpenAIHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_generate_openai_completions_and_chat(endpoint: str) -> None:
    groups = generate_openai(endpoint, "qwen", ["p0", "p1", "p2"], 4, api_key="k", temperature=0.7, max_tokens=8)
    assert groups == [[f"p{p}#{j}" + (" and more words" if j == 0 else "") for j in range(4)] for p in range(3)]
    sent = OpenAIHandler.requests[0]
    assert sent["path"] == "/v1/completions" and sent["auth"] == "Bearer k"
    assert (sent["model"], sent["prompt"], sent["n"], sent["temperature"], sent["max_tokens"]) == (
        "qwen", ["p0", "p1", "p2"], 4, 0.7, 8,
    )  # fmt: skip
    chats = generate_openai(endpoint, "qwen", [[{"role": "user", "content": "x"}]], 2, chat=True, max_tokens=8)
    assert chats == [["x#0", "x#1"]] and OpenAIHandler.requests[1]["path"] == "/v1/chat/completions"


def test_rollout_and_report_against_a_real_server(client: bots_client.Client, exp_name: str, endpoint: str) -> None:
    client.create_experiment(exp_name, dataclasses.replace(EXACT, rollouts_per_task=3))
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    prompts = {"t0": "2*2=", "t1": "3*3=", "t2": "4*4="}

    def generate(texts: list[str], n: int) -> list[list[str]]:
        # a "model" that answers t0 right twice, t1 always, t2 never
        table = {"2*2=": ["4", "4", "5"], "3*3=": ["9"] * 3, "4*4=": ["0"] * 3}
        return [table[t][:n] for t in texts]

    rollouts, result = rollout_and_report(client, exp_name, batch, prompts, 3, verifier, generate=generate)
    assert rollouts.keys == batch.keys and result.step == 1
    expected = {"t0": (2.0, 1.0), "t1": (3.0, 0.0), "t2": (0.0, 3.0)}
    got = counts(client, exp_name)
    assert {k: got[k] for k in batch.keys} == {k: expected[k] for k in batch.keys}
    # The endpoint path end to end (the fake server echoes, so every sample fails).
    r = rollout({"t0": "2*2="}, 2, verifier, endpoint=endpoint, model="m", max_tokens=64)
    assert r.outcomes == {"t0": (0.0, 2)}
    with pytest.raises(TypeError, match="exactly one"):
        rollout({"t0": "x"}, 2, verifier)
    with pytest.raises(KeyError, match="no prompt"):
        rollout_and_report(client, exp_name, batch, {}, 2, verifier, generate=generate)


def test_an_experiment_of_another_group_size_is_refused_before_rolling_out(
    client: bots_client.Client, exp_name: str
) -> None:
    """rollouts_per_task = 16 against n = 2: refused with both named, before
    anything is generated or reported."""
    client.create_experiment(exp_name, EXACT)
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    calls: list[list[str]] = []

    def generate(texts: list[str], n: int) -> list[list[str]]:
        calls.append(texts)
        return [["4"] * n for _ in texts]

    with pytest.raises(GroupSizeMismatchError, match="rollouts_per_task = 16 but the trainer runs n = 2"):
        rollout_and_report(client, exp_name, batch, dict.fromkeys(ANSWERS, "x"), 2, verifier, generate=generate)
    assert calls == [] and client.get_experiment(exp_name).step == 0


def test_a_curriculums_batch_is_reported_through_its_curriculum(
    client: bots_client.Client, exp_name: str
) -> None:
    """Reported past its Curriculum, a batch would stay open there and its
    checkpoint would list it as unreported with no acknowledged step: a
    resume would then skip the batch in flight. Refused before anything is
    rolled out."""
    from bots_client.integrations import Curriculum

    curriculum = Curriculum(client, exp_name, ["t0", "t1", "t2"], batch_size=2, config=bots_client.ExperimentConfig())
    batch = curriculum.select(0)
    calls: list[list[str]] = []

    def generate(texts: list[str], n: int) -> list[list[str]]:
        calls.append(texts)
        return [["4"] * n for _ in texts]

    with pytest.raises(TypeError, match="curriculum.report"):
        rollout_and_report(client, exp_name, batch, {"t0": "2*2=", "t1": "3*3=", "t2": "4*4="}, 2, verifier,
                           generate=generate)  # fmt: skip
    assert calls == [] and client.get_experiment(exp_name).step == 0
    rollouts = rollout(dict.fromkeys(batch.keys, "2*2="), 2, verifier, generate=generate)
    curriculum.report(rollouts.outcomes, batch=batch)
    assert curriculum.resume_state(1)["pending"] == [] and client.get_experiment(exp_name).step == 1


def test_max_tokens_is_required_and_truncation_is_logged(
    endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM's default of 16 tokens would cut every rollout: no default here.
    for call in (
        lambda: generate_openai(endpoint, "m", ["p"], 2),
        lambda: rollout({"t0": "p"}, 2, verifier, endpoint=endpoint, model="m"),
        lambda: generate_llm(FakeLLM(), ["p"], 2),
    ):
        with pytest.raises(TypeError, match="max_tokens"):
            call()
    assert OpenAIHandler.requests == []  # refused before any request
    caplog.set_level(logging.WARNING, "bots_client.integrations.vllm")
    groups = generate_openai(endpoint, "m", ["a b c"], 3, max_tokens=2)  # sample 0 runs long
    assert groups == [["a b", "a b", "a b"]]
    assert "3 of 3 completions stopped at max_tokens = 2" in caplog.text


def test_the_official_openai_client_against_vllms_response_schema(
    client: bots_client.Client, exp_name: str, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    openai = need("openai")
    api = openai.OpenAI(base_url=endpoint, api_key="secret", max_retries=0)
    groups = generate_openai(None, "qwen", ["p0", "p1"], 3, openai_client=api, max_tokens=3, temperature=1.0)
    assert groups == [[f"p{p}#0 and more", f"p{p}#1", f"p{p}#2"] for p in range(2)]
    sent = OpenAIHandler.requests[-1]
    assert sent["path"] == "/v1/completions" and sent["auth"] == "Bearer secret"
    assert (sent["prompt"], sent["n"], sent["max_tokens"]) == (["p0", "p1"], 3, 3)
    assert "2 of 6 completions stopped at max_tokens = 3" in caplog.text
    chats = generate_openai(None, "qwen", [[{"role": "user", "content": "x"}]], 2, chat=True, openai_client=api,
                            max_tokens=8, extra_body={"top_k": 20})  # fmt: skip
    assert chats == [["x#0", "x#1"]]
    assert OpenAIHandler.requests[-1]["path"] == "/v1/chat/completions" and OpenAIHandler.requests[-1]["top_k"] == 20

    # Through rollout_and_report, against a real BOTS server.
    client.create_experiment(exp_name, EXACT_2)
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    prompts = {"t0": "4", "t1": "9", "t2": "16"}  # the echoing server "answers" "<prompt>#<sample>"
    rollouts, result = rollout_and_report(
        client, exp_name, batch, prompts, 2, lambda k, p, c: c.startswith(ANSWERS[k]), openai_client=api, model="qwen",
        max_tokens=1,
    )  # fmt: skip
    assert result.step == 1 and rollouts.outcomes == dict.fromkeys(batch.keys, (2.0, 2))


def test_caller_sampling_params_must_agree_with_n_and_max_tokens(
    client: bots_client.Client, exp_name: str, endpoint: str
) -> None:
    client.create_experiment(exp_name, EXACT_2)
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    prompts = {k: f"{k}?" for k in ANSWERS}
    llm = FakeLLM()
    # The caller's SamplingParams used to win silently over max_tokens=1024.
    short = SimpleNamespace(n=2, max_tokens=16, temperature=0.7)
    with pytest.raises(ValueError, match=r"sampling_params.max_tokens = 16 but max_tokens=1024"):
        rollout_and_report(client, exp_name, batch, prompts, 2, verifier, llm=llm, sampling_params=short,
                           max_tokens=1024)  # fmt: skip
    with pytest.raises(ValueError, match=r"sampling_params.temperature = 0.7 but temperature=1.0"):
        rollout(prompts, 2, verifier, llm=llm, sampling_params=short, temperature=1.0)
    with pytest.raises(ValueError, match=r"sampling_params.n = 1 but n = 2: n is the group size"):
        rollout(prompts, 2, verifier, llm=llm, sampling_params=SimpleNamespace(n=1, max_tokens=1024))
    assert llm.calls == []
    # Agreeing (or no keywords): the caller's object goes to vLLM as it is.
    params = SimpleNamespace(n=2, max_tokens=1024, temperature=0.7)
    r = rollout(prompts, 2, verifier, llm=llm, sampling_params=params, max_tokens=1024)
    assert llm.calls[-1][2] is params and r.outcomes == dict.fromkeys(ANSWERS, (0.0, 2))
    # The endpoint path: extra_body must not contradict n or the keywords, and
    # a SamplingParams there (once silently ignored) is refused.
    for extra, message in (({"max_tokens": 16}, r"extra_body\['max_tokens'\] = 16 but max_tokens=1024"),
                           ({"n": 4}, r"extra_body\['n'\] = 4 but n=2")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            rollout(prompts, 2, verifier, endpoint=endpoint, model="m", max_tokens=1024, extra_body=extra)
    with pytest.raises(ValueError, match="max_completion_tokens = 16 but max_tokens=1024"):
        rollout(prompts, 2, verifier, endpoint=endpoint, model="m", chat=True, max_tokens=1024,
                max_completion_tokens=16)  # fmt: skip
    with pytest.raises(TypeError, match="sampling_params= is used with llm= only"):
        rollout(prompts, 2, verifier, endpoint=endpoint, model="m", sampling_params=params, max_tokens=1024)
    assert OpenAIHandler.requests == []  # refused before any request
    # extra_body reaches the server through urllib too (flattened, as the openai client sends it).
    rollout({"t0": "p"}, 2, verifier, endpoint=endpoint, model="m", max_tokens=8, extra_body={"top_k": 20})
    assert OpenAIHandler.requests[-1]["top_k"] == 20 and "extra_body" not in OpenAIHandler.requests[-1]
    assert counts(client, exp_name) == dict.fromkeys(ANSWERS, (0.0, 0.0))  # nothing was reported


def test_chat_completion_without_content_raises_unless_scored(
    client: bots_client.Client, exp_name: str, endpoint: str
) -> None:
    conversations = {k: [{"role": "user", "content": ANSWERS[k]}] for k in ANSWERS}  # echoed: "<answer>#<sample>"

    def starts_right(key: str, prompt: Any, completion: str) -> bool:
        return completion.startswith(ANSWERS[key])

    OpenAIHandler.no_content = {1: "tool_calls"}
    with pytest.raises(EmptyCompletionError, match=r"task 't0': chat completion choice 1 has no content "
                       r"\(finish_reason 'tool_calls'; it holds tool_calls\).*on_empty=\"score\""):  # fmt: skip
        rollout(conversations, 2, starts_right, endpoint=endpoint, model="m", chat=True, max_tokens=8)
    OpenAIHandler.no_content = {0: "reasoning"}
    with pytest.raises(EmptyCompletionError, match=r"prompt 0: chat .* 0 .*'length'; it holds reasoning"):
        generate_openai(endpoint, "m", [conversations["t0"]], 2, chat=True, max_tokens=8)
    # Lenient: verified as "" (a failure here) and counted in the result.
    client.create_experiment(exp_name, EXACT_2)
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    rollouts, result = rollout_and_report(client, exp_name, batch, conversations, 2, starts_right, endpoint=endpoint,
                                          model="m", chat=True, max_tokens=8, on_empty="score")  # fmt: skip
    assert rollouts.empty == 2 and [g[0] for g in rollouts.completions] == ["", ""]
    assert rollouts.outcomes == dict.fromkeys(batch.keys, (1.0, 2)) and result.step == 1
    with pytest.raises(ValueError, match="on_empty must be"):
        rollout(conversations, 2, starts_right, endpoint=endpoint, model="m", chat=True, max_tokens=8, on_empty="skip")
    # A generate= callable's None is held to the same rule.
    with pytest.raises(EmptyCompletionError, match="task 't1': generate's sample 1 has no content"):
        rollout({"t1": "3*3="}, 2, verifier, generate=lambda texts, n: [["9", None] for _ in texts])
    lenient = rollout({"t1": "3*3="}, 2, verifier, generate=lambda texts, n: [["9", None]], on_empty="score")
    assert (lenient.empty, lenient.outcomes) == (1, {"t1": (1.0, 2)})
    # Through the official openai client as well.
    openai = need("openai")
    api = openai.OpenAI(base_url=endpoint, api_key="k", max_retries=0)
    OpenAIHandler.no_content = {1: "tool_calls"}
    with pytest.raises(EmptyCompletionError, match="task 't2': chat completion choice 1 has no content"):
        rollout({"t2": conversations["t2"]}, 2, starts_right, openai_client=api, model="m", chat=True, max_tokens=8)


def test_generate_must_return_one_group_of_n_per_prompt(
    client: bots_client.Client, exp_name: str, endpoint: str
) -> None:
    client.create_experiment(exp_name, EXACT_2)
    client.add_tasks(exp_name, [bots_client.Task(k) for k in ANSWERS])
    batch = client.select_batch(exp_name, batch_size=2, request_key="step-0")
    prompts = {k: f"{k}?" for k in ANSWERS}
    first, second = batch.keys
    # Trials 1 and 3 for n = 2: the right total, the wrong groups.
    uneven = {first: ["x"], second: ["x", "x", "x"]}
    with pytest.raises(ValueError, match=rf"task {first!r}: got 1 completions, expected n = 2"):
        rollout_and_report(client, exp_name, batch, prompts, 2, verifier,
                           generate=lambda texts, n: [uneven[k] for k in batch.keys])  # fmt: skip
    with pytest.raises(ValueError, match="generate returned 1 groups for 2 prompts"):
        rollout_and_report(client, exp_name, batch, prompts, 2, verifier, generate=lambda texts, n: [["x", "x"]])
    with pytest.raises(TypeError, match="generate returned a str"):
        rollout_and_report(client, exp_name, batch, prompts, 2, verifier, generate=lambda texts, n: ["xx", "xx"])
    with pytest.raises(TypeError, match="generate= takes no sampling parameters"):
        rollout_and_report(client, exp_name, batch, prompts, 2, verifier,
                           generate=lambda texts, n: [["x"] * n for _ in texts], max_tokens=64)  # fmt: skip
    assert counts(client, exp_name) == dict.fromkeys(ANSWERS, (0.0, 0.0))  # nothing was reported
    # score and group_flat hold the same line.
    with pytest.raises(ValueError, match=r"task 't1': got 3 completions, expected n = 2"):
        score(["t0", "t1"], ["a", "b"], [["4", "4"], ["9", "9", "9"]], verifier, n=2)
    with pytest.raises(ValueError, match=r"task 't1': got 0 completions, expected at least one"):
        score(["t0", "t1"], ["a", "b"], [["4"], []], verifier)
    with pytest.raises(ValueError, match="one group of completions per task"):
        score(["t0", "t1"], ["a", "b"], [["4", "4"]], verifier, n=2)
    with pytest.raises(ValueError, match="5 completions are not a whole number of groups of n = 2"):
        group_flat(["4"] * 5, 2)
    # A server numbering choices per prompt would leave groups half empty.
    OpenAIHandler.index_per_prompt = True
    with pytest.raises(RuntimeError, match=r"numbered choices \[0, 0, 1, 1\], expected each of 0..3 once"):
        generate_openai(endpoint, "m", ["a", "b"], 2, max_tokens=8)
