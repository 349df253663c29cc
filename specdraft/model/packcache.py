"""The fast kernels' packed weights of a GGUF, kept on disk so that a second load only reads them.

Repacking a GGUF's blocks into ``fast.cpp``'s layout is numpy work, about 10 ns a byte (1 s for the
default 92 MB model, ~50 s for an 8B Q4_K_M).  The packed tensors of one file are written once as a
safetensors file (the format: u64 header length, JSON header of dtype / shape / byte range per tensor,
then the bytes), named by the GGUF's sha256 and a hash of the packing code, under
``<cache>/packed``.  Reading goes tensor by tensor into fresh buffers (no mapping, so the process never
holds both the file's pages and its own copy).  The folder is kept under ``SPECDRAFT_PACK_CACHE_GB``
(default 20): the least recently used files go first, and a file alone over the limit is not cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch

from specdraft.model.fast import FastWeight

_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float32: "F32", torch.int32: "I32"}
_TORCH = {v: k for k, v in _DTYPES.items()}
DEFAULT_LIMIT_GB = 20.0


def layout_version() -> str:
    """A hash of the code that decides the packed layout (a change there makes old files unused)."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("blocks.py", "fast.py", "fast.cpp"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def limit_bytes() -> int:
    raw = os.environ.get("SPECDRAFT_PACK_CACHE_GB", "")
    try:
        gb = float(raw) if raw else DEFAULT_LIMIT_GB
    except ValueError:
        gb = DEFAULT_LIMIT_GB
    return int(max(gb, 0.0) * 2**30)


def cache_path(root: Path, weight_hash: str) -> Path:
    return root / "packed" / f"{weight_hash[:24]}-{layout_version()}.safetensors"


def _key(names: list[str]) -> str:
    return "+".join(names)


def save(path: Path, weights: list[FastWeight], names: list[list[str]]) -> str:
    """Write ``weights`` (each packed from the GGUF tensors ``names[i]``) at ``path``; returns "" or why
    not (over the size limit, no room on disk, a write error), leaving nothing half-written."""
    header: dict = {}
    meta = []
    off = 0
    tensors = []
    for w, ns in zip(weights, names):
        key = _key(ns)
        meta.append({"key": key, "rows": w.rows, "cols": w.cols, "parts": [[k, r] for k, r, _ in w.parts]})
        for i, (_, _, ts) in enumerate(w.parts):
            for j, t in enumerate(ts):
                t = t.contiguous()
                n = t.numel() * t.element_size()
                header[f"{key}/{i}/{j}"] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
                tensors.append(t)
                off += n
    header["__metadata__"] = {"specdraft": json.dumps(meta)}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    total = 8 + len(blob) + off
    limit = limit_bytes()
    if total > limit:
        return f"{total / 2**30:.1f} GiB is over the cache limit of {limit / 2**30:.1f} GiB (SPECDRAFT_PACK_CACHE_GB)"
    path.parent.mkdir(parents=True, exist_ok=True)
    _make_room(path.parent, total, limit)
    free = shutil.disk_usage(path.parent).free
    if free < total + (1 << 30):
        return f"only {free / 2**30:.1f} GiB free on {path.parent}"
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in tensors:
                f.write(t.numpy().tobytes() if t.numel() else b"")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        return f"cannot write {path}: {e.strerror or e}"
    return ""


def _make_room(folder: Path, need: int, limit: int) -> None:
    """Delete the least recently used packed files until ``need`` more bytes stay under ``limit``."""
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_atime)
    used = sum(p.stat().st_size for p in files)
    while files and used + need > limit:
        old = files.pop(0)
        used -= old.stat().st_size
        old.unlink(missing_ok=True)


def load(path: Path) -> dict[str, FastWeight] | None:
    """The packed weights at ``path`` by their GGUF tensor names ("a+b+c" for a fused projection), or
    None when there is no such file or it cannot be read (then the caller repacks and writes it again)."""
    try:
        f = open(path, "rb")
    except OSError:
        return None
    try:
        with f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            meta = json.loads(header.pop("__metadata__")["specdraft"])
            base = 8 + n
            out = {}
            for m in meta:
                parts = []
                for i, (kind, rows) in enumerate(m["parts"]):
                    ts = []
                    for j in range(4):
                        h = header[f"{m['key']}/{i}/{j}"]
                        t = torch.empty(h["shape"], dtype=_TORCH[h["dtype"]])
                        a, b = h["data_offsets"]
                        if b > a:
                            f.seek(base + a)
                            if f.readinto(memoryview(t.numpy()).cast("B")) != b - a:
                                return None
                        ts.append(t)
                    parts.append((kind, rows, ts))
                out[m["key"]] = FastWeight(m["rows"], m["cols"], parts)
        os.utime(path)  # recently used
        return out
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        warnings.warn(f"specdraft: ignoring the unreadable packed-weight cache {path} ({e}); repacking", stacklevel=2)
        return None


def lookup(cached: dict[str, FastWeight] | None):
    """``Transformer.attach_fast``'s ``pack`` argument: the cached FastWeight for a list of names."""
    def pack(names: list[str], parts) -> FastWeight | None:
        if cached is None:
            return None
        w = cached.get(_key(names))
        if w is None or w.rows != sum(p.rows for p in parts) or [k for k, _, _ in w.parts] != [p.kind for p in parts]:
            return None
        return w
    return pack

