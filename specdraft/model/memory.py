"""How much memory loading a target will take, and how much there is: refuse with one line, before the
kernel's OOM killer would stop the process halfway.

Estimates (bytes), from the tensor table alone:
- fast mode, a GGUF: the packed blocks (each projection and the head as stored; float ones as Q8_0,
  34 bytes per 32 weights), the fp32 vectors, the KV cache, and a fixed base for the runtime (torch,
  the tokenizer, buffers);
- exact mode: 4 bytes per weight twice (the fp32 state dict and the model built from it live side by
  side while it loads), the blocks the exact kernel also reads (Q4_1 / Q8_0), the KV cache and the base.
Available: ``MemAvailable`` of /proc/meminfo, and the cgroup's limit less its use where one is set.
``SPECDRAFT_MEMORY_CHECK=0`` skips the check.
"""

from __future__ import annotations

import os
from pathlib import Path

from specdraft.errors import SpecdraftError

BASE = 400 << 20  # torch, the tokenizer, activations and the Python objects of a loaded target
KV_SLOTS = 4096  # the KV cache an estimate allows for (a prompt and its answer; the server takes more)
GiB = float(1 << 30)


def available() -> int | None:
    """Bytes this process can still take, or None where it cannot tell (not Linux)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            text = Path(limit).read_text().strip()
            if text != "max" and int(text) < (1 << 60):
                room = int(text) - int(Path(usage).read_text().strip())
                avail = room if avail is None else min(avail, room)
            break
        except (OSError, ValueError):
            continue
    return avail


def kv_bytes(layers: int, kv_heads: int, head_dim: int, slots: int = KV_SLOTS) -> int:
    return layers * 2 * kv_heads * head_dim * slots * 4


def check(name: str, mode: str, need: int, parts: str, alternative: tuple[str, int] | None = None) -> None:
    """Raise SpecdraftError when ``need`` bytes are more than this machine has available; ``alternative``
    (another mode, its need) is named in the message when that would fit."""
    if os.environ.get("SPECDRAFT_MEMORY_CHECK", "1") == "0":
        return
    have = available()
    if have is None or need <= have:
        return
    hint = (f"; the {alternative[0]} mode would need {alternative[1] / GiB:.1f} GiB"
            if alternative is not None and alternative[1] <= have else "")
    raise SpecdraftError(f"{name} needs about {need / GiB:.1f} GiB in the {mode} mode ({parts}), and this machine "
                         f"has {have / GiB:.1f} GiB available{hint} (SPECDRAFT_MEMORY_CHECK=0 tries anyway)")


def give_back() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``): freed tensors under the mmap
    threshold stay in the heap otherwise, and the resident size would not come down.  A no-op elsewhere."""
    import ctypes
    import ctypes.util

    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc = None  # ctypes' libc, once looked up (False: none with malloc_trim)
