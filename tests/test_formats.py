"""Every block format the fast kernel reads, through a whole model: a tiny random Llama written as a
GGUF in each format (and in a Q4_K_M-like mix) by the project's own block quantizer and writer loads
in the fast mode, gives tree == sequential logits bit for bit and speculative greedy == plain greedy
for ngram and a random hybrid drafter; a block type the kernel cannot read falls back to the exact
mode with one warning naming the tensor and its type."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from specdraft.drafters.hybrid import HybridDrafter, HybridOptions
from specdraft.drafters.ngram import NgramDrafter
from specdraft.generate import GenerateConfig, generate
from specdraft.model import blocks
from specdraft.model.gguf_write import write_gguf
from specdraft.model.load import build_model, load_hf_folder, load_weights
from specdraft.target import Target

from conftest import make_tiny_hf
from test_fast import assert_tree_equals_sequential
from test_hybrid import _random_model
from test_speculative_greedy import RandomTreeDrafter


def q4_k_m_like(name: str, t: torch.Tensor) -> str:
    """llama.cpp's Q4_K_M recipe in spirit: Q6_K for v and down, Q4_K elsewhere, the embedding in Q8_0."""
    if "embed_tokens" in name or "lm_head" in name:
        return "Q8_0"
    return "Q6_K" if ("v_proj" in name or "down_proj" in name) else "Q4_K"


MIXES = {kind: (lambda k: lambda name, t: k)(kind) for kind in blocks.FORMATS} | {"Q4_K_M-like": q4_k_m_like}


@pytest.fixture(scope="module")
def tiny_hf_weights(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama256")
    make_tiny_hf("llama256", path, scale=3.0)
    return load_hf_folder(path)


def _gguf_target(w, kind_of, path) -> Target:
    write_gguf(path, w.config, w.state_dict, kind_of)
    lw = load_weights(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        model = build_model(lw, precision="fast")
    return Target(model, tokenizer=None, name=lw.name, weight_hash=lw.weight_hash)


@pytest.mark.parametrize("mix", list(MIXES))
def test_each_format_decodes_losslessly_in_the_fast_mode(mix, tiny_hf_weights, tmp_path):
    t = _gguf_target(tiny_hf_weights, MIXES[mix], tmp_path / f"{mix}.gguf")
    assert t.precision == "fast"
    stored = {r.kind for r in load_weights(str(tmp_path / f"{mix}.gguf")).quantized.values()}
    assert stored == ({mix} if mix in blocks.FORMATS else {"Q4_K", "Q6_K", "Q8_0"})
    prompt = [5, 17, 3, 44, 9, 12, 80, 2]
    assert_tree_equals_sequential(t, prompt, sizes=(1, 2, 5, 16, 33, 64), seed=3, nodes_checked=3)
    cfg = GenerateConfig(max_new_tokens=32)
    hybrid = _random_model(t, 2, 2, vocab=64)
    for seed in range(2):
        ids = [random.Random(seed).randrange(2, 96) for _ in range(6)]
        ref = generate(t, ids, None, cfg).token_ids
        assert generate(t, ids, RandomTreeDrafter(seed, 96, ref, 4, 6, 24), cfg).token_ids == ref, mix
        assert generate(t, ids, NgramDrafter(), cfg).token_ids == ref, mix
        assert generate(t, ids, HybridDrafter(hybrid, HybridOptions(topk=3, beams=2)), cfg).token_ids == ref, mix


def test_an_unreadable_block_type_falls_back_to_exact_with_one_warning(tiny_hf_weights, tmp_path):
    """One projection stored as Q2_K (gguf-py dequantizes it; the fast kernel does not read it)."""
    w = tiny_hf_weights
    victim = "model.layers.1.mlp.down_proj.weight"
    rows, cols = w.state_dict[victim].shape
    path = tmp_path / "q2k.gguf"
    write_gguf(path, w.config, w.state_dict, lambda n, t: "Q8_0",
               stored={victim: ("Q2_K", np.zeros((rows, cols // 256 * 84), dtype=np.uint8))})
    lw = load_weights(str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(lw, precision=None)  # the default: fast where it can run
    assert model.precision == "exact"
    said = [str(c.message) for c in caught if "fast precision mode is unavailable" in str(c.message)]
    assert len(said) == 1 and "mlp.down_proj" in said[0] and "Q2_K" in said[0], said


def test_a_trained_drafter_on_another_quantization_of_its_target(default_target, default_weights, tmp_path):
    """The shipped drafters were trained on the default Q4_1 file.  The same model requantized (here to Q8_0
    by the project's writer, its tokenizer copied: another weight hash, the same model fingerprint) loads
    them with one note and stays lossless; another model (another fingerprint) is refused with a clear
    error unless asked with any_target=1 (one warning)."""
    import copy

    from specdraft.drafters import make_drafter
    from specdraft.errors import SpecdraftError, SpecdraftNote
    from specdraft.model.load import default_gguf_path

    path = tmp_path / "SmolLM2-135M-Instruct.Q8_0.gguf"
    write_gguf(path, default_weights.config, default_weights.state_dict, lambda n, t: "Q8_0",
               tokenizer_from=default_gguf_path())
    requantized = Target.from_weights(load_weights(str(path)))
    assert requantized.weight_hash != default_target.weight_hash
    assert requantized.model_hash == default_target.model_hash is not None
    with pytest.warns(SpecdraftNote, match="same model in another quantization") as said:
        d = make_drafter("phrase", requantized)
    assert len(said) == 1
    assert d.calibration.xs, "the shipped calibration applies to the same model"
    cfg = GenerateConfig(max_new_tokens=24)
    for prompt in ("What is 12 * 7?", "Write a Python function that reverses a list."):
        ids = requantized.encode_prompt(prompt)
        assert generate(requantized, ids, d, cfg).token_ids == generate(requantized, ids, None, cfg).token_ids

    other = copy.copy(default_target)
    other.weight_hash, other.model_hash = "0" * 64, "1" * 64
    with pytest.raises(SpecdraftError, match="another model .*train a drafter for this target"):
        make_drafter("phrase", other)
    assert make_drafter("auto", other).name == "ngram"  # auto falls back to prompt lookup
    with pytest.warns(UserWarning, match="any_target=1"):
        d = make_drafter("phrase@any_target=1", other)
    with pytest.raises(SpecdraftError, match="any_target must be 0 or 1"):
        make_drafter("phrase@any_target=yes", other)
    ids = other.encode_prompt("What is 12 * 7?")
    assert generate(other, ids, d, cfg).token_ids == generate(other, ids, None, cfg).token_ids


def test_the_model_fingerprint_tells_models_apart(tiny_hf_weights, tmp_path):
    """One model's fingerprint is the same in every block format and differs for another shape or
    vocabulary; a file without a vocabulary has none."""
    from specdraft.model.load import default_gguf_path, model_fingerprint

    w = tiny_hf_weights
    prints = set()
    for kind in ("Q8_0", "Q4_K"):
        write_gguf(tmp_path / f"{kind}.gguf", w.config, w.state_dict, lambda n, t, k=kind: k,
                   tokenizer_from=default_gguf_path())
        prints.add(load_weights(str(tmp_path / f"{kind}.gguf")).model_hash)
    assert len(prints) == 1 and None not in prints
    write_gguf(tmp_path / "none.gguf", w.config, w.state_dict, lambda n, t: "Q8_0")
    assert load_weights(str(tmp_path / "none.gguf")).model_hash is None
    tokens = [f"t{i}" for i in range(w.config.vocab_size)]
    base = model_fingerprint(w.config, tokens)
    assert model_fingerprint(w.config, tokens[::-1]) != base
    import dataclasses
    assert model_fingerprint(dataclasses.replace(w.config, intermediate_size=w.config.intermediate_size * 2), tokens) != base
    assert model_fingerprint(dataclasses.replace(w.config, activation="gelu_tanh"), tokens) != base  # a later field
    assert model_fingerprint(dataclasses.replace(w.config, max_position=w.config.max_position * 2), tokens) == base


@pytest.mark.parametrize("kind", blocks.FORMATS)
def test_the_quantizer_writes_valid_blocks_of_each_format(kind):
    """gguf-py reads our blocks back to the weights within the format's rounding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((24, 512)) * rng.uniform(0.1, 2, (24, 1))).astype(np.float32)
    raw = blocks.quantize(x, kind)
    back = np.asarray(dequantize(raw.data, GGMLQuantizationType[kind]), np.float32).reshape(x.shape)
    rms = float(np.sqrt(((back - x) ** 2).mean() / (x ** 2).mean()))
    bound = {"Q8_0": 0.01, "Q6_K": 0.03, "Q5_0": 0.06, "Q5_1": 0.06, "Q5_K": 0.06}.get(kind, 0.12)
    assert rms < bound, (kind, rms)  # measured: Q8_0 0.005, Q6_K 0.019, 5-bit 0.04, 4-bit 0.08
    assert np.array_equal(blocks.decode(raw).dequantize().numpy(), back)
