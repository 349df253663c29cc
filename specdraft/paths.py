"""Output and input paths checked before any work starts: a run never does minutes of work and then fails
to write its result (``--out`` under a file, in a read-only folder, under /proc or /sys)."""

from __future__ import annotations

import os
from pathlib import Path

from specdraft.errors import SpecdraftError

_PSEUDO = (Path("/proc"), Path("/sys"), Path("/dev"))


def _check_ancestors(p: Path, what: str) -> None:
    """The nearest existing ancestor of ``p`` must be a writable folder, outside the kernel's pseudo-filesystems."""
    real = Path(os.path.realpath(p))
    if any(real == d or d in real.parents for d in _PSEUDO):
        raise SpecdraftError(f"{what} {p} is under {next(d for d in _PSEUDO if real == d or d in real.parents)}, "
                             "which holds no files")
    anc = p.parent if p != p.parent else p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise SpecdraftError(f"{what} {p} cannot be made: {anc} is a file, not a folder")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise SpecdraftError(f"{what} {p} cannot be made: {anc} is not writable")


def writable_folder(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a folder that exists or can be made."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise SpecdraftError(f"{what} {p} is a file, not a folder")
    if p.exists():
        if not os.access(p, os.W_OK | os.X_OK):
            raise SpecdraftError(f"{what} {p} is not writable")
        return p
    _check_ancestors(p, what)
    return p


def writable_file(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a file that can be written (it may exist: a resumed run)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise SpecdraftError(f"{what} {p} is a folder, not a file")
    _check_ancestors(p, what)
    return p


def existing_folder(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise SpecdraftError(f"{what} {p} is not a folder" if p.exists() else f"{what} {p} not found")
    return p
