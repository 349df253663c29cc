"""Drafter checkpoints: safetensors weights plus a JSON manifest in the file's metadata.

The manifest records the drafter's kind, its config and the target it was trained for (name +
weight hash); ``load_draft_model`` refuses a checkpoint made for another target, a corrupt file,
one of another kind or one that does not fit the target, each with a clear error.  Only
safetensors is read, never pickles.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specdraft.errors import SpecdraftError, SpecdraftNote
from specdraft.nn.block import BlockConfig, BlockModel
from specdraft.nn.eagle3 import Eagle3Config, Eagle3Model
from specdraft.nn.hybrid import HybridConfig, HybridModel
from specdraft.nn.phrase import PhraseHead, PhraseHeadConfig, PhraseVocab

MANIFEST_KEY = "specdraft_manifest"
MODELS = {"hybrid": (HybridConfig, HybridModel), "block": (BlockConfig, BlockModel),
          "eagle3": (Eagle3Config, Eagle3Model)}  # kind -> (config, network)


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    """Write atomically (temp file + rename) so an interrupted save never leaves a torn file."""
    for key in ("kind", "target_name", "target_hash"):
        if key not in manifest:
            raise ValueError(f"checkpoint manifest needs {key!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(flat, str(tmp), metadata={MANIFEST_KEY: json.dumps(manifest)})
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, target_hash: str | None = None, kind: str | None = None):
    """Returns (tensors, manifest).  Raises SpecdraftError for a missing, corrupt or mismatched file."""
    path = Path(path)
    if not path.is_file():
        raise SpecdraftError(f"checkpoint {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several internal error types for bad files
        raise SpecdraftError(f"checkpoint {path} is corrupt or not a safetensors file ({e})") from None
    if MANIFEST_KEY not in meta:
        raise SpecdraftError(f"checkpoint {path} has no specdraft manifest")
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise SpecdraftError(f"checkpoint {path}: tensor {name} holds NaN or infinite values")
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except json.JSONDecodeError:
        raise SpecdraftError(f"checkpoint {path} has a corrupt manifest") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("kind"), str):
        raise SpecdraftError(f"checkpoint {path} has a corrupt manifest (not an object with a drafter kind)")
    if kind is not None and manifest.get("kind") != kind:
        raise SpecdraftError(f"checkpoint {path} is a {manifest.get('kind')!r} drafter, not {kind!r}")
    if target_hash is not None and manifest.get("target_hash") != target_hash:
        raise SpecdraftError(
            f"checkpoint {path} was trained for target {manifest.get('target_name')!r} "
            f"(weights {str(manifest.get('target_hash'))[:12]}), not the loaded target "
            f"(weights {target_hash[:12]}); train a drafter for this target"
        )
    return tensors, manifest


def check_fits(cfg, target, path: str | Path) -> None:
    """Raise SpecdraftError unless a drafter config (``hidden_size``, ``vocab_size``,
    ``feature_layers``) fits ``target``: the checks every target-reading drafter shares."""
    tcfg = target.config
    if cfg.hidden_size != tcfg.hidden_size or cfg.vocab_size != tcfg.vocab_size:
        raise SpecdraftError(f"checkpoint {path} does not fit the target (hidden size {cfg.hidden_size}, "
                             f"vocabulary {cfg.vocab_size})")
    shape = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")  # drafter layers take the target's shape
    off = [f"{k} {getattr(cfg, k)} (the target's: {getattr(tcfg, k)})" for k in shape if getattr(cfg, k) != getattr(tcfg, k)]
    if off:
        raise SpecdraftError(f"checkpoint {path} does not fit the target: {', '.join(off)}")
    if not 0 <= cfg.draft_vocab <= tcfg.vocab_size:
        raise SpecdraftError(f"checkpoint {path}: draft_vocab {cfg.draft_vocab} is not in 0 .. {tcfg.vocab_size}")
    if not -1 <= getattr(cfg, "mask_token", -1) < tcfg.vocab_size:
        raise SpecdraftError(f"checkpoint {path}: mask_token {cfg.mask_token} is not a token of the target")
    tcfg.check_layers(cfg.feature_layers, f"checkpoint {path}: its target layer")


def checkpoint_manifest(path: str | Path) -> dict:
    """A checkpoint's manifest, read from its header alone (no tensors loaded)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            manifest = json.loads((f.metadata() or {})[MANIFEST_KEY])
        if not isinstance(manifest, dict) or not isinstance(manifest.get("kind"), str):
            raise TypeError(manifest)
        return manifest
    except Exception:  # safetensors' own error types, a missing key, bad JSON: all the same to the user
        raise SpecdraftError(f"{path} is not a specdraft drafter checkpoint (corrupt or missing manifest)") from None


def checkpoint_kind(path: str | Path) -> str:
    """The drafter kind a checkpoint's manifest states ("phrase", "hybrid", "eagle3", "block")."""
    return checkpoint_manifest(path)["kind"]


@dataclass
class DraftCheckpoint:
    model: nn.Module  # the network, on the target's device (hybrid/block: in the target's dtype; phrase: fp32)
    manifest: dict  # the checkpoint's manifest (config, training record, budget profile)
    vocab: PhraseVocab | None = None  # phrase only: the draft vocabulary the head scores


def target_identity(target) -> dict:
    """The manifest fields naming the target a drafter is trained for: its name, its weights' hash and
    its model fingerprint (``model.load.model_fingerprint``: the same for any quantization of it)."""
    return {"target_name": target.name, "target_hash": target.weight_hash,
            "target_model": getattr(target, "model_hash", None)}


def fits_target(manifest: dict, target) -> bool:
    """Whether a checkpoint was trained for ``target``: these weights, or another quantization of its model."""
    model = manifest.get("target_model")
    return manifest.get("target_hash") == target.weight_hash or (
        model is not None and model == getattr(target, "model_hash", None))


def check_target(manifest: dict, target, path: str | Path, any_target: bool = False) -> None:
    """Accept a checkpoint for ``target``: trained on these weights; or on another quantization of the same
    model (same fingerprint: one note); or, asked with ``any_target``, on any model it fits (one warning).
    Anything else is one SpecdraftError saying which model it was made for."""
    if manifest.get("target_hash") == target.weight_hash:
        return
    trained = f"{manifest.get('target_name')!r} (weights {str(manifest.get('target_hash'))[:12]})"
    here = f"{target.name!r} (weights {target.weight_hash[:12]})"
    if fits_target(manifest, target):
        warnings.warn(f"{Path(path).name} was trained on {trained}; the loaded target {here} is the same model in "
                      "another quantization: lossless, its acceptance may differ a little", SpecdraftNote, stacklevel=3)
    elif any_target:
        warnings.warn(f"specdraft: {path} was trained for {trained}, used on {here} as asked (any_target=1): "
                      "lossless, but its acceptance was measured on the other weights", stacklevel=3)
    else:
        what = "another model (its architecture, shapes or vocabulary differ)" if manifest.get("target_model") is not None else \
            "another target (its manifest names no model fingerprint to match quantizations by)"
        raise SpecdraftError(f"checkpoint {path} was trained for target {trained}, not the loaded target {here}: "
                             f"{what}; train a drafter for this target (NAME@any_target=1 uses it anyway where "
                             "its shapes fit)")


def load_draft_model(target, path: str | Path, kind: str, any_target: bool = False) -> DraftCheckpoint:
    """The trained drafter network of ``kind`` in checkpoint ``path``, built for ``target`` (its
    frozen embeddings and LM-head rows shared), with the target-fit checks (``check_target``: these
    weights or another quantization of the same model; ``any_target``: any target whose shapes fit)."""
    tensors, manifest = load_checkpoint(path, kind=kind)
    check_target(manifest, target, path, any_target)
    tm = target.model
    try:
        if kind == "phrase":
            hcfg = PhraseHeadConfig(**manifest["head"])
            vocab = PhraseVocab.from_json(manifest["vocab"])
            if (hcfg.hidden_size != target.config.hidden_size or len(vocab) != hcfg.vocab_size
                    or not isinstance(hcfg.bottleneck, int) or not 1 <= hcfg.bottleneck <= 1 << 16):
                raise SpecdraftError(f"checkpoint {path} does not fit the target (hidden size {hcfg.hidden_size}, "
                                     f"{hcfg.vocab_size} entries for a vocabulary of {len(vocab)}, bottleneck "
                                     f"{hcfg.bottleneck!r})")
            n = target.config.vocab_size
            bad = next((e for e in vocab.expansions if not e or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < n for x in e)), None)
            if bad is not None:
                raise SpecdraftError(f"its phrase vocabulary holds {bad!r}: each entry must be 1 or more token ids "
                                     f"in [0, {n})")
            head = PhraseHead(hcfg)
            head.load_state_dict({k: v.float() for k, v in tensors.items()})
            return DraftCheckpoint(head.to(target.device), manifest, vocab)
        config_cls, model_cls = MODELS[kind]
        cfg = config_cls.from_json(manifest["config"])
        check_fits(cfg, target, path)
        model = model_cls(cfg, tm.embed.weight, tm.lm_head.weight, tensors["vocab_ids"].to(tm.device))
        model.load_state_dict(tensors)
    except (KeyError, TypeError, RuntimeError, IndexError, ValueError, AttributeError) as e:
        raise SpecdraftError(f"checkpoint {path} does not hold a valid {kind} drafter ({e})") from None
    except SpecdraftError as e:  # a field of its manifest's config
        raise SpecdraftError(f"checkpoint {path}: {e}") from None
    return DraftCheckpoint(model.to(device=target.device, dtype=tm.dtype), manifest)
