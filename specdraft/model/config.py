"""Model configuration for the decoder (Llama, Qwen2, Qwen3, SmolLM, Mistral, Gemma 3)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.errors import SpecdraftError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}  # HF model_type -> arch, where they differ
GEMMA3_SLIDING_PATTERN = 6  # Gemma 3: every 6th layer attends globally, the others in the window
GEMMA3_LOCAL_THETA = 10000.0  # Gemma 3: the windowed layers' RoPE base (the global layers': rope_theta)


def check_int(what: str, value, minimum: int = 1) -> int:
    """``value`` if it is a whole number >= ``minimum`` (not a bool, a str, a float), else one SpecdraftError
    naming ``what`` (e.g. "config.json: hidden_size", "FILE: metadata llama.block_count")."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecdraftError(f"{what} is {value!r}, not a whole number >= {minimum}")
    return value


def check_positive(what: str, value) -> float:
    """``value`` as a float if it is a finite number > 0, else one SpecdraftError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecdraftError(f"{what} is {value!r}, not a positive number")
    return float(value)


@dataclass
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS (HF `model_type`; "gemma3" for HF's "gemma3_text")
    vocab_size: int  # rows of the embedding / LM head
    hidden_size: int  # residual stream width H
    intermediate_size: int  # gated MLP inner width
    num_layers: int  # decoder blocks L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int  # per-head width (Qwen3 sets it explicitly; else H / num_heads)
    rms_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict[str, Any] | None = None  # only the "llama3" scheme is supported
    max_position: int = 4096  # context length the model was trained for
    tie_embeddings: bool = False  # LM head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE
    sliding_window: int | None = None  # a windowed layer's query sees the last W positions; None = full attention
    layer_types: list[str] | None = None  # per layer "sliding" or "full" (Gemma 3); None: all "sliding" if windowed
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (Gemma 3: 10000); None = rope_theta
    activation: str = "silu"  # the gated MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    embed_scale: float = 1.0  # embedding rows are multiplied by this (Gemma: sqrt(H)); the LM head is not
    sandwich_norms: bool = False  # Gemma 3: RMSNorm on the attention's and the MLP's outputs before each add
    query_scale: float | None = None  # attention logits q.k times this (Gemma: query_pre_attn_scalar^-1/2); None = 1/sqrt(D)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # generation stops on any of these

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "gelu_tanh"):
            raise SpecdraftError(f"unsupported MLP activation {self.activation!r} (silu or gelu_tanh)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {"sliding", "full"}:
                raise SpecdraftError(f"layer types {self.layer_types!r}: one of \"sliding\" / \"full\" per layer "
                                     f"({self.num_layers})")
            if self.sliding_window is None and "sliding" in self.layer_types:
                raise SpecdraftError("sliding layers without a sliding window")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def window(self, layer: int) -> int | None:
        """The attention window of block ``layer`` (0-based): ``sliding_window`` for a sliding layer, else None."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] == "full"):
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether block ``layer`` rotates by the sliding layers' own RoPE base (``rope_local_theta``)."""
        return self.rope_local_theta is not None and self.window(layer) is not None

    @property
    def mlp_norm_key(self) -> str:
        """The HF name (in a layer) of the RMSNorm before the MLP: Llama's "post_attention_layernorm" is
        Gemma's norm after the attention; Gemma's pre-MLP norm is "pre_feedforward_layernorm"."""
        return "pre_feedforward_layernorm" if self.sandwich_norms else "post_attention_layernorm"

    def check_layers(self, layers, what: str = "feature layer") -> None:
        """Raise SpecdraftError unless every index in ``layers`` names a hidden state this model has
        (0 = embeddings, i = output of block i, -1 = the final normed state)."""
        bad = [x for x in layers if not -1 <= x <= self.num_layers]
        if bad:
            raise SpecdraftError(f"{what} {bad[0]} does not exist (the target has {self.num_layers} layers; "
                                 "0 = embeddings, -1 = final)")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dictionary (types and ranges checked: a malformed file
        is one SpecdraftError naming the field)."""
        if not isinstance(hf, dict):
            raise SpecdraftError(f"config.json holds a {type(hf).__name__}, not an object")
        arch = hf.get("model_type", "")
        arch = HF_MODEL_TYPES.get(arch, arch) if isinstance(arch, str) else arch
        if arch not in SUPPORTED_ARCHS:
            raise SpecdraftError(
                f"unsupported model_type {arch!r}; specdraft supports {', '.join(SUPPORTED_ARCHS)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in hf]
        if missing:
            raise SpecdraftError(f"config.json lacks {', '.join(missing)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if hf[key] is None:
                raise SpecdraftError(f"config.json: {key} is null")
            check_int(f"config.json: {key}", hf[key])
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
            if hf.get(key) is not None:
                check_int(f"config.json: {key}", hf[key])
        check_positive("config.json: rms_norm_eps", hf.get("rms_norm_eps", 1e-6))
        for key in ("rope_parameters", "rope_scaling"):
            if hf.get(key) is not None and not isinstance(hf[key], dict):
                raise SpecdraftError(f"config.json: {key} is {hf[key]!r}, not an object")
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        if heads % kv:
            raise SpecdraftError(f"config.json: {heads} attention heads cannot share {kv} key/value heads evenly")
        if not hf.get("head_dim") and hf["hidden_size"] % heads:
            raise SpecdraftError(f"config.json: hidden_size {hf['hidden_size']} is not a multiple of {heads} heads")
        if hf.get("attention_bias") and arch != "qwen2":  # Qwen2's bias is on q/k/v only; the others' on W_o too
            raise SpecdraftError(f"config.json: attention_bias on a {arch} model puts a bias on the attention's output "
                                 "projection, which specdraft does not support")
        rope = hf.get("rope_parameters") or {}
        gemma = _gemma3_fields(hf) if arch == "gemma3" else {}
        if gemma:
            rope = rope.get("full_attention", rope)  # per layer type: the global layers' here, the local ones' in gemma
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        check_positive("config.json: rope_theta", theta)
        scaling = hf.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind != "llama3":
                raise SpecdraftError(f"unsupported rope scaling {kind!r} (supported: llama3)")
            else:
                for key in ("factor", "original_max_position_embeddings"):
                    check_positive(f"config.json: rope scaling {key}", scaling.get(key))
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else eos)
        if not isinstance(eos_ids, list) or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids):
            raise SpecdraftError(f"config.json: eos_token_id is {eos!r}, not a token id or a list of them")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", arch in ("mistral", "gemma3")) else None
        if gemma and window is None:
            gemma["layer_types"] = None
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=hf.get("max_position_embeddings", 4096),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            **{"tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qk_norm": arch == "qwen3", **gemma},
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The equivalent Hugging Face config dictionary (used to build HF reference models)."""
        hf: dict[str, Any] = {
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = dict(self.rope_scaling)
        if self.arch == "llama":
            hf["attention_bias"] = self.qkv_bias
        if self.sliding_window is not None:
            hf["sliding_window"] = self.sliding_window
            hf["use_sliding_window"] = True
        if self.arch == "gemma3":
            types = self.layer_types or ["full"] * self.num_layers
            d = self.head_dim
            hf.update(model_type="gemma3_text", hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=round((self.query_scale or d ** -0.5) ** -2),
                      layer_types=[f"{t}_attention" for t in types], final_logit_softcapping=None,
                      attn_logit_softcapping=None, sliding_window=self.sliding_window or self.max_position,
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": self.rope_theta},
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": self.rope_local_theta or self.rope_theta}})
            del hf["rope_theta"]
        return hf


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of an HF Gemma 3 text config (``gemma3_text``) beyond the Llama ones."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise SpecdraftError(f"config.json: {key} {hf[key]!r} is not supported (Gemma 2's soft-capping)")
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise SpecdraftError(f"config.json: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or not set(types) <= {"full_attention", "sliding_attention"}:
        raise SpecdraftError(f"config.json: layer_types {types!r} is not full_/sliding_attention per layer")
    rope = hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention", {}) if isinstance(rope.get("sliding_attention"), dict) else {}
    for kind in (rope.get("full_attention", {}), local):
        if isinstance(kind, dict) and kind.get("rope_type", "default") != "default":
            raise SpecdraftError(f"unsupported rope scaling {kind.get('rope_type')!r} for Gemma 3 (default only)")
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
    check_positive("config.json: the sliding layers' rope_theta", local_theta)
    scalar = check_positive("config.json: query_pre_attn_scalar", hf.get("query_pre_attn_scalar", hf.get("head_dim", 256)))
    return {"layer_types": [t.removesuffix("_attention") for t in types], "rope_local_theta": float(local_theta),
            "activation": "gelu_tanh", "embed_scale": math.sqrt(hf["hidden_size"]), "sandwich_norms": True,
            "qk_norm": True, "query_scale": scalar ** -0.5, "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}
