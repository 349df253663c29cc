"""A datastore for prompt lookup: the target's own answers to many other prompts, searched like the context.

Prompt lookup (``drafters.ngram``) copies continuations of earlier matches of the latest n-grams in
*this* context; a fresh prompt has few.  The target repeats itself across prompts too (its phrasing,
its list and code layouts, its maths steps), so the same lookup over a datastore of its own answers
(as REST and SuffixDecoding do) finds continuations the context has not got.  Training-free: the
datastore is the target's greedy and sampled answers from ``specdraft data build``, nothing learnt.

Index: every n-gram (n = 1 .. max_n) of the token stream that a continuation follows is hashed
(a 64-bit polynomial hash of its tokens read right to left, so the hashes of the last 1, 2, .., max_n
tokens come out of one loop), and the hashes are sorted with their continuation starts.  A lookup
hashes the context's last n tokens for every n and binary-searches the sorted hashes in one call:
O(max_n log T) per pass, no Python dict of millions of n-grams.  Of the matches of the
longest n that has any (at most ``cap``, spread evenly over the stream), the continuations are merged
into a count trie and returned most frequent first, each with the share of matches behind its first
token (a hash collision can only propose a wrong token, which the target rejects: lossless either way).

File: safetensors with ``tokens`` (the answers concatenated, each followed by -1 / 65535 as a separator;
uint16 where the vocabulary fits, else int32) and a manifest naming the target (``store_for``).
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import MANIFEST_KEY, fits_target

MASK = (1 << 64) - 1
PRIME = 0x100000001B3  # FNV-64's multiplier: odd, so the hash of a window is a bijection of its last token
KIND = "datastore"
INDEX_VERSION = 1  # of build_index's hashing and order: a cached index of another version is rebuilt
WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"  # shipped files: datastore_MODEL.safetensors per target


def suffix_hashes(tokens: list[int], max_n: int) -> list[int]:
    """The index's hashes of the last 1, 2, .., max_n tokens of ``tokens`` (fewer when it is shorter), in Python
    ints: the same sums of products modulo 2^64 that ``Datastore`` computes over the whole stream in numpy."""
    out, h = [], 0
    for t in reversed(tokens[-max_n:]):
        h = (h * PRIME + int(t) + 1) & MASK
        out.append(h)
    return out


class Datastore:
    """A token stream (answers separated by -1) and its sorted n-gram index."""

    def __init__(self, stream: np.ndarray, max_n: int = 6, cap: int = 16, manifest: dict | None = None,
                 index: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.stream = np.asarray(stream, dtype=np.int64)  # [T], -1 between answers
        self.max_n = max_n  # longest n-gram matched
        self.cap = cap  # most matches read per lookup (spread over the stream)
        self.manifest = manifest or {}
        if max_n < 1 or cap < 2:
            raise ValueError(f"a datastore needs max_n >= 1 and cap >= 2 (got {max_n}, {cap})")
        if index is None:
            index = self.build_index(self.stream, max_n)
        keys, starts = index  # [M] sorted n-gram hashes (uint64), [M] the continuation start of each
        if len(keys) != len(starts):
            raise ValueError(f"a datastore index needs as many starts as keys (got {len(starts)}, {len(keys)})")
        # The lookup reads copies in the standard library's arrays: bisect and slices on them cost far less than
        # a numpy call each, and after a target pass has evicted the caches a numpy call costs several
        # microseconds.  The numpy index is not kept (it would double the memory).
        self._tokens = array.array("q", self.stream.tobytes())
        self._keys = array.array("Q", np.ascontiguousarray(keys, dtype=np.uint64).tobytes())
        self._starts = array.array("i", np.ascontiguousarray(starts, dtype=np.int32).tobytes())

    @staticmethod
    def build_index(s: np.ndarray, max_n: int) -> tuple[np.ndarray, np.ndarray]:
        """The index of stream ``s`` [T] (-1 between answers): every n-gram (n = 1 .. max_n) inside one answer that
        a token of the same answer follows, as (hashes [M] uint64 sorted, continuation starts [M] int32); equal
        hashes in stream order.  M is at most max_n * T."""
        T = len(s)
        if T >= 2**31:
            raise ValueError(f"a datastore holds fewer than 2^31 tokens (got {T:,})")
        keys, starts = [], []
        e = np.arange(1, T)  # continuation starts; the n-gram before one is s[e-n : e]
        h = np.zeros(len(e), dtype=np.uint64)
        ok = s[e] >= 0  # something to continue with
        for n in range(1, max_n + 1):
            tok = s[np.maximum(e - n, 0)]
            ok &= (e >= n) & (tok >= 0)  # the n-gram lies inside one answer
            with np.errstate(over="ignore"):
                h = h * np.uint64(PRIME) + (tok + 1).astype(np.uint64)
            keys.append(h[ok])
            starts.append(e[ok])
        keys_all = np.concatenate(keys)
        order = np.argsort(keys_all, kind="stable")
        return keys_all[order], np.concatenate(starts)[order].astype(np.int32)

    @classmethod
    def from_sequences(cls, sequences, **kw) -> "Datastore":
        """A datastore of ``sequences`` (lists of token ids, e.g. a data folder's responses), in order."""
        stream: list[int] = []
        for seq in sequences:
            stream += list(seq) + [-1]
        return cls(np.array(stream, dtype=np.int64), **kw)

    def __len__(self) -> int:
        return len(self.stream)

    def lookup(self, history: list[int], depth: int, k: int, min_n: int = 1) -> tuple[int, list[tuple[list[int], float]]]:
        """(n, up to ``k`` continuations of at most ``depth`` tokens with the share of the matches whose
        continuation starts with the same token) for the longest n-gram ending ``history`` that the datastore
        holds; (0, []) when none of n >= ``min_n`` occurs.  Order: the most frequent first token first, then,
        among continuations sharing it, the most frequent whole continuation."""
        if depth < 1 or k < 1:
            return 0, []
        min_n = max(min_n, 1)
        q = suffix_hashes(history, self.max_n)
        keys = self._keys
        for n in range(len(q), min_n - 1, -1):  # the longest first: usually one or two searches
            lo = bisect.bisect_left(keys, q[n - 1])
            if lo < len(keys) and keys[lo] == q[n - 1]:
                return n, self._continuations(lo, bisect.bisect_right(keys, q[n - 1], lo), depth, k)
        return 0, []

    def _continuations(self, lo: int, hi: int, depth: int, k: int) -> list[tuple[list[int], float]]:
        m = hi - lo
        if m <= self.cap:
            starts = self._starts[lo:hi].tolist()
        else:  # spread evenly: not just the earliest answers
            starts = [self._starts[lo + i * (m - 1) // (self.cap - 1)] for i in range(self.cap)]
            m = self.cap
        rows: Counter = Counter()
        for s in starts:
            row = self._tokens[s : s + depth].tolist()
            if -1 in row:
                row = row[: row.index(-1)]  # the answer ended
            rows[tuple(row)] += 1
        first: Counter = Counter()
        for row, times in rows.items():
            first[row[0]] += times
        best = sorted(rows, key=lambda r: (-first[r[0]], -rows[r]))[:k]
        return [(list(r), first[r[0]] / m) for r in best]

    def save(self, path: str | Path, manifest: dict) -> dict:
        """Write the datastore to ``path`` with ``manifest`` (naming the target) and its counts; returns the file's
        manifest."""
        from safetensors.numpy import save
        for key in ("target_name", "target_hash"):
            if key not in manifest:
                raise ValueError(f"datastore manifest needs {key!r}")
        vocab_max = int(self.stream.max(initial=0))
        dtype = np.uint16 if vocab_max < 65535 else np.int32
        tokens = self.stream.copy()
        if dtype == np.uint16:
            tokens[tokens < 0] = 65535
        meta = {"kind": KIND, "tokens": int((self.stream >= 0).sum()), "answers": int((self.stream < 0).sum()),
                "max_n": self.max_n, "cap": self.cap, **manifest}
        blob = save({"tokens": tokens.astype(dtype)}, metadata={MANIFEST_KEY: json.dumps(meta)})
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # never a torn file
        return meta

    @classmethod
    def load(cls, path: str | Path, cache: Path | None = None) -> "Datastore":
        """The datastore in ``path``; its index is read from ``cache`` (a folder) when built there before, else
        built (about 0.7 s per 400k tokens on 2 cores) and saved there."""
        manifest, tokens = _read(path, tensors=True)
        stream = tokens.astype(np.int64)
        if tokens.dtype == np.uint16:
            stream[stream == 65535] = -1
        max_n, cap = int(manifest.get("max_n", 6)), int(manifest.get("cap", 16))
        index = None
        if cache is not None:
            stem = f"{hashlib.sha256(stream.tobytes()).hexdigest()[:16]}_{max_n}_v{INDEX_VERSION}"
            files = [cache / f"{stem}_keys.npy", cache / f"{stem}_starts.npy"]
            try:
                index = tuple(np.load(p, mmap_mode="r") for p in files)
            except (OSError, ValueError):  # not built yet, or torn: build it again
                index = cls.build_index(stream, max_n)
                _save_index(files, index)
        return cls(stream, max_n=max_n, cap=cap, manifest=manifest, index=index)


def _save_index(files: list[Path], index: tuple[np.ndarray, np.ndarray]) -> None:
    """Write the index for the next load: each file through its own temporary one (another process may be
    writing the same index), and nothing lost but the saving when the cache cannot be written."""
    tmp = None
    try:
        files[0].parent.mkdir(parents=True, exist_ok=True)
        for p, a in zip(files, index):
            fd, tmp = tempfile.mkstemp(dir=p.parent, suffix=".npy.tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, a)
            os.replace(tmp, p)
            tmp = None
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def read_manifest(path: str | Path) -> dict:
    """A datastore file's manifest, from its header alone; one SpecdraftError for anything else."""
    return _read(path, tensors=False)[0]


def _read(path: str | Path, tensors: bool) -> tuple[dict, np.ndarray | None]:
    """(manifest, its ``tokens`` when ``tensors``) of a datastore file, in one open."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="np") as f:
            manifest = json.loads((f.metadata() or {})[MANIFEST_KEY])
            if isinstance(manifest, dict) and manifest.get("kind") == KIND:
                return manifest, (f.get_tensor("tokens") if tensors else None)
    except Exception as e:  # safetensors' own error types, a missing key, bad JSON: all the same to the user
        raise SpecdraftError(f"{path} is not a specdraft datastore ({e})") from None
    raise SpecdraftError(f"{path} holds no specdraft datastore")


def shipped_stores() -> list[Path]:
    """The shipped datastores (``specdraft/weights/datastore_MODEL.safetensors``), in name order."""
    return sorted(WEIGHTS_DIR.glob("datastore_*.safetensors"))


@functools.cache
def _load_shared(path: Path) -> Datastore:
    from specdraft.model.load import cache_dir
    return Datastore.load(path, cache=cache_dir() / "datastore")


def load_store(path: str | Path, target=None) -> Datastore:
    """The datastore file ``path`` (e.g. from `specdraft data datastore`), shared as ``store_for``'s; refused when
    it was made from another model's answers than ``target``'s."""
    manifest = read_manifest(path)
    if target is not None and not fits_target(manifest, target):
        raise SpecdraftError(f"{path} holds the answers of {manifest.get('target_name')!r}, not of the loaded target")
    return _load_shared(Path(path).resolve())


def store_for(target) -> Datastore | None:
    """The shipped datastore made from ``target``'s answers (these weights or another quantization of its model),
    loaded once per process and shared (read-only); None when none ships for it."""
    for path in shipped_stores():
        if fits_target(read_manifest(path), target):
            return _load_shared(path.resolve())
    return None

