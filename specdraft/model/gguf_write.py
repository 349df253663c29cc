"""Write a Llama-family model as a GGUF file whose projections are in any block format (``model.blocks``):
test models of any shape and quantization mix, with gguf-py's ``GGUFWriter`` for the container."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from torch import Tensor

from specdraft.model.blocks import BLOCK_BYTES, block_inputs, quantize
from specdraft.model.config import ModelConfig
from specdraft.model.load import GEMMA3_GGUF_NAMES, GGUF_NAMES

_HF_TO_GGUF = {hf: gguf for gguf, hf in GGUF_NAMES.items()}  # the loader's names, inverted
_GEMMA3_TO_GGUF = {hf: gguf for gguf, hf in GEMMA3_GGUF_NAMES.items()}


def _rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (what ``load._reverse_rope_permute`` undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{(_GEMMA3_TO_GGUF if arch == 'gemma3' else _HF_TO_GGUF)[module]}.{leaf}"


def write_gguf(path: Path, cfg: ModelConfig, sd: dict[str, Tensor], kind_of: Callable[[str, Tensor], str],
               name: str = "test-model", stored: dict[str, tuple[str, np.ndarray]] | None = None,
               tokenizer_from: Path | None = None) -> None:
    """``sd``: HF-named fp32 tensors of a Llama-architecture or Gemma 3 model (``cfg.arch``; tied
    embeddings: no lm_head; Gemma's norms as the 1 + w they scale by, as ``model.load`` holds them);
    ``kind_of(hf_name, tensor)``: its GGUF type ("F32" or a block format; 1-D tensors are always F32).
    ``stored``: tensors given as (any GGML type name, its block bytes [rows, row_bytes]) instead, written as
    they are (q/k rows already in llama.cpp's order).  ``tokenizer_from``: a GGUF whose tokenizer and chat
    template the file takes (its first ``cfg.vocab_size`` tokens); None: no tokenizer."""
    arch = "gemma3" if cfg.arch == "gemma3" else "llama"
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    if arch == "gemma3":  # what llama.cpp reads beside its own Gemma 3 constants (model.load._gemma3_gguf)
        if abs((cfg.query_scale or 0) * math.sqrt(cfg.head_dim) - 1) > 1e-6:
            raise ValueError("a Gemma 3 GGUF's attention scale is 1/sqrt(head size); this config's is not")
        if cfg.sliding_window is not None:
            w.add_sliding_window(cfg.sliding_window)
            w.add_sliding_window_pattern([cfg.window(i) is not None for i in range(cfg.num_layers)])
            w.add_rope_freq_base_swa(cfg.rope_local_theta or cfg.rope_theta)
    if tokenizer_from is not None:
        from specdraft.model.gguf_read import GGUFFile

        src = GGUFFile(tokenizer_from)
        _add_tokenizer(w, src, _subset_vocabulary(src, cfg.vocab_size), cfg.vocab_size)
    else:
        if cfg.bos_token_id is not None:
            w.add_bos_token_id(cfg.bos_token_id)
        if cfg.eos_token_ids:
            w.add_eos_token_id(cfg.eos_token_ids[0])
    for hf, (kind, data) in (stored or {}).items():
        w.add_tensor(gguf_name(hf, arch), data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])
    for hf, t in sd.items():
        if hf in (stored or {}):
            continue
        a = t.detach().float().cpu().numpy()
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):  # Gemma's stay in HF's order
            a = _rope_permute(a, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
        kind = "F32" if a.ndim == 1 else kind_of(hf, t)
        if kind == "F32":
            w.add_tensor(gguf_name(hf, arch), np.ascontiguousarray(a, dtype=np.float32))
        else:
            raw = quantize(a, kind)
            w.add_tensor(gguf_name(hf, arch), raw.data, raw_shape=raw.data.shape, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------- random test models of any size

# llama.cpp's Q4_K_M recipe in spirit: Q6_K for v and down and the output, Q4_K elsewhere
Q4_K_M_LIKE = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
               "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}
_CODE_STD = {"Q4_0": 4.6, "Q4_1": 4.6, "Q5_0": 9.2, "Q5_1": 9.2, "Q8_0": 74.0, "Q4_K": 147.0, "Q5_K": 294.0,
             "Q6_K": 1369.0}  # the spread of (scale x code) per unit of d, for random codes and scales


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, std: float) -> np.ndarray:
    """[rows, row_bytes] random blocks of ``kind`` (``model.blocks.FORMATS``) whose weights spread about
    ``std``: random codes and sub-block scales, fp16 scales drawn near std / (their codes' spread), minimums
    that centre the codes.  Weights of no trained model; fast to make at any size."""
    nb, size = cols // block_inputs(kind), BLOCK_BYTES[kind]
    data = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    d = (std / _CODE_STD[kind]) * rng.uniform(0.5, 1.5, (rows, nb))

    def put(offset: int, values: np.ndarray) -> None:
        data[..., offset:offset + 2] = values.astype(np.float16)[..., None].view(np.uint8)

    if kind == "Q6_K":
        put(208, d)
    else:
        put(0, d)
        centre = {"Q4_1": -8.0, "Q5_1": -16.0, "Q4_K": 7.5, "Q5_K": 15.5}.get(kind)
        if centre is not None:  # Q4_1 / Q5_1: m (w = d u + m); Q4_K / Q5_K: dmin (w = d sc u - dmin mn)
            put(2, d * centre)
    return data.reshape(rows, nb * size)


def _subset_vocabulary(source, vocab: int) -> dict:
    """The first ``vocab`` tokens of a GGUF's BPE vocabulary (``model.gguf_read.GGUFFile``), with the merges
    among them: a smaller vocabulary that still tokenizes any text (byte-level BPE keeps its bytes)."""
    tokens = source.get("tokenizer.ggml.tokens")[:vocab]
    kept = set(tokens)
    merges = [m for m in source.get("tokenizer.ggml.merges")
              if len(p := m.split(" ")) == 2 and p[0] in kept and p[1] in kept and p[0] + p[1] in kept]
    return {"tokens": tokens, "types": source.get("tokenizer.ggml.token_type")[:vocab], "merges": merges}


def _add_tokenizer(w: GGUFWriter, src, voc: dict, vocab_size: int) -> None:
    """The vocabulary ``voc`` (``_subset_vocabulary``), its special token ids and the chat template of the
    GGUF ``src`` into the writer ``w``."""
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model(src.get("tokenizer.ggml.model", "gpt2"))
    if src.get("tokenizer.ggml.pre"):
        w.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
    w.add_token_list(voc["tokens"])
    w.add_token_types(voc["types"])
    w.add_token_merges(voc["merges"])
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("unknown", w.add_unk_token_id),
                     ("padding", w.add_pad_token_id)):
        tid = src.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(tid, int) and tid < vocab_size:
            add(tid)
    if src.get("tokenizer.chat_template"):
        w.add_chat_template(src.get("tokenizer.chat_template"))


def write_random_llama(path: Path, cfg: ModelConfig, tokenizer_from: Path, mix: dict[str, str] | None = None,
                       rope_factors: np.ndarray | None = None, seed: int = 0, name: str = "random-llama",
                       progress: bool = False) -> None:
    """A Llama-architecture GGUF of shape ``cfg`` with random weights in ``mix`` (GGUF tensor kind -> block
    format; default ``Q4_K_M_LIKE``), the tokenizer (its first ``cfg.vocab_size`` tokens) and chat template of
    the GGUF ``tokenizer_from``, and llama3's ``rope_freqs`` if ``rope_factors`` [D/2] is given.  Tensors are
    made and written one at a time (memory: the largest tensor, not the file)."""
    from tqdm import tqdm

    from specdraft.model.gguf_read import GGUFFile

    mix = dict(Q4_K_M_LIKE, **(mix or {}))
    src = GGUFFile(tokenizer_from)
    voc = _subset_vocabulary(src, cfg.vocab_size)
    if len(voc["tokens"]) != cfg.vocab_size:
        raise ValueError(f"{tokenizer_from} has {len(voc['tokens'])} tokens, fewer than {cfg.vocab_size}")
    h, d, q, kv = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: list[tuple[str, str, int, int]] = [("token_embd.weight", mix["token_embd"], cfg.vocab_size, h)]
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        shapes += [(p + "attn_norm.weight", "F32", 1, h), (p + "ffn_norm.weight", "F32", 1, h)]
        shapes += [(p + f"{n}.weight", mix[n], r, c) for n, r, c in (
            ("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q),
            ("ffn_gate", cfg.intermediate_size, h), ("ffn_up", cfg.intermediate_size, h),
            ("ffn_down", h, cfg.intermediate_size))]
    shapes.append(("output_norm.weight", "F32", 1, h))
    if not cfg.tie_embeddings:
        shapes.append(("output.weight", mix["output"], cfg.vocab_size, h))
    if rope_factors is not None:
        shapes.append(("rope_freqs.weight", "F32", 1, d // 2))

    w = GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(h)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    _add_tokenizer(w, src, voc, cfg.vocab_size)
    for tname, kind, rows, cols in shapes:
        if kind == "F32":
            nbytes, shape, dt = rows * cols * 4, [cols] if rows == 1 else [rows, cols], np.dtype(np.float32)
            w.add_tensor_info(tname, shape, dt, nbytes)
        else:
            row_bytes = cols // block_inputs(kind) * BLOCK_BYTES[kind]
            w.add_tensor_info(tname, [rows, row_bytes], np.dtype(np.uint8), rows * row_bytes,
                              raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, kind, rows, cols in tqdm(shapes, desc=f"writing {path.name}", disable=not progress, unit="tensor"):
        if tname == "rope_freqs.weight":
            data = np.asarray(rope_factors, dtype=np.float32)
        elif kind == "F32":
            data = np.ones(cols, dtype=np.float32)  # RMSNorm weights
        else:
            std = 1.0 if tname == "token_embd.weight" else 1.0 / math.sqrt(cols)
            data = random_blocks(kind, rows, cols, rng, std)
        w.write_tensor_data(data)
    w.close()
