"""The fast precision mode (``model.fast``): the kernel equals a reference written from its stated
arithmetic, bit for bit; a row's result does not depend on the rest of the pass; a tree node's
logits equal one-token decoding of its path bit for bit (tiny models and the default target); the
portable implementation gives the same bits as the vector one (AVX-512 VNNI or AVX2); bad precision names are refused."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.model import blocks, fast, quant
from specdraft.model.load import build_model, load_hf_folder
from specdraft.target import Target
from specdraft.tree import Tree

from conftest import make_tiny_hf


@pytest.fixture(autouse=True)
def _vector_path():
    yield
    torch.ops.specdraft_quant.fast_set_isa(-1)


def _random_raw(kind: str, n: int, k: int, seed: int) -> quant.RawQuant:
    """A [n, k] matrix in ``kind``'s blocks: the 32-input formats quantized by gguf-py from rows of
    different scales; the K-quants (gguf-py cannot quantize them) as random bytes with sane fp16 scales,
    so every code, 6-bit scale and minimum appears."""
    rng = np.random.default_rng(seed)
    if kind not in blocks.SUPER:
        w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0, 2, (n, 1)).astype(np.float32)
        return quant.RawQuant(kind, k, quantize(w, GGMLQuantizationType[kind]))
    data = rng.integers(0, 256, (n, k // 256, blocks.BLOCK_BYTES[kind]), dtype=np.uint8)

    def f16(a):
        return np.frombuffer(a.astype(np.float16).tobytes(), np.uint8).reshape(*a.shape, 2)

    at = (208,) if kind == "Q6_K" else (0, 2)  # d (and dmin)
    for o in at:
        data[..., o:o + 2] = f16(rng.uniform(1e-4, 2e-2, data.shape[:2]) * rng.choice([-1, 1], data.shape[:2]))
    return quant.RawQuant(kind, k, data.reshape(n, -1))


@pytest.mark.parametrize("kind", fast.FORMATS)
def test_decoded_blocks_equal_gguf_py_dequantizer(kind):
    """The layouts as read here (``fast.decode``) rebuild exactly the weights gguf-py's own reader does."""
    raw = _random_raw(kind, 37, 512, seed=11)
    ref = np.asarray(dequantize(raw.data, GGMLQuantizationType[kind]), dtype=np.float32).reshape(37, 512)
    assert np.array_equal(blocks.decode(raw).dequantize().numpy(), ref)


@pytest.mark.parametrize("kind", fast.FORMATS)
@pytest.mark.parametrize("n,k", [(16, 256), (40, 512), (24, 1536)])
def test_kernel_equals_its_reference_bit_for_bit(kind, n, k):
    assert quant.kernel_available()
    raw = _random_raw(kind, n, k, seed=n + k)
    fw = fast.FastWeight.from_raw(raw)
    dense = blocks.decode(raw).dequantize()
    g = torch.Generator().manual_seed(1)
    for m in (1, 3, 8, 13, 64, 70):  # 70: past one 64-row chunk of the kernel
        x = torch.randn(m, k, generator=g) * 4
        x[0, :32] = 0.0  # an all-zero block (d = 0)
        y = fw(x)
        assert torch.equal(y, fast.reference_linear(x, raw)), (kind, n, k, m)
        # and it is the matmul it stands for, up to 8-bit activations
        ref = x @ dense.T
        assert (y - ref).abs().max() <= 0.03 * ref.abs().max()


def test_fused_parts_in_different_formats():
    """A fused projection whose parts are stored in different formats (Q4_K_M's q|k|v): each part's
    rows equal that part alone."""
    parts = [_random_raw(kind, n, 512, seed=i) for i, (kind, n) in enumerate([("Q4_K", 48), ("Q6_K", 16), ("Q8_0", 20)])]
    fused = fast.FastWeight.from_raw(*parts)
    x = torch.randn(5, 512)
    y = fused(x)
    assert torch.equal(y, fast.reference_linear(x, *parts))
    assert torch.equal(y[:, 48:64], fast.FastWeight.from_raw(parts[1])(x))


def test_activation_quantization_equals_its_reference():
    x = torch.randn(7, 96) * 3
    x[2, 32:64] = 0.0
    x[3, 5] = 1e4  # one outlier: its block's other values round to 0
    q, d, sx = torch.ops.specdraft_quant.fast_quantize(x)
    rq, rd, rsx = fast.reference_quantize(x)
    assert torch.equal(q.long(), rq) and torch.equal(d, rd) and torch.equal(sx, rsx)
    assert q.abs().max() <= 127


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q6_K"])
def test_a_row_does_not_depend_on_the_rest_of_the_pass(kind):
    fw = fast.FastWeight.from_raw(_random_raw(kind, 48, 512, seed=5))
    x = torch.randn(37, 512)
    whole = fw(x)
    for i in (0, 5, 17, 36):
        assert torch.equal(fw(x[i : i + 1]), whole[i : i + 1])
    assert torch.equal(fw(x[3:20]), whole[3:20])


needs_simd = pytest.mark.skipif(not (quant.kernel_available() and torch.ops.specdraft_quant.fast_best_isa()),
                                reason="this CPU has neither AVX-512 VNNI nor AVX2: the portable path is the only one, "
                                       "nothing to compare")


@needs_simd
@pytest.mark.parametrize("kind", fast.FORMATS)
def test_every_vector_implementation_gives_the_portable_bits(kind):
    op = torch.ops.specdraft_quant
    fw = fast.FastWeight.from_raw(_random_raw(kind, 40, 512, seed=7))
    x = torch.randn(11, 512)
    op.fast_set_isa(0)
    port = fw(x)
    for which in range(1, op.fast_best_isa() + 1):  # AVX2, and AVX-512 VNNI where the CPU has it
        op.fast_set_isa(which)
        assert torch.equal(fw(x), port), (kind, fast.ISAS[which])
    op.fast_set_isa(-1)


def test_logp_topk_on_every_path():
    """The drafters' top-k in C++: torch's log-softmax top-k (values to float rounding, the same indices,
    equal values lower index first), the same bits on every implementation, any k and row length."""
    op = torch.ops.specdraft_quant
    gen = torch.Generator().manual_seed(0)
    for v, k in ((8192, 8), (100, 1), (37, 5), (16, 16), (3, 3)):
        x = torch.randn(6, v, generator=gen) * 4
        if v > 9:
            x[1, 5] = x[1, 9] = x[1].max() + 1  # a tie at the top: index 5 first
        ref = torch.log_softmax(x, -1)
        results = []
        for which in range(op.fast_best_isa() + 1):
            op.fast_set_isa(which)
            lp, idx = op.fast_logp_topk(x, k)
            results.append((lp, idx))
            assert idx.shape == lp.shape == (6, k) and idx.dtype == torch.long
            torch.testing.assert_close(lp, ref.gather(1, idx), atol=2e-6, rtol=0)
            torch.testing.assert_close(lp, ref.topk(k, -1).values, atol=2e-6, rtol=0)
            assert bool((lp[:, :-1] >= lp[:, 1:]).all())
            assert set(idx[0].tolist()) == set(x[0].topk(k).indices.tolist())  # no ties in row 0
            if v > 9 and k > 1:
                assert idx[1, :2].tolist() == [5, 9]
        for lp, idx in results[1:]:
            assert torch.equal(lp, results[0][0]) and torch.equal(idx, results[0][1])
    op.fast_set_isa(-1)


def test_the_bias_in_the_kernel_is_torchs_add():
    """``fast_linear`` with a bias (what ``QuantLinear`` calls for fp32 rows) gives the bits of the product plus the
    bias added by torch, on every implementation; a bias of the wrong size is one error."""
    op = torch.ops.specdraft_quant
    lin = torch.nn.Linear(96, 40)
    q = fast.QuantLinear(lin)
    x = torch.randn(2, 5, 96)
    for which in range(op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        ref = q.mm(x) + lin.bias
        assert torch.equal(q(x), ref.detach()) and q(x).shape == (2, 5, 40)
        with pytest.raises(RuntimeError, match="bias"):
            op.fast_linear(x[0], *q.mm.args(), torch.zeros(39))
    op.fast_set_isa(-1)


def test_linear_topk_equals_its_steps_on_every_path():
    """A drafter's head and top-k in one call (``fast_linear_topk``) gives the bits of its steps one by one:
    ``fast_linear`` (``fast_head`` with a norm) then ``fast_logp_topk`` (then the row numbers' ids where given), on
    every implementation."""
    op = torch.ops.specdraft_quant
    fw = fast.FastWeight.from_raw(_random_raw("Q8_0", 300, 128, seed=3))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)) * 3
    norm = torch.rand(128, generator=torch.Generator().manual_seed(5)) + 0.5
    for which in range(op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        for k in (1, 8, 300):
            lp, idx = op.fast_linear_topk(x, None, 0.0, *fw.args(), k)
            ref = op.fast_logp_topk(fw(x), k)
            assert torch.equal(lp, ref[0]) and torch.equal(idx, ref[1])
            lp, idx = op.fast_linear_topk(x, norm, 1e-5, *fw.args(), k)
            ref = op.fast_logp_topk(op.fast_head(x, norm, 1e-5, *fw.args(), True)[1], k)
            assert torch.equal(lp, ref[0]) and torch.equal(idx, ref[1])
        ids = torch.randperm(5000, generator=torch.Generator().manual_seed(which))[:300]
        lp, mapped = op.fast_linear_topk(x, None, 0.0, *fw.args(), 8, ids)
        ref = op.fast_logp_topk(fw(x), 8)
        assert torch.equal(lp, ref[0]) and torch.equal(mapped, ids[ref[1]])
        with pytest.raises(RuntimeError, match="1 <= k"):
            op.fast_linear_topk(x, None, 0.0, *fw.args(), 301)
        with pytest.raises(RuntimeError, match="ids"):
            op.fast_linear_topk(x, None, 0.0, *fw.args(), 8, ids[:10])
    op.fast_set_isa(-1)


def test_mlp_topk_equals_its_layers_on_every_path():
    """The phrase head in one call (``fast_mlp_topk``): one layer gives the bits of ``fast_linear`` + bias then
    ``fast_logp_topk``; three layers with SiLU between them the module's values to float rounding, the same
    entries; the same bits on every implementation."""
    op = torch.ops.specdraft_quant
    gen = torch.Generator().manual_seed(6)
    shapes = [(64, 96), (64, 64), (200, 64)]  # (rows, inputs) per layer
    ws = [fast.FastWeight.from_dense(torch.randn(n, k, generator=gen) * 0.2, "Q8_0") for n, k in shapes]
    bs = [torch.randn(n, generator=gen) * 0.1 for n, _ in shapes]
    x = torch.randn(3, 96, generator=gen)
    flat = [t for w in ws for t in w.args()[0]]
    meta = [m for w in ws for m in w.args()[1]]
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = w(h) + b
        if i < 2:
            h = torch.nn.functional.silu(h)
    ref_lp, ref_idx = torch.log_softmax(h, -1).topk(7, -1)
    results = []
    for which in range(op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        one = op.fast_mlp_topk(x, flat[:4], meta[:2], bs[:1], 5)
        step = op.fast_logp_topk(ws[0](x) + bs[0], 5)
        assert torch.equal(one[0], step[0]) and torch.equal(one[1], step[1])
        lp, idx = op.fast_mlp_topk(x, flat, meta, bs, 7)
        assert torch.equal(idx, ref_idx)
        torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
        results.append((lp, idx))
        no_bias = op.fast_mlp_topk(x, flat[:4], meta[:2], [torch.empty(0)], 5)
        assert torch.equal(no_bias[0], op.fast_logp_topk(ws[0](x), 5)[0])
        with pytest.raises(RuntimeError, match="per layer"):
            op.fast_mlp_topk(x, flat, meta, bs[:2], 7)
    for lp, idx in results[1:]:
        assert torch.equal(lp, results[0][0]) and torch.equal(idx, results[0][1])
    op.fast_set_isa(-1)


def test_q8_rows_equal_gguf_py_on_every_path():
    """The embedding lookup in C++ (``fast_rows_q8``, what a fast-mode ``BlockTable`` of Q8_0 blocks reads a pass's
    rows with): gguf-py's values bit for bit (subnormal, zero and negative scales among them) on every
    implementation, the table's own numpy lookup alike, and an id outside the table one IndexError."""
    op = torch.ops.specdraft_quant
    raw = _random_raw("Q8_0", 50, 96, seed=5)
    scales = raw.data.reshape(50, 3, 34)[..., :2]
    scales[3, 1] = np.frombuffer(np.float16(3e-7).tobytes(), np.uint8)  # a subnormal fp16 scale
    scales[4, 0] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)
    scales[5, 2] = np.frombuffer(np.float16(-1.5).tobytes(), np.uint8)
    ref = np.asarray(dequantize(raw.data, GGMLQuantizationType.Q8_0), dtype=np.float32).reshape(50, 96)
    ids = torch.tensor([3, 4, 5, 0, 49, 3])
    for which in range(op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        rows = op.fast_rows_q8(torch.from_numpy(raw.data), ids)
        assert rows.shape == (6, 96) and rows.dtype == torch.float32
        assert np.array_equal(rows.numpy().view(np.uint32), ref[ids.numpy()].view(np.uint32))  # -0.0 kept
        for bad in ([50], [-1]):
            with pytest.raises(IndexError, match="out of range"):
                op.fast_rows_q8(torch.from_numpy(raw.data), torch.tensor(bad))
    op.fast_set_isa(-1)
    from specdraft.model.llama import BlockTable

    table = BlockTable(raw, torch.device("cpu"))
    kernel = table(ids[None])
    table._q8 = False  # numpy's lookup
    assert kernel.shape == (1, 6, 96) and torch.equal(kernel, table(ids[None]))
    assert torch.equal(table[5], kernel[0, 2])
    table._q8 = None
    assert torch.equal(table(ids[None].int()), kernel)  # int32 ids as well


def test_the_isa_in_use_is_reported():
    assert fast.isa() in fast.ISAS
    assert fast.ISAS.index(fast.isa()) == torch.ops.specdraft_quant.fast_best_isa()


def _random_tree(rng: random.Random, n: int, vocab: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return Tree(tokens=[rng.randrange(vocab) for _ in range(n)], parents=parents)


def _path(tree: Tree, node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def assert_tree_equals_sequential(t: Target, prompt: list[int], sizes, seed: int, nodes_checked: int = 6) -> None:
    """For random trees of each size: every checked node's logits in the tree pass are torch.equal to
    one-token passes over its path after the same prefill."""
    rng = random.Random(seed)
    slots = len(prompt) + max(sizes) + 2
    for n in sizes:
        tree = _random_tree(rng, n, t.config.vocab_size)
        t.prefill(prompt, slots)
        got = t.forward_tree(tree).logits[0]
        for node in sorted(rng.sample(range(n), min(n, nodes_checked))):
            t.prefill(prompt, slots)
            for j in _path(tree, node):
                logits = t.forward_tree(Tree(tokens=[tree.tokens[j]], parents=[-1])).logits[0, 0]
                t.commit([0])
            assert torch.equal(logits, got[node]), (n, node)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny_fast(request, tmp_path_factory) -> Target:
    path = tmp_path_factory.mktemp(f"tiny_fast_{request.param}")
    make_tiny_hf(request.param, path, scale=3.0)
    w = load_hf_folder(path)
    t = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    assert t.precision == "fast"  # an HF folder's weights are rounded to Q8_0 blocks for this mode
    return t


def test_tree_equals_sequential_bit_for_bit_on_tiny_models(tiny_fast):
    prompt = [5, 17, 3, 44, 9, 12, 80, 2]
    assert_tree_equals_sequential(tiny_fast, prompt, sizes=(1, 2, 3, 5, 8, 16, 29, 48, 64), seed=0)


def test_speculative_greedy_equals_plain_greedy_on_a_tiny_model(tiny_fast):
    from test_speculative_greedy import RandomTreeDrafter

    cfg = GenerateConfig(max_new_tokens=40)
    for seed in range(4):
        prompt = [random.Random(seed).randrange(2, 96) for _ in range(5)]
        ref = generate(tiny_fast, prompt, None, cfg)
        for width, depth, budget in ((3, 4, 12), (8, 8, 63)):
            drafter = RandomTreeDrafter(seed, 96, ref.token_ids, width, depth, budget)
            assert generate(tiny_fast, prompt, drafter, cfg).token_ids == ref.token_ids


def test_tree_equals_sequential_bit_for_bit_on_the_default_target(default_target):
    assert default_target.precision == "fast"
    prompt = default_target.encode_prompt("def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)\nExplain it.")
    assert_tree_equals_sequential(default_target, prompt, sizes=(1, 2, 4, 7, 16, 33, 64), seed=1, nodes_checked=4)


@needs_simd
def test_portable_mode_gives_the_same_logits_and_tokens(default_target):
    """A CPU without AVX2 runs the portable implementation: the same bits through the whole model
    (attention, norms, SiLU, head), so the same tokens."""
    t = default_target
    ids = t.encode_prompt("List three prime numbers.")
    tree = Tree(tokens=[504, 2988, 288, 17, 9], parents=[-1, 0, 0, 1, 3])
    cfg = GenerateConfig(max_new_tokens=12)

    def run():
        first = t.prefill(ids, len(ids) + 8).logits.clone()
        return first, t.forward_tree(tree).logits.clone(), generate(t, ids, None, cfg).token_ids

    vec = run()
    torch.ops.specdraft_quant.fast_set_isa(0)
    port = run()
    assert torch.equal(vec[0], port[0]) and torch.equal(vec[1], port[1]) and vec[2] == port[2]


def _assert_every_path_gives_the_portable_bits(t: Target, ids: list[int], tree: Tree, room: int) -> None:
    """A prefill of ``ids`` (``room`` slots to spare) and ``tree`` after it give the portable path's logits, bit for
    bit, on every vector path this CPU has."""
    op = torch.ops.specdraft_quant

    def run():
        return t.prefill(ids, len(ids) + room).logits.clone(), t.forward_tree(tree).logits.clone()

    op.fast_set_isa(0)
    port = run()
    for which in range(1, op.fast_best_isa() + 1):
        op.fast_set_isa(which)
        got = run()
        assert torch.equal(got[0], port[0]) and torch.equal(got[1], port[1]), fast.ISAS[which]
    op.fast_set_isa(-1)


@needs_simd
def test_long_contexts_give_the_portable_bits_on_every_path(default_target):
    """Attention over hundreds of keys (the vector paths score 16 keys at a time with AVX-512, 8 with AVX2, their
    reduction trees side by side): a 330-token prefill and a tree after it equal the portable path's bits on every
    vector path."""
    t = default_target
    ids = list(range(200, 530))
    tree = Tree(tokens=[504, 2988, 288, 17, 9, 33, 41], parents=[-1, 0, 0, 1, 3, 3, 2])

    _assert_every_path_gives_the_portable_bits(t, ids, tree, 10)


@needs_simd
@pytest.mark.parametrize("head_dim", [48, 80, 96, 128, 256])
def test_every_head_size_gives_the_portable_bits(tmp_path, head_dim):
    """Heads of 48 to 256 dims (the vector paths sum a row's weighted values 64 dims at a time, then the last
    16, 32 or 48) over 75 keys of different tokens (the scores 8 or 16 keys at a time, then the rest): the
    portable path's bits."""
    make_tiny_hf(f"qwen3_d{head_dim}", tmp_path, scale=3.0)
    w = load_hf_folder(tmp_path)
    t = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    assert t.precision == "fast"
    rng = random.Random(head_dim)
    ids = [rng.randrange(2, 96) for _ in range(75)]
    assert len(set(ids)) > 40
    tree = Tree(tokens=[5, 7, 9, 11, 13], parents=[-1, 0, 0, 1, 3])

    _assert_every_path_gives_the_portable_bits(t, ids, tree, 8)


def test_unknown_precision_is_refused(default_weights):
    with pytest.raises(SpecdraftError, match="unknown precision 'fastest'"):
        Target.load("default", precision="fastest")
    with pytest.raises(SpecdraftError, match="unknown precision"):
        build_model(default_weights, precision="int4")


def test_a_model_the_fast_mode_cannot_run_stays_exact_with_one_warning(tmp_path):
    make_tiny_hf("llama_d8", tmp_path)  # heads of 8 (the fast block takes multiples of 16)
    w = load_hf_folder(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(w, precision="fast")
    assert model.precision == "exact"
    assert sum("fast precision mode is unavailable" in str(c.message) for c in caught) == 1


def test_exact_mode_is_still_selectable(default_weights):
    t = Target.from_weights(default_weights, precision="exact")
    assert t.precision == "exact" and t.model.quantized_rows > 0


def test_repacking_refuses_other_block_formats():
    raw = quant.RawQuant("IQ2_XS", 256, np.zeros((16, 74), dtype=np.uint8))
    with pytest.raises(ValueError, match="not IQ2_XS"):
        fast.FastWeight.from_raw(raw)


def test_left_padded_batches_equal_single_stream_in_the_fast_mode(default_target):
    """Batched plain decoding (rows of several sequences, left padding, a padding mask) gives each
    sequence exactly its single-stream tokens: its rows never see another row's arithmetic."""
    from specdraft.model.batched_decode import generate_batch

    t = default_target
    prompts = [t.encode_prompt(p, raw=True) for p in ("The capital of France is", "1, 2, 3, 4,", "Once upon a time")]
    batched = generate_batch(t.model, prompts, 16, t.eos_ids).tokens
    single = [generate(t, p, None, GenerateConfig(max_new_tokens=16)).token_ids for p in prompts]
    assert batched == single


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_fast_mode_computes_the_exact_modes_model(tmp_path, arch):
    """Every weight reaches the fast block (q/k/v bias, every norm weight, the final norm; Gemma 3's
    q/k and sandwich norms, GeGLU, attention scale, windows and two RoPE bases): on tiny models with
    random norm weights the fast logits stay within 8-bit rounding of the exact ones.  Dropping any of
    them moves the logits far more (Qwen2, measured: 67-113% of their scale, against 13%)."""
    from transformers import AutoModelForCausalLM

    make_tiny_hf(arch, tmp_path, scale=3.0)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if arch == "gemma3" else p.uniform_(0.5, 1.5)  # Gemma's norms scale by 1 + w
    hf.save_pretrained(tmp_path, safe_serialization=True)
    w = load_hf_folder(tmp_path)
    ids = torch.tensor([[5, 17, 3, 44, 9, 12, 80, 2, 33, 61]])
    logits = {}
    for mode in ("exact", "fast"):
        m = build_model(w, precision=mode)
        assert m.precision == mode
        cache = m.new_cache(1, 16)
        from specdraft.model.llama import causal_mask

        logits[mode] = m(ids, torch.arange(10)[None], causal_mask(10, 0), cache, 0).logits[0]
    scale = logits["exact"].abs().max()
    assert (logits["fast"] - logits["exact"]).abs().max() < 0.25 * scale  # measured 0.13; a dropped weight: 0.67-1.13
    assert (logits["fast"].argmax(-1) == logits["exact"].argmax(-1)).float().mean() >= 0.8


def test_trees_past_the_context_end_decode_like_plain(tmp_path):
    """generate caps the new tokens, not the tree: near the end of the context a tree's positions run
    past it. The fast mode's RoPE table grows (rows already looked up unchanged) instead of failing."""
    from test_speculative_greedy import RandomTreeDrafter

    make_tiny_hf("llama", tmp_path, scale=3.0)
    w = load_hf_folder(tmp_path)
    t = Target(build_model(w, precision="fast"), tokenizer=None, name=w.name, weight_hash=w.weight_hash)
    ctx = t.config.max_position
    prompt = [random.Random(1).randrange(2, 96) for _ in range(ctx - 6)]
    cfg = GenerateConfig(max_new_tokens=20)
    ref = generate(t, prompt, None, cfg)
    got = generate(t, prompt, RandomTreeDrafter(0, 96, ref.token_ids, width=3, depth=6, budget=12), cfg)
    assert got.token_ids == ref.token_ids


def test_the_cost_curve_runs_on_a_model_loaded_for_the_fast_mode_only(default_target):
    """`bench --cost-curve` on the default target (its head a BlockTable over the file's blocks, no fp32
    copy): it measures and says what ran (no timing is asserted)."""
    from specdraft.bench.cost import measure_cost_curve

    curve = measure_cost_curve(default_target, max_n=3, context=16, repeats=1, quiet=True)
    assert curve["n"] == [1, 2, 3] and len(curve["ms"]) == 3 and all(m > 0 for m in curve["ms"])
    assert curve["packed_weights"] is False and curve["kernel"]["isa"] == fast.isa()
