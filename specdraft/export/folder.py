"""Writing an export folder all or nothing: into a temporary sibling first, renamed into place at the end."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from specdraft.errors import SpecdraftError
from specdraft.paths import writable_folder


def check_out(out: str | Path, force: bool) -> Path:
    """``out`` as a Path, refused if it exists and is not an empty folder (unless ``force``) or is a file."""
    out = Path(out).expanduser()
    if out.is_symlink():
        raise SpecdraftError(f"{out} is a symbolic link; the export writes a folder of its own there (remove the link)")
    writable_folder(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not out.is_dir():
            raise SpecdraftError(f"{out} exists and is not an empty folder (it is a file)")
        if not force:
            raise SpecdraftError(f"{out} exists and is not an empty folder (--force replaces it)")
    return out


@contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """Yields an empty temporary folder next to ``out``; on success it replaces ``out``, on any error
    it is removed and ``out`` is left as it was."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
