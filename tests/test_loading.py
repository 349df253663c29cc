"""Loading a GGUF: the metadata reader against gguf-py, its errors, the fast mode's model without fp32
matrices (embedding rows dequantized as looked up, the packed-weight cache), a written 1B-shaped Llama in
miniature (GQA, untied head, llama3 rope_freqs, Q4_K_M-like blocks) decoding losslessly, the tokenizer
without transformers, and the memory refusal."""

from __future__ import annotations

import random
import struct
import warnings

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from specdraft.drafters.ngram import NgramDrafter
from specdraft.errors import SpecdraftError
from specdraft.generate import GenerateConfig, generate
from specdraft.model import memory
from specdraft.model.config import ModelConfig
from specdraft.model.gguf_read import GGUFFile
from specdraft.model.gguf_write import write_random_llama
from specdraft.model.llama import BlockTable, Linear, rope_inv_freq
from specdraft.model.load import build_model, default_gguf_path, load_weights
from specdraft.target import Target

from test_errors import assert_one_line_error, run_cli
from test_speculative_greedy import RandomTreeDrafter

SMALL = ModelConfig(arch="llama", vocab_size=2048, hidden_size=256, intermediate_size=768, num_layers=3, num_heads=8,
                    num_kv_heads=2, head_dim=32, max_position=1024, rope_theta=500000.0, bos_token_id=1,
                    eos_token_ids=[2], tie_embeddings=False)  # the 1B shape in miniature: GQA 4:1, untied


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    factors = np.linspace(1.0, 8.0, SMALL.head_dim // 2).astype(np.float32)  # as llama3's rope_freqs
    write_random_llama(path, SMALL, default_gguf_path(), rope_factors=factors, seed=3, name="small-llama")
    return path, factors


def _gguf_py(path):
    """gguf-py's view: metadata (without its GGUF.* pseudo-fields) and the tensor table."""
    r = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    table = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name, int(t.data_offset), int(t.n_bytes))
             for t in r.tensors}
    return fields, table, r


@pytest.mark.parametrize("which", ["default", "written"])
def test_the_reader_equals_gguf_py(which, small_gguf):
    path = default_gguf_path() if which == "default" else small_gguf[0]
    fields, table, r = _gguf_py(path)
    g = GGUFFile(path)
    assert g.fields == fields
    assert {n: (t.shape, t.kind, t.offset, t.nbytes) for n, t in g.tensors.items()} == table
    assert list(g.tensors) == [t.name for t in r.tensors]  # file order
    for t in r.tensors[:8]:
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        assert np.array_equal(g.read(t.name).reshape(-1), raw) and np.array_equal(g.view(t.name).reshape(-1), raw)


def _tensor_type_at(data: bytes, name: str) -> int:
    """Byte offset of tensor ``name``'s ggml type in a GGUF's tensor table."""
    i = data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, i)
    return i + 4 + 8 * n_dims


@pytest.mark.parametrize("damage, needle", [
    ("truncated", "ends inside its header"),
    ("count", "more than a file of"),
    ("tensor_past_end", "runs past the end of the file"),
    ("unknown_type", "unknown type 200"),
    ("not_gguf", "not a GGUF file"),
])
def test_a_damaged_file_is_one_error_line(damage, needle, small_gguf, tmp_path, capsys):
    data = bytearray(small_gguf[0].read_bytes())
    if damage == "truncated":
        data = data[:GGUFFile(small_gguf[0]).data_start - 40]  # inside the tensor table
    elif damage == "count":
        data[16:24] = struct.pack("<Q", 1 << 40)  # the metadata count
    elif damage == "tensor_past_end":
        data = data[:-100]
    elif damage == "unknown_type":
        i = _tensor_type_at(bytes(data), "blk.0.attn_q.weight")
        data[i:i + 4] = struct.pack("<I", 200)
    else:
        data[:4] = b"GGML"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    rc, _, err = run_cli(capsys, "generate", "--target", str(bad), "Hi")
    assert_one_line_error(rc, err, needle)


def test_metadata_that_cannot_make_a_model_is_one_error_line(tmp_path, capsys):
    from gguf import GGUFWriter

    w = GGUFWriter(str(tmp_path / "zero.gguf"), "llama")
    w.add_head_count(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, _, err = run_cli(capsys, "generate", "--target", str(tmp_path / "zero.gguf"), "Hi")
    assert_one_line_error(rc, err, "metadata")


def _fast_target(path) -> Target:
    w = load_weights(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = build_model(w, precision="fast")
    return Target(model, tokenizer=None, name=w.name, weight_hash=w.weight_hash)


def _dense(model) -> dict[str, tuple]:
    """Every tensor the model holds off "meta" (parameters, buffers), by name."""
    out = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta}
    return out


def test_the_fast_mode_holds_no_fp32_copy_of_a_quantized_matrix(default_weights):
    model = build_model(default_weights, precision=None)  # as the CLI loads it (drafters may later ask for the table)
    assert isinstance(model.embed, BlockTable) and model.lm_head is model.embed and model.embed._weight is None
    for m in model.modules():
        if isinstance(m, Linear):
            assert m.weight.is_meta, "a projection has an fp32 weight"
    dense = _dense(model)
    assert all(len(s) == 1 for s in dense.values()), dense  # only vectors: norms, inv_freq
    assert sum(int(np.prod(s)) for s in dense.values()) < 64 * 1024
    with pytest.raises(SpecdraftError, match="fast mode only"):
        model.set_precision("exact")


def test_the_embedding_rows_equal_the_whole_table_dequantized(small_gguf, default_weights):
    for w in (load_weights(str(small_gguf[0])), default_weights):
        table = w.state_dict["model.embed_tokens.weight"]
        model = build_model(w, precision="fast")
        ids = torch.tensor([[0, 5, table.shape[0] - 1], [7, 7, 3]])
        assert torch.equal(model.embed(ids), table[ids])
        with pytest.raises(IndexError):
            model.embed(torch.tensor([[table.shape[0]]]))


def test_a_written_1b_shaped_model_decodes_losslessly(small_gguf):
    path, factors = small_gguf
    t = _fast_target(path)
    assert t.precision == "fast" and not t.config.tie_embeddings and t.config.num_kv_heads == 2
    assert t.model.fast_formats() == {"Q4_K": 3 * 5, "Q6_K": 3 * 2 + 1}
    inv = rope_inv_freq(SMALL.head_dim, SMALL.rope_theta) / torch.from_numpy(factors)
    assert torch.equal(t.model.inv_freq, inv)  # rope_freqs as stored
    cfg = GenerateConfig(max_new_tokens=40)
    for seed in range(3):
        ids = [random.Random(seed).randrange(3, 2000) for _ in range(9)]
        ref = generate(t, ids, None, cfg).token_ids
        assert generate(t, ids, RandomTreeDrafter(seed, 2048, ref, 4, 5, 20), cfg).token_ids == ref
        assert generate(t, ids, NgramDrafter(), cfg).token_ids == ref


def test_the_packed_cache_is_used_and_survives_damage(small_gguf, tmp_path):
    path = small_gguf[0]
    w = load_weights(str(path))
    first = build_model(w, precision="fast")
    files = list((tmp_path / "cache" / "packed").glob("*.safetensors"))
    assert len(files) == 1
    from safetensors.torch import load_file  # the file is plain safetensors

    assert len(load_file(str(files[0]))) == sum(4 * len(fw.parts) for fw in first.fast_weights)
    second = build_model(w, precision="fast")
    for a, b in zip(first.fast_weights, second.fast_weights):
        assert [k for k, _, _ in a.parts] == [k for k, _, _ in b.parts]
        assert all(torch.equal(x, y) for x, y in zip(a.args()[0], b.args()[0]))
    files[0].write_bytes(files[0].read_bytes()[:1000])
    with pytest.warns(UserWarning, match="unreadable packed-weight cache"):
        third = build_model(w, precision="fast")
    assert all(torch.equal(x, y) for a, b in zip(first.fast_weights, third.fast_weights)
               for x, y in zip(a.args()[0], b.args()[0]))


def test_the_packed_cache_keeps_under_its_limit(small_gguf, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_PACK_CACHE_GB", "0.0001")  # ~100 KB: the small model does not fit
    with pytest.warns(UserWarning, match="not cached .*over the cache limit"):
        build_model(load_weights(str(small_gguf[0])), precision="fast")


def test_the_tokenizer_equals_transformers(default_target):
    tok = default_target.tokenizer
    hf = tok.hf
    texts = ["Hi", "Hello, world!  How are you?\n\nI'm fine.", "def f(x):\n    return x ** 2  # ok",
             "<|im_start|>system\nsay X<|im_end|>", "héllo 日本語 🙂", " leading and trailing ", "a . b , c n't"]
    for text in texts:
        for special in (True, False):
            ids = tok(text, add_special_tokens=special).input_ids
            assert ids == hf(text, add_special_tokens=special).input_ids
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        one = [{"role": "user", "content": text}]
        assert tok.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == \
            hf.apply_chat_template(one, tokenize=False, add_generation_prompt=True)
    assert tok.eos_token_id == hf.eos_token_id
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(two, tokenize=False, add_generation_prompt=True) == \
        hf.apply_chat_template(two, tokenize=False, add_generation_prompt=True)


def test_tokenizing_lets_other_threads_run(default_target):
    """A megabyte prompt tokenized on a server's worker thread must not hold the GIL (a single ``encode`` of
    the backend does, for the whole second, and stalls /health and every stream): the main thread keeps
    waking up meanwhile, and the ids are the backend's own."""
    import threading
    import time

    tok = default_target.tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 45_000  # 2 MB
    got, wakes = {}, []
    worker = threading.Thread(target=lambda: got.update(ids=tok(text, add_special_tokens=False).input_ids))
    worker.start()
    while worker.is_alive():
        time.sleep(0.002)
        wakes.append(time.perf_counter())
    worker.join()
    assert len(wakes) >= 20, f"the main thread woke {len(wakes)} times while a 2 MB text was tokenized"
    assert got["ids"][:50] == tok._tk.encode(text[:2000], add_special_tokens=False).ids[:50]
    assert tok.encode_as_text("<|im_start|>x") == tok._text_only.encode("<|im_start|>x", add_special_tokens=False).ids


def test_a_model_that_does_not_fit_is_refused_in_one_line(small_gguf, capsys, monkeypatch):
    monkeypatch.setattr(memory, "available", lambda: 50 << 20)
    rc, _, err = run_cli(capsys, "generate", "--target", str(small_gguf[0]), "Hi")
    assert_one_line_error(rc, err, "needs about")
    assert "in the fast mode" in err and "0.0 GiB available" in err
    rc, _, err = run_cli(capsys, "generate", "--target", str(small_gguf[0]), "--precision", "exact", "Hi")
    assert_one_line_error(rc, err, "in the exact mode")
    monkeypatch.setenv("SPECDRAFT_MEMORY_CHECK", "0")
    memory.check("x", "fast", 1 << 50, "everything")  # skipped



def test_a_bias_outside_q_k_v_is_refused_not_dropped(tmp_path):
    """The decoder has biases on q/k/v only: a model with one on W_o (Llama's or Qwen3's attention_bias,
    a GGUF's attn_output.bias) is refused in one line instead of loading without it."""
    import dataclasses

    from conftest import TINY
    from specdraft.model.gguf_write import write_gguf

    with pytest.raises(SpecdraftError, match="attention_bias on a llama model"):
        ModelConfig.from_hf(dict(TINY["llama"], attention_bias=True))
    assert ModelConfig.from_hf(dict(TINY["qwen2"], attention_bias=True)).qkv_bias  # Qwen2's: q/k/v only
    cfg = dataclasses.replace(ModelConfig.from_hf(TINY["llama"]), tie_embeddings=True)
    g = torch.Generator().manual_seed(0)
    h, d = cfg.hidden_size, cfg.head_dim
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g), "model.norm.weight": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n, shape in (("self_attn.q_proj", (cfg.num_heads * d, h)), ("self_attn.k_proj", (cfg.num_kv_heads * d, h)),
                         ("self_attn.v_proj", (cfg.num_kv_heads * d, h)), ("self_attn.o_proj", (h, cfg.num_heads * d)),
                         ("mlp.gate_proj", (cfg.intermediate_size, h)), ("mlp.up_proj", (cfg.intermediate_size, h)),
                         ("mlp.down_proj", (h, cfg.intermediate_size))):
            sd[p + n + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        sd[p + "input_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"] = torch.ones(h)
    write_gguf(tmp_path / "ok.gguf", cfg, sd, lambda n, t: "Q8_0")
    assert load_weights(str(tmp_path / "ok.gguf")).config.num_layers == cfg.num_layers
    sd["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(h)
    write_gguf(tmp_path / "obias.gguf", cfg, sd, lambda n, t: "Q8_0")
    with pytest.raises(SpecdraftError, match=r"blk\.1\.attn_output\.bias \(a bias outside q/k/v\)"):
        load_weights(str(tmp_path / "obias.gguf"))
