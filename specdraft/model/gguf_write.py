"""Write a Llama-family model as a GGUF file whose projections are in any block format (``model.blocks``):
test models of any shape and quantization mix, with gguf-py's ``GGUFWriter`` for the container."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from torch import Tensor

from specdraft.model.blocks import quantize
from specdraft.model.config import ModelConfig

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (what ``load._reverse_rope_permute`` undoes)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.N.<module>.weight
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{leaf}"


def write_gguf(path: Path, cfg: ModelConfig, sd: dict[str, Tensor], kind_of: Callable[[str, Tensor], str],
               name: str = "test-model", stored: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """``sd``: HF-named fp32 tensors of a llama-architecture model (tied embeddings: no lm_head);
    ``kind_of(hf_name, tensor)``: its GGUF type ("F32" or a block format; 1-D tensors are always F32).
    ``stored``: tensors given as (any GGML type name, its block bytes [rows, row_bytes]) instead, written as
    they are (q/k rows already in llama.cpp's order)."""
    w = GGUFWriter(str(path), "llama")
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
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        w.add_eos_token_id(cfg.eos_token_ids[0])
    for hf, (kind, data) in (stored or {}).items():
        w.add_tensor(gguf_name(hf), data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])
    for hf, t in sd.items():
        if hf in (stored or {}):
            continue
        a = t.detach().float().cpu().numpy()
        if hf.endswith(("q_proj.weight", "k_proj.weight")):
            a = _rope_permute(a, cfg.num_heads if "q_proj" in hf else cfg.num_kv_heads)
        kind = "F32" if a.ndim == 1 else kind_of(hf, t)
        if kind == "F32":
            w.add_tensor(gguf_name(hf), np.ascontiguousarray(a, dtype=np.float32))
        else:
            raw = quantize(a, kind)
            w.add_tensor(gguf_name(hf), raw.data, raw_shape=raw.data.shape, raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
