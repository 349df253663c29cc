"""Drafter checkpoints: safetensors weights plus a JSON manifest in the file's metadata.

The manifest records the drafter's config and the target it was trained for (name + weight
hash); loading refuses a checkpoint made for another target, or a corrupt file, with a clear
error.  Only safetensors is read, never pickles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specdraft.errors import SpecdraftError

MANIFEST_KEY = "specdraft_manifest"


def save_checkpoint(path: str | Path, tensors: dict[str, torch.Tensor], manifest: dict) -> None:
    """Write atomically (temp file + rename) so an interrupted save never leaves a torn file."""
    from safetensors.torch import save_file

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
    from safetensors import safe_open

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
    try:
        manifest = json.loads(meta[MANIFEST_KEY])
    except json.JSONDecodeError:
        raise SpecdraftError(f"checkpoint {path} has a corrupt manifest") from None
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
    bad = [x for x in cfg.feature_layers if not -1 <= x <= tcfg.num_layers]
    if bad:
        raise SpecdraftError(f"checkpoint {path} reads target layer {bad[0]}, which the target lacks")
