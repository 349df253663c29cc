"""Shared fixtures: tiny random-weight HF models for most tests, the real default target for a few.

No test reads the user's ``~/.cache/specdraft`` (stored cost curves would change drafters' default
budgets): the whole session uses a fresh cache folder, and any global torch setting a test changes
is restored after it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ["SPECDRAFT_CACHE"] = tempfile.mkdtemp(prefix="specdraft-test-cache-")  # before anything reads it
atexit.register(shutil.rmtree, os.environ["SPECDRAFT_CACHE"], ignore_errors=True)

from specdraft.model.load import LoadedWeights, build_model, load_hf_folder
from specdraft.target import Target

REAL_MODEL = {"default_weights", "default_target", "exact_target", "default_hf"}


def pytest_collection_modifyitems(items):
    """Every test that loads the real default model is marked ``slow`` (they stay in CI; ``-m "not
    slow"`` runs the rest in a few minutes)."""
    for item in items:
        if REAL_MODEL & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def restore_torch_globals():
    """Threads, the default dtype and grad mode are as they were after every test."""
    threads, dtype, grad = torch.get_num_threads(), torch.get_default_dtype(), torch.is_grad_enabled()
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(grad)


TINY = {
    "llama256": dict(model_type="llama", vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
                     tie_word_embeddings=False, eos_token_id=1, bos_token_id=0),  # rows of 256: the K-quants fit
    "llama": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                  tie_word_embeddings=False, eos_token_id=1, bos_token_id=0),
    "qwen2": dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                  tie_word_embeddings=True, eos_token_id=1, bos_token_id=0),
    "qwen3": dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0),
    "llama_d8": dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, rope_theta=10000.0,
                     tie_word_embeddings=False, eos_token_id=1, bos_token_id=0),  # heads of 8: not in the fast block
    # Gemma 3: a window of 4 (the tests' sequences run past it), the middle layer global, each layer type with
    # its own RoPE base, an attention scale other than 1/sqrt(head size)
    "gemma3": dict(model_type="gemma3_text", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   query_pre_attn_scalar=48, tie_word_embeddings=True, eos_token_id=1, bos_token_id=2,
                   pad_token_id=0),
}
for _d in (48, 80, 96, 128, 256):  # head sizes the vector attention takes in parts (64 dims at a time, then the rest)
    TINY[f"qwen3_d{_d}"] = dict(TINY["qwen3"], num_attention_heads=2, num_key_value_heads=1, head_dim=_d)


def make_tiny_hf(arch: str, path, seed: int = 0, scale: float = 1.0):
    """A random HF model saved as safetensors in ``path``; ``scale`` sharpens its distributions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY[arch]), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02 * scale * 10)
            elif TINY[arch]["model_type"] == "gemma3_text":  # its norms scale by 1 + w, w = 0 at init: make w matter
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_target(path) -> Target:
    w = load_hf_folder(path)
    return Target(build_model(w), tokenizer=None, name=w.name, weight_hash=w.weight_hash)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    hf = make_tiny_hf("llama", path)
    return hf, tiny_target(path), path


@pytest.fixture(scope="session")
def default_weights() -> LoadedWeights:
    from specdraft.model.load import load_weights

    return load_weights("default")


@pytest.fixture(scope="session")
def default_target(default_weights) -> Target:
    target = Target.from_weights(default_weights)  # the default precision mode, "fast"
    # the measured floors and exact supports of the real-model tests were taken on the fast kernels
    assert target.precision == "fast", ("the CPU kernels are unavailable (no compiler / ninja, or "
                                        "SPECDRAFT_QUANT=0): the real-model tests need them")
    return target


@pytest.fixture(scope="session")
def exact_target(default_weights) -> Target:
    """The default target in the exact precision mode (fp32 activations; the default is "fast")."""
    target = Target.from_weights(default_weights, precision="exact")
    assert target.precision == "exact" and target.model.quantized_rows > 0
    return target


@pytest.fixture(scope="session")
def default_hf(default_weights):
    from specdraft.bench.hf import build_hf_model

    return build_hf_model(default_weights)


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory, default_weights):
    """A tiny random model over the real SmolLM2 vocabulary, saved as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_chat")
    cfg = dict(TINY["llama"], vocab_size=default_weights.config.vocab_size, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_chat_target(tiny_chat_folder, default_weights):
    """The tiny chat model with the real tokenizer and chat template (exact mode)."""
    from specdraft.model.load import load_tokenizer

    w = load_hf_folder(tiny_chat_folder)
    return Target(build_model(w), tokenizer=load_tokenizer(default_weights), name="tiny-chat", weight_hash=w.weight_hash)


@pytest.fixture(scope="session")
def tiny_chat_fast(tiny_chat_folder, default_weights):
    """The tiny chat model in the fast precision mode (its weights rounded to Q8_0 blocks): batching needs it."""
    from specdraft.model.load import load_tokenizer

    w = load_hf_folder(tiny_chat_folder)
    t = Target(build_model(w, precision="fast"), tokenizer=load_tokenizer(default_weights), name="tiny-chat",
               weight_hash=w.weight_hash)
    assert t.precision == "fast"
    return t


TRAIN_PROMPTS = ["What is 17 * 23? Think step by step.", "Write a Python function that reverses a string.",
                 "Tell me about the United States of America.", "List three colours.",
                 "Explain recursion in one sentence.", "What is the capital of France?"]


@pytest.fixture(scope="session")
def tiny_train_data(tiny_chat_target, tmp_path_factory):
    """Training data of the tiny chat target on real prompts (responses, and features of layers 0, 1,
    2 and final), shared read-only by the hybrid, eagle3 and block trainer tests."""
    from specdraft.model.llama import FINAL
    from specdraft.train import data as D
    from specdraft.train.prompts import Prompt

    root = tmp_path_factory.mktemp("train_data")
    prompts = [Prompt(id=i, source="gsm", text=f"{t} (variant {i})") for i, t in enumerate(TRAIN_PROMPTS * 2)]
    cfg = D.BuildConfig(n_prompts=len(prompts), max_new_tokens=32, batch_size=6, shard_size=5, sources=("gsm",))
    D.build_data(tiny_chat_target, root / "data", cfg, quiet=True, prompts=prompts)
    D.cache_features(tiny_chat_target, root / "data", root / "feat", (0, 1, 2, FINAL), quiet=True)
    return root


@pytest.fixture(scope="session")
def tiny_more_data(tiny_chat_target, tmp_path_factory):
    """A second, smaller data folder of the tiny chat target (5 poem prompts none of ``tiny_train_data``'s;
    features of layer 1 and final): for training on several --data folders."""
    from specdraft.model.llama import FINAL
    from specdraft.train import data as D
    from specdraft.train.prompts import Prompt

    root = tmp_path_factory.mktemp("more_data")
    prompts = [Prompt(id=i, source="magpie", text=f"Write a short poem about the number {i}.") for i in range(5)]
    D.build_data(tiny_chat_target, root / "data", D.BuildConfig(n_prompts=5, max_new_tokens=24, batch_size=5,
                                                                shard_size=5, sources=("magpie",)),
                 quiet=True, prompts=prompts)
    D.cache_features(tiny_chat_target, root / "data", root / "feat", (1, FINAL), quiet=True)
    return root
