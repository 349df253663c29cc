"""Model configuration for the Llama-family decoder (Llama, Qwen2, Qwen3, SmolLM, Mistral)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from specdraft.errors import SpecdraftError

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


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
    arch: str  # one of SUPPORTED_ARCHS (HF `model_type`)
    vocab_size: int  # rows of the embedding / LM head
    hidden_size: int  # residual stream width H
    intermediate_size: int  # SwiGLU inner width
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
    sliding_window: int | None = None  # Mistral's window; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)  # generation stops on any of these

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        rope = hf.get("rope_parameters") or {}
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
        window = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "mistral") else None
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
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
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
        return hf
