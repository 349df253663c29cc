"""Resumable training state: weights, optimizer moments and a JSON ``meta`` in one safetensors
file next to the checkpoint being trained (``OUT.resume.safetensors``), written atomically after
every epoch; ``meta["fingerprint"]`` says which run configuration it belongs to."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def state_path(out: Path) -> Path:
    return out.with_name(out.name + ".resume.safetensors")


def save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict) -> None:
    """Weights, optimizer moments and ``meta`` (JSON) in one safetensors file, written atomically."""
    from safetensors.torch import save_file

    sd = opt.state_dict()
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            tensors[f"opt.{pid}.{name}"] = torch.as_tensor(value).clone()
    meta = {**meta, "param_groups": sd["param_groups"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
    tmp.replace(path)


def load_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["meta"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, pid, name = k.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    opt.load_state_dict({"state": state, "param_groups": meta.pop("param_groups")})
    return meta


def fingerprint_of(path: Path) -> dict | None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}")).get("fingerprint")
