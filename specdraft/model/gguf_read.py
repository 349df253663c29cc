"""Read a GGUF file's header, metadata and tensor table directly, in milliseconds, and its tensors' bytes.

The container (ggml's ``docs/gguf.md``), all little-endian:

    magic "GGUF" | version u32 (2 or 3) | tensor count u64 | metadata count u64
    metadata:    key (string) | value type u32 | value          string = u64 length + UTF-8 bytes
                 array value = element type u32 | count u64 | elements
    tensor info: name (string) | n_dims u32 | dims u64 x n_dims (fastest first) | ggml type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data; tensor i at data start + offset i

gguf-py's ``GGUFReader`` builds a numpy memmap view per field part (seconds for a 49k-entry vocabulary);
here the header is one ``bytes`` read and arrays of numbers become one ``numpy`` view each, so the whole
parse is a loop over the strings only.  Every inconsistency (a count or a tensor past the file's end, an
unknown type) is a ``SpecdraftError`` naming the file.  gguf-py stays the independent reference (tests).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdraft.errors import SpecdraftError

MAGIC = b"GGUF"
# metadata value types -> (struct code, numpy dtype) for scalars; 8 = string, 9 = array
_SCALAR = {0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
           6: ("f", "<f4"), 7: ("?", "<u1"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8")}
_STRING, _ARRAY = 8, 9
_HEADER_CHUNK = 1 << 20  # read this much of the file at a time while parsing the header


@dataclass
class TensorInfo:
    """One entry of the tensor table."""

    name: str
    shape: tuple[int, ...]  # as numpy/torch order it: slowest first ([rows, cols] for a matrix)
    kind: str  # the ggml type's name: "F32", "Q4_K", ...
    offset: int  # absolute byte offset of its data in the file
    nbytes: int  # size of its data

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.rows


class GGUFFile:
    """A GGUF file's metadata (``fields``: key -> int / float / bool / str / list) and tensor table
    (``tensors``: name -> ``TensorInfo``, in file order).  Tensor bytes are read on demand
    (``read`` copies them; ``view`` maps them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.size = os.path.getsize(self.path)
            self._f = open(self.path, "rb")
        except OSError as e:
            raise SpecdraftError(f"cannot read GGUF file {self.path}: {e.strerror or e}") from None
        self._map: mmap.mmap | None = None
        try:
            self._parse()
        except BaseException:
            self._f.close()
            raise

    # ------------------------------------------------------------------ parsing
    def _fail(self, what: str) -> SpecdraftError:
        return SpecdraftError(f"cannot read GGUF file {self.path}: {what}")

    def _parse(self) -> None:
        self._buf, self._base = b"", 0  # self._buf holds the file's bytes from self._base on
        self._pos = 0
        if self._take(4) != MAGIC:
            raise self._fail("not a GGUF file (its first bytes are not 'GGUF')")
        (self.version,) = self._unpack("<I")
        if self.version not in (2, 3):
            raise self._fail(f"GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._unpack("<QQ")
        # every entry takes at least 8 (metadata) / 24 (tensor info) bytes: a count beyond that cannot be right
        if n_kv * 12 > self.size or n_tensors * 24 > self.size:
            raise self._fail(f"its header counts {n_kv} metadata entries and {n_tensors} tensors, "
                             f"more than a file of {self.size} bytes can hold")
        self.fields: dict[str, object] = {}
        self.field_types: dict[str, int | tuple[int, int]] = {}  # value type, or (9, element type) for arrays
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype, key)
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise self._fail(f"general.alignment {align!r} is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            if n_dims > 4:
                raise self._fail(f"tensor {name} has {n_dims} dimensions (at most 4)")
            dims = self._unpack(f"<{n_dims}Q")
            kind_id, offset = self._unpack("<IQ")
            infos.append((name, dims, kind_id, offset))
        self.data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, kind_id, offset in infos:
            try:
                kind = GGMLQuantizationType(kind_id)
            except ValueError:
                raise self._fail(f"tensor {name} has an unknown type {kind_id}") from None
            block, nbytes = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims, dtype=object)) if dims else 1
            if dims and dims[0] % block:
                raise self._fail(f"tensor {name} ({kind.name}) has rows of {dims[0]}, not whole blocks of {block}")
            size = count // block * nbytes
            start = self.data_start + offset
            if offset % align or start + size > self.size:
                raise self._fail(f"tensor {name}'s data ({size} bytes at {start}) runs past the end of the file "
                                 f"({self.size} bytes)" if start + size > self.size else
                                 f"tensor {name}'s offset {offset} is not aligned to {align}")
            if name in self.tensors:
                raise self._fail(f"tensor {name} appears twice")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), kind.name, start, size)
        del self._buf

    def _need(self, n: int) -> None:
        """Make sure bytes [pos, pos + n) are in the buffer (reading on), or fail as truncated."""
        end = self._pos + n
        if end - self._base <= len(self._buf):
            return
        if end > self.size:
            raise self._fail(f"the file ends inside its header (at byte {self.size}; {end} needed): truncated?")
        keep = self._buf[self._pos - self._base:]
        self._f.seek(self._base + len(self._buf))
        more = self._f.read(max(_HEADER_CHUNK, end - self._base - len(self._buf)))
        self._buf, self._base = keep + more, self._pos

    def _take(self, n: int) -> bytes:
        self._need(n)
        i = self._pos - self._base
        self._pos += n
        return self._buf[i:i + n]

    def _unpack(self, fmt: str) -> tuple:
        n = struct.calcsize(fmt)
        self._need(n)
        out = struct.unpack_from(fmt, self._buf, self._pos - self._base)
        self._pos += n
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        raw = self._take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str):
        self.field_types[key] = vtype
        if vtype == _STRING:
            return self._string()
        if vtype in _SCALAR:
            (v,) = self._unpack("<" + _SCALAR[vtype][0])
            return v
        if vtype != _ARRAY:
            raise self._fail(f"metadata {key!r} has an unknown value type {vtype}")
        etype, count = self._unpack("<IQ")
        self.field_types[key] = (_ARRAY, etype)
        if etype in _SCALAR:
            dt = np.dtype(_SCALAR[etype][1])
            raw = self._take(count * dt.itemsize)
            arr = np.frombuffer(raw, dtype=dt)
            return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
        if etype == _STRING:
            if count * 8 > self.size:
                raise self._fail(f"metadata {key!r} counts {count} strings, more than the file can hold")
            return self._strings(count)
        raise self._fail(f"metadata {key!r} is an array of type {etype}, which is not read")

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in a row (the vocabulary, the merges): one tight loop over the buffer, which is
        refilled only when a string runs past its end."""
        out = []
        unpack, append = struct.unpack_from, out.append
        buf, i = self._buf, self._pos - self._base
        for _ in range(count):
            if i + 8 > len(buf):
                self._pos = self._base + i
                self._need(8)
                buf, i = self._buf, self._pos - self._base
            (n,) = unpack("<Q", buf, i)
            if i + 8 + n > len(buf):
                self._pos = self._base + i
                self._need(8 + n)
                buf, i = self._buf, self._pos - self._base
            b = buf[i + 8:i + 8 + n]
            i += 8 + n
            try:
                append(b.decode("utf-8"))
            except UnicodeDecodeError:
                append(b.decode("utf-8", errors="replace"))
        self._pos = self._base + i
        return out

    # ------------------------------------------------------------------ tensor data
    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes, read once into memory: [rows, row_bytes] uint8 (a vector: [1, bytes])."""
        t = self.tensors[name]
        buf = bytearray(t.nbytes)
        self._f.seek(t.offset)
        got = self._f.readinto(buf)
        if got != t.nbytes:
            raise self._fail(f"tensor {name}: read {got} of {t.nbytes} bytes (was the file changed?)")
        return np.frombuffer(buf, dtype=np.uint8).reshape(t.rows, t.row_bytes)

    def view(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes mapped from the file, not read ([rows, row_bytes] uint8, read-only):
        only the rows used are ever paged in (the embedding table)."""
        t = self.tensors[name]
        if self._map is None:
            self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset).reshape(t.rows, t.row_bytes)

    def get(self, key: str, default=None):
        return self.fields.get(key, default)
