"""Gemma 3 (``ModelConfig`` arch "gemma3"): a GGUF of it loads (names, metadata, norms as 1 + w) to the same
model as its HF folder; the sliding layers' windows hold past the window in generation, speculation and
the continuous batcher; its chat format; clear errors for what it does not support.  The HF equality of
the exact mode is in ``test_model.py``, the fast block's in ``test_fast.py`` (both parametrized on it)."""

from __future__ import annotations

import dataclasses
import random

import jinja2
import pytest
import torch

from specdraft.batch import Batcher
from specdraft.drafters.ngram import NgramDrafter
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.model.config import ModelConfig
from specdraft.model.gguf_write import write_gguf
from specdraft.model.llama import causal_mask
from specdraft.model.load import build_model, load_hf_folder, load_weights
from specdraft.model.tokenizer import GEMMA_CHAT_TEMPLATE
from specdraft.target import Target

from conftest import TINY, make_tiny_hf
from test_batch import OracleDrafter, prompts, run_batch, twin
from test_speculative_greedy import RandomTreeDrafter


@pytest.fixture(scope="module")
def gemma_folder(tmp_path_factory):
    """A tiny Gemma 3 whose attention scale a GGUF can state (1/sqrt(head size)); window 4.  Its LM head is
    its own (tied, the random model's embedding times sqrt(H) makes it repeat its input token)."""
    path = tmp_path_factory.mktemp("tiny_gemma3")
    TINY["gemma3_gguf"] = dict(TINY["gemma3"], query_pre_attn_scalar=TINY["gemma3"]["head_dim"], tie_word_embeddings=False)
    try:
        make_tiny_hf("gemma3_gguf", path)
    finally:
        del TINY["gemma3_gguf"]
    return path


@pytest.fixture(scope="module")
def gemma_fast(gemma_folder) -> Target:
    w = load_hf_folder(gemma_folder)
    t = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    assert t.precision == "fast" and t.config.sliding_window == 4
    return t


def test_a_gemma3_gguf_loads_to_the_model_of_its_hf_folder(gemma_folder, tmp_path):
    """Written as a GGUF (F32: the same values; the norms as the 1 + w Gemma scales by, no q/k row
    permutation, the window pattern and local RoPE base in the metadata), it loads to the same config and
    the exact mode gives the HF folder's logits bit for bit; in Q8_0 it runs in the fast mode."""
    hf_w = load_hf_folder(gemma_folder)
    write_gguf(tmp_path / "f32.gguf", hf_w.config, hf_w.state_dict, lambda n, t: "F32")
    g_w = load_weights(str(tmp_path / "f32.gguf"))
    for field in ("arch", "layer_types", "sliding_window", "rope_theta", "rope_local_theta", "activation",
                  "embed_scale", "sandwich_norms", "qk_norm", "query_scale", "tie_embeddings", "head_dim"):
        assert getattr(g_w.config, field) == getattr(hf_w.config, field), field
    ids = torch.tensor([[2, 5, 17, 33, 9, 91, 40, 8, 61, 12]])
    n = ids.shape[1]
    logits = [build_model(w, precision="exact")(ids, torch.arange(n)[None], causal_mask(n, 0),
                                                 build_model(w, precision="exact").new_cache(1, n), 0).logits
              for w in (hf_w, g_w)]
    assert torch.equal(*logits)
    write_gguf(tmp_path / "q8.gguf", hf_w.config, hf_w.state_dict, lambda n, t: "Q8_0")
    assert build_model(load_weights(str(tmp_path / "q8.gguf")), precision="fast").precision == "fast"


def test_windows_hold_past_the_window(gemma_fast, gemma_folder):
    """Sequences many times the window (4) long: speculative greedy (random trees, prompt lookup) equals
    plain greedy, and the tokens differ from a model that attends globally everywhere (the window acts).
    The answers are not one repeated token (the drafters' trees are accepted in part)."""
    cfg = GenerateConfig(max_new_tokens=40)
    for seed in range(3):
        prompt = [random.Random(seed).randrange(3, 96) for _ in range(9)]
        ref = generate(gemma_fast, prompt, None, cfg).token_ids
        assert len(set(ref)) > 5
        assert generate(gemma_fast, prompt, RandomTreeDrafter(seed, 96, ref, 3, 5, 12), cfg).token_ids == ref
        assert generate(gemma_fast, prompt, NgramDrafter(), cfg).token_ids == ref
    w = load_hf_folder(gemma_folder)
    w.config = dataclasses.replace(w.config, sliding_window=None, layer_types=None)  # every layer global
    unwindowed = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    assert generate(unwindowed, prompt, None, cfg).token_ids != ref


def test_the_batcher_keeps_each_answer_past_the_window(gemma_fast):
    """In the continuous batcher a sequence's slots are not its positions (several sequences share one
    cache): the windows follow the key positions it passes, and every answer equals offline generate."""
    ps = prompts((3, 21, 9, 14))
    cfgs = [GenerateConfig(max_new_tokens=n) for n in (24, 12, 30, 18)]
    refs = [Engine(twin(gemma_fast)).generate(p, c).token_ids for p, c in zip(ps, cfgs)]
    engine = Engine(twin(gemma_fast), OracleDrafter({tuple(p): r for p, r in zip(ps, refs)}))
    seqs = run_batch(Batcher(engine, max_batch=3, prefill_rows=8), list(zip(ps, cfgs)))
    assert all(s.error is None for s in seqs), [s.error for s in seqs]
    got = {tuple(s.prompt_ids): s.result.token_ids for s in seqs}
    assert [got[tuple(p)] for p in ps] == refs


def test_the_gemma_chat_format():
    """The template used where a Gemma GGUF has none: BOS, system text opening the first user turn, each
    turn closed by <end_of_turn>, the prompt ending with the model's turn."""
    env = jinja2.Environment()
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A colour?"}]
    text = env.from_string(GEMMA_CHAT_TEMPLATE).render(messages=messages, bos_token="<bos>", add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nA colour?<end_of_turn>\n<start_of_turn>model\n")


def test_what_gemma_support_leaves_out_is_refused_clearly():
    base = dict(TINY["gemma3"])
    with pytest.raises(SpecdraftError, match="final_logit_softcapping"):
        ModelConfig.from_hf(dict(base, final_logit_softcapping=30.0))
    with pytest.raises(SpecdraftError, match="hidden_activation"):
        ModelConfig.from_hf(dict(base, hidden_activation="relu"))
    with pytest.raises(SpecdraftError, match="layer_types"):
        ModelConfig.from_hf(dict(base, layer_types=["sliding_attention"]))
    with pytest.raises(SpecdraftError, match="rope scaling 'linear'"):
        ModelConfig.from_hf(dict(base, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0}}))
