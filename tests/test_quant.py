"""Matmuls from a GGUF's quantized blocks (model/quant.py): the kernel against the fp32
dequantisation, the fused/permuted layers of the default target, and greedy output unchanged."""

from __future__ import annotations

import platform
import shutil

import numpy as np
import pytest
import torch

from specdraft.model import quant
from specdraft.model.quant import QuantWeight, RawQuant

# where the kernel is meant to build (x86-64 with a C++ compiler), failing to build it is a failure
CAN_BUILD = platform.machine().lower() in ("x86_64", "amd64") and shutil.which("c++") is not None
pytestmark = pytest.mark.skipif(not CAN_BUILD, reason="no x86-64 C++ toolchain for the quantized kernel")


def test_kernel_builds():
    assert quant.kernel_available()


def _random_blocks(kind: str, rows: int, cols: int, seed: int) -> RawQuant:
    rng = np.random.default_rng(seed)
    nb = cols // 32
    if kind == "Q4_1":
        d = (rng.random((rows, nb, 1)) * 0.02).astype(np.float16).view(np.uint8)
        m = (-rng.random((rows, nb, 1)) * 0.1).astype(np.float16).view(np.uint8)
        q = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
        blocks = np.concatenate([d, m, q], -1)
    else:
        d = (rng.random((rows, nb, 1)) * 0.01).astype(np.float16).view(np.uint8)
        q = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
        blocks = np.concatenate([d, q], -1)
    return RawQuant(kind, cols, blocks.reshape(rows, -1))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_kernel_equals_fp32_dequantised_matmul(kind):
    raw = _random_blocks(kind, 100, 192, seed=1)
    w = raw.dequantize()  # the fp32 weights gguf's own dequantisation gives
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(192, generator=g) + 0.5
    for m in (1, 3, 17):
        x = torch.randn(2, m, 192, generator=g)
        ref = x @ w.t()
        y = QuantWeight(raw)(x)
        assert y.shape == (2, m, 100)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(QuantWeight(raw, in_scale=scale)(x), (x * scale) @ w.t(), rtol=1e-5, atol=1e-5)
    # rows taken in another order stay whole blocks
    perm = np.random.default_rng(2).permutation(100)
    torch.testing.assert_close(QuantWeight(raw.take_rows(perm))(x), ref[..., perm], rtol=1e-5, atol=1e-5)


def test_default_target_uses_the_blocks_and_decodes_the_same(default_weights):
    from specdraft.drafters.base import NoDrafter
    from specdraft.generate import GenerateConfig, generate
    from specdraft.model.load import build_model, load_tokenizer
    from specdraft.target import Target

    fp32 = build_model(default_weights, quantized=False)
    q = build_model(default_weights)
    lins = [m for m in q.modules() if getattr(m, "quant", None) is not None]
    assert len(lins) == 4 * default_weights.config.num_layers + 1  # every projection and the LM head
    for name, p in fp32.named_parameters():  # the fp32 weights are untouched
        assert torch.equal(p, dict(q.named_parameters())[name])
    tok = load_tokenizer(default_weights)
    outs = []
    for model in (fp32, q):
        t = Target(model, tok, default_weights.name, default_weights.weight_hash)
        outs.append([generate(t, t.encode_prompt(p), NoDrafter(), GenerateConfig(max_new_tokens=40)).token_ids
                     for p in ("What is 12 * 7?", "Name three colours.")])
    assert outs[0] == outs[1]


def test_fused_blocks_match_the_python_blocks(exact_target, monkeypatch):
    """The one-op C++ decoder block computes what the Python block does (its norms sum in another
    order, so equal to fp32 rounding, not to the bit): prefill, a tree pass (mask) and the features
    drafters read agree, every node's argmax is the same, and the fused op really runs."""
    from specdraft.model import llama
    from specdraft.tree import Tree

    t = exact_target
    ids = t.encode_prompt("Write a Python function that checks whether a number is prime.")
    if len(ids) <= quant.QUANT_ROWS:
        ids = ids * 3
    fused_op = torch.ops.specdraft_quant.block

    def run(fused: bool):
        monkeypatch.setattr(llama, "FUSED_BLOCKS", fused)
        pre = t.prefill(ids, max_slots=len(ids) + 16, hidden_layers=(3, 15, llama.FINAL))
        tree = Tree(tokens=[int(pre.logits[0, -1].argmax()), 5, 7, 9, 11], parents=[-1, 0, 1, 0, 3])
        return pre, t.forward_tree(tree, hidden_layers=(3, 15, llama.FINAL))

    ref = run(False)
    calls = []
    monkeypatch.setattr(torch.ops.specdraft_quant, "block", lambda *a: calls.append(1) or fused_op(*a), raising=False)
    got = run(True)
    # the tree pass is fused; a prefill of more than QUANT_ROWS tokens takes the fp32 matmul instead
    assert len(calls) == t.config.num_layers * (1 + (len(ids) <= quant.QUANT_ROWS))
    for a, b in zip(ref, got):
        assert torch.allclose(a.logits, b.logits, rtol=0, atol=2e-3)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
        for k in a.hidden:
            scale = a.hidden[k].abs().max()
            assert torch.allclose(a.hidden[k], b.hidden[k], rtol=0, atol=1e-4 * float(scale)), k


def test_fused_block_rows_do_not_depend_on_the_rest_of_the_pass(exact_target):
    """A node's logits in a tree pass equal one-token decoding of its path up to fp32 rounding:
    the fused block computes each row on its own (norms, RoPE, cache writes), so a wrong row or
    head order would show here as a large difference."""
    from specdraft.tree import Tree

    t = exact_target
    ids = t.encode_prompt("def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\nExplain this code.")
    toks = [198, 12, 345, 678, 910]
    t.prefill(ids, 512)
    seq = []
    for x in toks:
        seq.append(t.forward_tree(Tree(tokens=[x], parents=[-1])).logits[0, 0].clone())
        t.commit([0])
    t.prefill(ids, 512)
    tree = Tree(tokens=[198, 12, 999, 345, 777, 678, 910], parents=[-1, 0, 0, 1, 2, 3, 5])
    got = t.forward_tree(tree).logits[0][[0, 1, 3, 5, 6]]
    assert torch.allclose(torch.stack(seq), got, rtol=0, atol=2e-3)
    assert torch.equal(torch.stack(seq).argmax(-1), got.argmax(-1))


def test_fused_blocks_in_left_padded_batches(exact_target, monkeypatch):
    """Batched decoding (``batch.generate_batch``: rows of several sequences, a padding mask) takes
    the fused block too and gives the Python blocks' tokens."""
    from specdraft.model.batched_decode import generate_batch
    from specdraft.model import llama

    t = exact_target
    prompts = [t.encode_prompt(p, raw=True) for p in ("The capital of France is", "1, 2, 3, 4,", "Once upon a")]
    outs, calls, fused_op = [], [], torch.ops.specdraft_quant.block
    for fused in (False, True):
        monkeypatch.setattr(llama, "FUSED_BLOCKS", fused)
        monkeypatch.setattr(torch.ops.specdraft_quant, "block", lambda *a: calls.append(a[0].shape[0]) or fused_op(*a),
                            raising=False)
        outs.append(generate_batch(t.model, prompts, 12, t.eos_ids).tokens)
        assert bool(calls) == fused and all(1 <= b <= 3 for b in calls) and (not fused or calls[0] == 3)
    assert outs[0] == outs[1] and all(len(x) > 0 for x in outs[1])


def test_q8_0_rows_dequantize_as_gguf_py_does():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32) * 4
    raw = quantize(w, GGMLQuantizationType.Q8_0)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).reshape(5, 96))
    assert torch.equal(RawQuant("Q8_0", 96, raw).dequantize(), ref)
    assert torch.equal(RawQuant("Q8_0", 96, raw[[3, 1]]).dequantize(), ref[[3, 1]])  # looked-up rows
