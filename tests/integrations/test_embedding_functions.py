"""The embedding functions of docs/embeddings.md, run as the page prints
them on small random-weight transformers models built in code (no model
hub), and an adapter that embeds its tasks with one against a real server:
the vectors the server keeps are the function's, bit for bit."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import bots_client
from bots_client.integrations._core import Curriculum, embed_function
from tests.integrations.conftest import need

torch = need("torch")
need("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "embeddings.md"
PROMPTS = [f"solve task {i}" for i in range(10)] + ["solve", "task 3 solve task 4 solve task 5"]


def doc_functions() -> dict[str, Any]:
    """The page's python blocks, run in one namespace."""
    namespace: dict[str, Any] = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        if "def " in block:  # the functions; the usage lines name a server and a dataset
            exec(compile(block, str(DOC), "exec"), namespace)
    return namespace


def _word_tokenizer(padding_side: str) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", "[CLS]", "solve", "task"] + [str(i) for i in range(10)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]", padding_side=padding_side
    )


def tiny_policy() -> tuple[Any, Any]:
    """A GPT-2 of random weights (the trainer's policy stand-in), left-padded as for generation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    tokenizer = _word_tokenizer("left")
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=2, n_head=2, pad_token_id=0)
    return GPT2LMHeadModel(config).eval(), tokenizer


def tiny_encoder() -> tuple[Any, Any]:
    """A BERT of random weights (a sentence encoder's stand-in), right-padded."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    tokenizer = _word_tokenizer("right")
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, pad_token_id=0,
    )  # fmt: skip
    return BertModel(config).eval(), tokenizer


def test_the_policy_s_mean_hidden_state_gives_one_finite_vector_per_prompt() -> None:
    model, tokenizer = tiny_policy()
    embed = doc_functions()["mean_hidden_state"](model, tokenizer)
    vectors = embed(PROMPTS)
    assert vectors.shape == (len(PROMPTS), model.config.n_embd) and vectors.dtype == np.float32
    assert np.isfinite(vectors).all()
    np.testing.assert_array_equal(embed(PROMPTS), vectors)  # deterministic (eval mode, no sampling)
    # The mean over the prompt's tokens, padding left out: by hand, one prompt at a time.
    for i in (0, len(PROMPTS) - 1):
        ids = tokenizer(PROMPTS[i], return_tensors="pt")
        with torch.no_grad():
            hidden = model(**ids, output_hidden_states=True).hidden_states[-1][0]
        alone = hidden.mean(dim=0).numpy()
        np.testing.assert_allclose(embed([PROMPTS[i]])[0], alone, rtol=1e-5, atol=1e-6)
    assert len({v.tobytes() for v in vectors}) == len(PROMPTS)  # different prompts, different vectors


def test_the_text_encoder_gives_unit_vectors_that_padding_does_not_change() -> None:
    model, tokenizer = tiny_encoder()
    embed = doc_functions()["text_encoder"](model, tokenizer)
    vectors = embed(PROMPTS)
    assert vectors.shape == (len(PROMPTS), model.config.hidden_size) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    # Right padding with a mask: a prompt embedded alone or beside a longer one alike.
    alone = np.stack([embed([p])[0] for p in PROMPTS])
    np.testing.assert_allclose(vectors, alone, rtol=1e-4, atol=1e-5)


def test_an_adapter_embeds_its_tasks_with_the_policy(client: bots_client.Client, exp_name: str) -> None:
    """TRL's BotsGRPO with embed_fn: the server holds, for each task, the
    vector the function gives its prompt."""
    need("trl")
    from bots_client.integrations.trl import BotsGRPO

    model, tokenizer = tiny_policy()
    embed = doc_functions()["mean_hidden_state"](model, tokenizer)
    dataset = {"task_key": [f"k{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS}
    config = bots_client.ExperimentConfig(embedding_dim=model.config.n_embd)
    bots = BotsGRPO(client, exp_name, dataset=dataset, embed_fn=embed, embed_column="prompt", config=config)
    bots.curriculum.ensure_ready()
    snap = client.snapshot(exp_name, include_features=True)
    assert snap.keys == dataset["task_key"]
    assert snap.embeddings is not None
    np.testing.assert_array_equal(snap.embeddings, embed(PROMPTS))  # blocks or one call: the same vectors


def test_a_curriculum_takes_an_embedding_function_by_name(client: bots_client.Client, exp_name: str) -> None:
    """A config file names the function as module:function; the block size
    does not change the vectors; a function that gives the wrong number of
    vectors is refused before anything is added."""
    module = types.ModuleType("bots_test_embedder")

    def lengths(items: Sequence[Any]) -> list[list[float]]:
        return [[float(len(str(x))), float(str(x).count(" ")), 1.0] for x in items]

    module.lengths = lengths  # type: ignore[attr-defined]
    module.too_few = lambda items: lengths(items)[:-1]  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        assert embed_function("bots_test_embedder:lengths") is lengths
        with pytest.raises(ValueError, match="has no function 'missing'"):
            embed_function("bots_test_embedder:missing")
        config = bots_client.ExperimentConfig(embedding_dim=3)
        keys = [f"k{i}" for i in range(150)]  # more than one block of inputs
        prompts = [f"prompt {'x ' * (i % 7)}{i}" for i in range(150)]
        cur = Curriculum(
            client, exp_name, keys, batch_size=4, config=config,
            embed_fn="bots_test_embedder:lengths", embed_inputs=prompts,
        )  # fmt: skip
        cur.ensure_ready()
        snap = client.snapshot(exp_name, include_features=True)
        assert snap.embeddings is not None
        np.testing.assert_array_equal(snap.embeddings, np.asarray(lengths(prompts), dtype=np.float32))
        broken = Curriculum(client, f"{exp_name}-b", keys, batch_size=4, config=config, embed_fn=module.too_few)
        with pytest.raises(ValueError, match="one vector per input"):
            broken.ensure_ready()
        assert client.get_experiment(f"{exp_name}-b").num_tasks == 0
    finally:
        del sys.modules[module.__name__]
