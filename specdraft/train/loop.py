"""The training loop's shared parts: AdamW parameter groups, the one learning-rate schedule,
resumable state, the fp16 checkpoint, and training across processes.

Across processes (``torchrun --nproc-per-node N`` or ``accelerate launch``, which set ``WORLD_SIZE``,
``RANK`` and ``LOCAL_RANK``): every rank builds the same global batch from the same seeded generators
and trains on its own share of the sequences (``shard_rows``); DistributedDataParallel averages the
gradients (gloo on the CPU, nccl on GPUs).  A trainer divides its loss by the whole batch's label
counts (every rank has the whole batch) and multiplies by the world size, so the averaged gradient is the one-process
gradient of the whole batch: the same global batch and seed give the same weights up to float
rounding.  Rank 0 logs, evaluates and writes the resume state and the checkpoint.

Resumable state: weights, optimizer moments and a JSON ``meta`` in one safetensors file next to
the checkpoint being trained (``OUT.resume.safetensors``), written atomically by the trainers;
``meta["fingerprint"]`` says which run configuration it belongs to, and a re-run of the same
command resumes from it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import distributed as dist
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import save_checkpoint


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or embeddings' 1-D rows)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr)


def set_lr(opt: torch.optim.Optimizer, lr: float, step: int, total: int, warmup: int) -> None:
    """The schedule of every trainer: linear warm-up over ``warmup`` steps, then cosine from ``lr``
    to zero at step ``total``: lr * min(1, (step+1)/warmup) * (1 + cos(pi * step/total)) / 2."""
    f = min(1.0, (step + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(step, total) / max(1, total)))
    for grp in opt.param_groups:
        grp["lr"] = lr * f


def state_path(out: Path) -> Path:
    return out.with_name(out.name + ".resume.safetensors")


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, where: str,
                   clip: float | None = 1.0) -> float:
    """One update: gradients of ``loss``, clipped to norm ``clip`` (None = not clipped), an
    optimizer step; returns the loss, refusing a non-finite one (``where``: e.g. "at step 12")."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    value = float(loss.detach())
    if not math.isfinite(value):
        raise SpecdraftError(f"the training loss is not finite ({value}) {where}; lower --lr")
    return value


def save_state(path: Path, model: nn.Module, opt: torch.optim.Optimizer, meta: dict) -> None:
    """Weights, optimizer moments and ``meta`` (JSON) in one safetensors file, written atomically."""
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
    with safe_open(str(path), framework="pt") as f:
        return json.loads((f.metadata() or {}).get("meta", "{}")).get("fingerprint")


def resume(path: Path, fingerprint: dict, model: nn.Module, opt: torch.optim.Optimizer, log) -> dict | None:
    """Load the state at ``path`` into ``model`` and ``opt`` if it belongs to this run (same
    ``fingerprint``) and return its ``meta``; None (start over) for none, another run's or a torn one."""
    if not path.is_file():
        return None
    try:
        meta = load_state(path, model, opt) if fingerprint_of(path) == fingerprint else None
    except Exception as e:  # a torn or foreign state file: start over rather than fail
        log(f"ignoring {path}: {e}")
        return None
    if meta is None:
        log(f"ignoring {path}: it belongs to another run configuration")
    return meta


def save_fp16(out: Path, state: dict[str, torch.Tensor], manifest: dict) -> None:
    """The trained drafter as its checkpoint (floating tensors in fp16, ids as they are); the resume
    state is no longer needed."""
    save_checkpoint(out, {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in state.items()}, manifest)
    state_path(out).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- across processes


@dataclass(frozen=True)
class Ranks:
    """This process's place in a training run across processes (rank 0 of 1 when alone)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Whether this process logs, evaluates and writes files."""
        return self.rank == 0


def join_ranks(device: str = "cpu") -> Ranks:
    """Join the process group a launcher set up (``WORLD_SIZE`` > 1), once: nccl on GPUs (each rank on
    ``cuda:LOCAL_RANK``), gloo on the CPU.  Alone: ``Ranks()``; nothing is initialised."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    if not dist.is_initialized():
        cuda = str(device).startswith("cuda")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    return current_ranks()


def current_ranks() -> Ranks:
    """The process group this process is in (``Ranks()`` if none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Ranks()
    return Ranks(dist.get_rank(), dist.get_world_size())


def shard_rows(n: int, ranks: Ranks) -> slice:
    """The rows of an n-row global batch this rank trains on (contiguous, sizes differing by <= 1)."""
    lo = n * ranks.rank // ranks.world
    return slice(lo, n * (ranks.rank + 1) // ranks.world)


def all_sum(values: list[float], ranks: Ranks, device="cpu") -> list[float]:
    """Element-wise sums over ranks (the values themselves when alone)."""
    if ranks.world == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(ranks: Ranks) -> None:
    """Wait for every rank (e.g. until rank 0 has written a file)."""
    if ranks.world > 1:
        dist.barrier()
