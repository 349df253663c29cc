"""Training data: the target's own greedy responses to training prompts, in resumable shards.

Layout of a data folder:
    prompts.jsonl        the prompt list (fixed at the first run, so a resume sees the same one)
    shard_00000.safetensors ...   ``shard_size`` sequences each:
        tokens      int32 [sum of lengths]  prompt + response ids, sequences concatenated
        offsets     int64 [n+1]             sequence i = tokens[offsets[i]:offsets[i+1]]
        prompt_len  int32 [n]               response mask: positions >= prompt_len
        prompt_id   int64 [n]               index into prompts.jsonl
        finished    uint8 [n]               1 when the response ended with EOS
    manifest.json        sources and seeds, counts, token totals, target name and weight hash,
                         project version, and the shards written so far

A shard is written atomically (temp file + rename) and recorded in the manifest only after it is
on disk, so an interrupted build resumes at the first missing shard and loses nothing written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

from importlib.metadata import PackageNotFoundError, version

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdraft.drafters.datastore import Datastore
from specdraft.errors import SpecdraftError
from specdraft.model.batched_decode import generate_batch
from specdraft.model.llama import causal_mask
from specdraft.train.prompts import DEFAULT_SOURCES, TRAIN_SEED_BASE, Prompt, collect_prompts
from specdraft.verify import Sampling

MANIFEST = "manifest.json"
PROMPTS = "prompts.jsonl"


def project_version() -> str:
    try:
        return version("specdraft")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class BuildConfig:
    n_prompts: int = 3000  # prompts collected across the sources
    max_new_tokens: int = 256  # response length cap
    sources: tuple[str, ...] = DEFAULT_SOURCES  # prompt sources (see train/prompts.py)
    batch_size: int = 32  # rows decoded together
    shard_size: int = 256  # sequences per shard file
    max_prompt_tokens: int = 512  # longer prompts (chat template included) are dropped: prefill is quadratic
    magpie_seed: int = TRAIN_SEED_BASE  # sampling seed of the magpie instructions
    exclude: tuple[str, ...] = ()  # data folders whose prompts this build must not repeat
    seed: int = TRAIN_SEED_BASE  # seed of the gsm problems, the broad mix's sources and the sampled responses
    split: str = "train"  # the broad mix's part: "train" or "heldout" (sources no training build uses)
    sampled: float = 0.0  # share of the prompts whose response is sampled (T=0.7) instead of greedy
    feature_layers: tuple[int, ...] = ()  # hidden states kept while decoding, written to FOLDER/features (fast mode)

    def record(self) -> dict:
        """The config as a manifest stores it: the fields added after the first builds only where they
        are not their default, so a rebuild of an older folder has the same manifest (and data hash)."""
        d = {**asdict(self), "sources": list(self.sources), "exclude": list(self.exclude),
             "feature_layers": list(self.feature_layers)}
        for k, default in ADDED_FIELDS.items():
            if getattr(self, k) == default:
                del d[k]
        return d


# the fields added after the first builds, with their defaults (what an older manifest means by leaving them out)
ADDED_FIELDS = {k: BuildConfig.__dataclass_fields__[k].default for k in ("seed", "split", "sampled", "feature_layers")}


@dataclass
class Sequence:
    tokens: list[int]  # prompt + response
    prompt_len: int
    prompt_id: int
    finished: bool

    @property
    def response(self) -> list[int]:
        return self.tokens[self.prompt_len :]


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise SpecdraftError(f"disk full while writing {path}") from None
        raise SpecdraftError(f"cannot write {path}: {e.strerror or e}") from None


def save_shard(path: Path, seqs: list[Sequence]) -> None:
    lengths = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.int64)
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s.tokens], dtype=torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "prompt_len": torch.tensor([s.prompt_len for s in seqs], dtype=torch.int32),
        "prompt_id": torch.tensor([s.prompt_id for s in seqs], dtype=torch.int64),
        "finished": torch.tensor([int(s.finished) for s in seqs], dtype=torch.uint8),
    }
    _write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))


def load_shard(path: Path) -> list[Sequence]:
    try:
        t = load_file(str(path))
        tokens, offsets = t["tokens"].tolist(), t["offsets"].tolist()
        plen, pid, fin = t["prompt_len"].tolist(), t["prompt_id"].tolist(), t["finished"].tolist()
        if len(offsets) != len(plen) + 1 or offsets[-1] != len(tokens):
            raise ValueError("inconsistent offsets")
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise SpecdraftError(f"corrupt data shard {path}: {e}") from None
    return [Sequence(tokens[offsets[i] : offsets[i + 1]], plen[i], pid[i], bool(fin[i])) for i in range(len(plen))]


def built_precision(manifest: dict) -> str:
    """The precision mode a data folder's responses were decoded in (folders from before the fast mode: exact)."""
    return manifest.get("precision", "exact")


def read_manifest(out: Path) -> dict:
    path = out / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecdraftError(f"{out} has no {MANIFEST}: not a specdraft data folder") from None
    except json.JSONDecodeError:
        raise SpecdraftError(f"corrupt manifest {path}") from None


def _write_prompts(path: Path, prompts: list[Prompt]) -> None:
    text = "".join(json.dumps(p.to_dict()) + "\n" for p in prompts)
    _write_atomic(path, lambda tmp: tmp.write_text(text))


def read_prompts(path: Path) -> list[Prompt]:
    try:
        return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    except (json.JSONDecodeError, TypeError) as e:
        raise SpecdraftError(f"corrupt prompt list {path}: {e}") from None


def build_data(target, out_dir: str | Path, cfg: BuildConfig | None = None, quiet: bool = False,
               prompts: list[Prompt] | None = None) -> dict:
    """Collect prompts (or take ``prompts``), regenerate the target's greedy responses, write shards.

    Resumable: re-running with the same folder continues at the first shard not yet written.
    """
    cfg = cfg or BuildConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpath, ppath = out / MANIFEST, out / PROMPTS
    manifest = read_manifest(out) if mpath.exists() else None
    if manifest is not None:
        if manifest["target_hash"] != target.weight_hash:
            raise SpecdraftError(f"{out} holds data of target {manifest['target_name']!r}, not the loaded target")
        built = built_precision(manifest)
        if built != target.precision:
            raise SpecdraftError(f"{out} holds responses decoded in the {built} precision mode; resume it with "
                                 f"--precision {built} (the loaded target runs {target.precision})")
        prompts = read_prompts(ppath)
        cfg = BuildConfig(**{**asdict(cfg), **ADDED_FIELDS, **manifest["config"], "sources": tuple(manifest["config"]["sources"]),
                             "feature_layers": tuple(manifest["config"].get("feature_layers", ())),
                             "exclude": tuple(manifest["config"].get("exclude", ()))})
    else:
        if prompts is not None:  # given prompts are used as they are
            cfg = replace(cfg, exclude=())
        else:
            exclude = set()
            for other in cfg.exclude:
                opath = Path(other) / PROMPTS
                if not opath.is_file():
                    raise SpecdraftError(f"--exclude {other}: no {PROMPTS} there (not a data folder)")
                exclude |= {p.key for p in read_prompts(opath)}
            prompts = collect_prompts(target, cfg.n_prompts, cfg.sources, quiet=quiet, magpie_seed=cfg.magpie_seed,
                                      exclude=exclude, seed=cfg.seed, split=cfg.split, sampled=cfg.sampled)
        n_before = len(prompts)
        prompts = [p for p in prompts if len(p.encode(target)) <= cfg.max_prompt_tokens]
        for i, p in enumerate(prompts):
            p.id = i
        _write_prompts(ppath, prompts)
        manifest = {
            "target_name": target.name, "target_hash": target.weight_hash, "precision": target.precision,
            "version": project_version(),
            "config": cfg.record(),
            "sources": _source_summary(prompts),
            "prompts_sha256": hashlib.sha256(ppath.read_bytes()).hexdigest(),
            "prompts_dropped_too_long": n_before - len(prompts),
            "shards": [], "sequences": 0, "prompt_tokens": 0, "response_tokens": 0, "wall_s": 0.0,
            "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        _write_atomic(mpath, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    if cfg.feature_layers and target.precision != "fast":
        raise SpecdraftError("keeping features while building needs the fast precision mode (its rows are bit-exact, "
                             "so the states kept equal one pass over each sequence); in the exact mode build, then "
                             "run `specdraft data features`")
    fdir = out / "features"
    done = {s["file"] for s in manifest["shards"]}
    n_shards = -(-len(prompts) // cfg.shard_size)
    bar = tqdm(total=len(prompts), desc="regenerating", unit="resp", disable=quiet,
               initial=sum(s["sequences"] for s in manifest["shards"]))
    for k in range(n_shards):
        name = f"shard_{k:05d}.safetensors"
        if name in done:
            continue
        t0 = time.perf_counter()
        chunk = prompts[k * cfg.shard_size : (k + 1) * cfg.shard_size]
        ids = [p.encode(target) for p in chunk]
        seqs: dict[int, Sequence] = {}
        states: dict[int, dict[int, torch.Tensor]] = {}  # row -> layer -> [tokens, H] fp16 (feature_layers)
        for idx, temp, seed in _batches(chunk, ids, cfg, k):
            sampling = Sampling(temperature=temp) if temp else None
            gen = torch.Generator().manual_seed(seed) if temp else None
            res = generate_batch(target.model, [ids[i] for i in idx], cfg.max_new_tokens, target.eos_ids,
                                 sampling=sampling, generator=gen, hidden_layers=cfg.feature_layers)
            for b, (i, toks, fin) in enumerate(zip(idx, res.tokens, res.finished)):
                seqs[i] = Sequence(ids[i] + toks, len(ids[i]), chunk[i].id, fin)
                if cfg.feature_layers:
                    states[i] = res.hidden[b]
            bar.update(len(idx))
            bar.set_postfix(resp_tok=manifest["response_tokens"] + sum(len(s.response) for s in seqs.values()))
        ordered = [seqs[i] for i in range(len(chunk))]
        if cfg.feature_layers:  # the feature shard first: the manifest lists a data shard only when both are on disk
            fdir.mkdir(exist_ok=True)
            save_feature_shard(fdir / name.replace("shard_", "features_"), name, cfg.feature_layers,
                               {k: torch.cat([states[i][k] for i in range(len(chunk))]) for k in cfg.feature_layers})
        save_shard(out / name, ordered)
        resp = sum(len(s.response) for s in ordered)
        manifest["shards"].append({"file": name, "sequences": len(ordered), "response_tokens": resp})
        manifest["sequences"] += len(ordered)
        manifest["prompt_tokens"] += sum(s.prompt_len for s in ordered)
        manifest["response_tokens"] += resp
        manifest["wall_s"] += time.perf_counter() - t0
        _write_atomic(mpath, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    bar.close()
    return manifest


def _batches(chunk: list[Prompt], ids: list[list[int]], cfg: BuildConfig, shard: int):
    """(row indices, temperature, sampling seed) of each batch of a shard: the greedy prompts, then each
    temperature's, similar lengths together; the seed depends on the shard and batch only, so a
    resumed build samples the same responses."""
    for temp in sorted({p.temperature for p in chunk}):
        rows = sorted((i for i, p in enumerate(chunk) if p.temperature == temp), key=lambda i: len(ids[i]))
        for b in range(0, len(rows), cfg.batch_size):
            yield rows[b : b + cfg.batch_size], temp, cfg.seed * 1_000_003 + shard * 1_009 + b


def _source_summary(prompts: list[Prompt]) -> dict:
    out: dict = {}
    for p in prompts:
        s = out.setdefault(p.source, {"prompts": 0, "seeds": []})
        s["prompts"] += 1
        if p.seed is not None and p.seed not in s["seeds"]:
            s["seeds"].append(p.seed)
    return out


def load_sequences(data_dir: str | Path) -> list[Sequence]:
    """All sequences of a data folder, in prompt order."""
    out = Path(data_dir)
    manifest = read_manifest(out)
    seqs: list[Sequence] = []
    for s in manifest["shards"]:
        path = out / s["file"]
        if not path.is_file():
            raise SpecdraftError(f"data shard {path} listed in the manifest is missing")
        seqs += load_shard(path)
    return seqs


# ---------------------------------------------------------------------------- features


@dataclass
class FeatureBatch:
    tokens: torch.Tensor  # [B, T] ids, right-padded with 0
    lengths: torch.Tensor  # [B]
    response_mask: torch.Tensor  # [B, T] bool: response positions (not prompt, not padding)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, H]


@torch.inference_mode()
def compute_features(target, seqs: list[Sequence], layers: tuple[int, ...]) -> FeatureBatch:
    """One batched, no-grad target pass over right-padded sequences; hidden states of ``layers``."""
    dev = target.device
    n, width = len(seqs), max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(n, width, dtype=torch.long, device=dev)
    for b, s in enumerate(seqs):
        tokens[b, : len(s.tokens)] = torch.tensor(s.tokens, device=dev)
    lengths = torch.tensor([len(s.tokens) for s in seqs], device=dev)
    pos = torch.arange(width, device=dev)
    plen = torch.tensor([s.prompt_len for s in seqs], device=dev)
    resp = (pos[None] >= plen[:, None]) & (pos[None] < lengths[:, None])
    # right padding: causal attention keeps real queries off the pads that follow them
    cache = target.model.new_cache(n, width)
    out = target.model(tokens, pos[None].expand(n, width), causal_mask(width, 0, dev).expand(n, -1, -1), cache, 0,
                       hidden_layers=tuple(layers), logits="none")
    return FeatureBatch(tokens=tokens, lengths=lengths, response_mask=resp, hidden=out.hidden)


def iter_feature_batches(target, seqs: list[Sequence], layers: tuple[int, ...], batch_size: int = 8,
                         max_len: int | None = None) -> Iterator[FeatureBatch]:
    """Yield batches with features computed on the fly (sequences cut to ``max_len`` tokens)."""
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        if max_len is not None:
            chunk = [Sequence(s.tokens[:max_len], min(s.prompt_len, max_len), s.prompt_id, s.finished) for s in chunk]
        yield compute_features(target, chunk, layers)


def feature_cache_bytes(seqs: list[Sequence], layers: tuple[int, ...], hidden_size: int) -> int:
    """Size of an fp16 feature cache: every token x every layer x H x 2 bytes."""
    return sum(len(s.tokens) for s in seqs) * len(layers) * hidden_size * 2


def cache_features(target, data_dir: str | Path, out_dir: str | Path, layers: tuple[int, ...],
                   batch_size: int = 8, quiet: bool = False) -> Path:
    """Write fp16 feature shards (one per data shard) after showing the size; skips shards already written."""
    data, out = Path(data_dir), Path(out_dir)
    manifest = read_manifest(data)
    check_data_target(manifest, target, data)
    out.mkdir(parents=True, exist_ok=True)
    shards = manifest["shards"]
    total_tokens = manifest["prompt_tokens"] + manifest["response_tokens"]
    need = total_tokens * len(layers) * target.config.hidden_size * 2
    free = _free_bytes(out)
    msg = f"feature cache: {total_tokens:,} tokens x {len(layers)} layers x {target.config.hidden_size} x fp16 = {need / 2**30:.2f} GiB"
    if not quiet:
        print(msg, flush=True)
    if need > free:
        raise SpecdraftError(f"{msg}, but only {free / 2**30:.2f} GiB free in {out}")
    for s in tqdm(shards, desc="caching features", disable=quiet):
        dst = out / s["file"].replace("shard_", "features_")
        if dst.exists():
            continue
        seqs = load_shard(data / s["file"])
        parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        for fb in iter_feature_batches(target, seqs, layers, batch_size):
            for b in range(fb.tokens.shape[0]):
                n = int(fb.lengths[b])
                for layer in layers:
                    parts[layer].append(fb.hidden[layer][b, :n].to(torch.float16).cpu())
        save_feature_shard(dst, s["file"], layers, {layer: torch.cat(v) for layer, v in parts.items()})
    return out


def save_feature_shard(path: Path, data_shard: str, layers: tuple[int, ...], per_layer: dict[int, torch.Tensor]) -> None:
    """A feature shard: one fp16 tensor ``layer_L`` [rows, H] per layer, rows = the data shard's tokens in order."""
    tensors = {f"layer_{layer}": per_layer[layer].to(torch.float16).contiguous() for layer in layers}
    _write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"data_shard": data_shard,
                                                                          "layers": json.dumps(list(layers))}))


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class FeatureRows:
    """Cached fp16 features as one [rows, n_layers * H] array that stays on disk: every shard's layers are
    memory maps of its safetensors file, and only the rows indexed are read (the page cache keeps what
    fits).  A 4M-token corpus with four layers is 18 GiB, more than a trainer could hold and copy.
    Indexing with a LongTensor of any shape [...] gives a tensor [..., n_layers * H]; a slice of rows
    gives [n, n_layers * H]; ``layers`` picks columns (whole layers) without reading anything."""

    def __init__(self, parts: list[list[torch.Tensor]]) -> None:
        self.parts = parts  # per shard, per layer [rows of the shard, H] (memory-mapped)
        sizes = [p[0].shape[0] for p in parts]
        self.starts = torch.tensor([0] + sizes).cumsum(0)  # [shards + 1]
        self.width = sum(t.shape[1] for t in parts[0])
        self.shape = (int(self.starts[-1]), self.width)

    @classmethod
    def concat(cls, items: list["FeatureRows"]) -> "FeatureRows":
        return cls([p for it in items for p in it.parts])

    def layers(self, which: list[int]) -> "FeatureRows":
        """The columns of the layers at positions ``which`` (in that order)."""
        return FeatureRows([[p[i] for i in which] for p in self.parts])

    def __getitem__(self, rows) -> torch.Tensor:
        if isinstance(rows, slice):
            return self[torch.arange(*rows.indices(self.shape[0]))]
        flat = rows.reshape(-1)
        out = torch.empty(flat.shape[0], self.width, dtype=torch.float16)
        shard = torch.searchsorted(self.starts, flat, right=True) - 1
        for k in shard.unique().tolist():
            sel = (shard == k).nonzero().squeeze(1)
            local = flat[sel] - self.starts[k]
            c = 0
            for t in self.parts[k]:  # each layer into its columns (no torch.cat: trainers index under autocast)
                out[sel, c : c + t.shape[1]] = t[local]
                c += t.shape[1]
        return out.view(*rows.shape, self.width)


def _mapped(path: Path, keys: list[str]) -> list[torch.Tensor]:
    """Tensors ``keys`` of a safetensors file as read-only memory maps (copy-on-write: nothing is written back)."""
    import numpy as np

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = []
    for key in keys:
        info = header[key]
        if info["dtype"] != "F16":
            raise SpecdraftError(f"{path}: {key} is {info['dtype']}, not F16")
        start, end = info["data_offsets"]
        arr = np.memmap(path, dtype=np.float16, mode="c", offset=8 + n + start, shape=tuple(info["shape"]))
        if arr.nbytes != end - start:
            raise SpecdraftError(f"corrupt feature shard {path}: {key} has the wrong size")
        out.append(torch.from_numpy(arr))
    return out


def read_features(feat_dir: str | Path, shard_files: list[str], layers: tuple[int, ...],
                  mapped: bool = False) -> torch.Tensor | FeatureRows:
    """The cached fp16 features [rows, len(layers) * H] of the given data shards: per shard file
    ``features_XXXXX.safetensors`` with one key ``layer_L`` per layer, rows = every token of every
    sequence in shard order; the layers side by side.  ``mapped``: a ``FeatureRows`` over memory maps
    instead of a tensor in memory."""
    parts, maps = [], []
    for name in shard_files:
        path = Path(feat_dir) / name.replace("shard_", "features_")
        if not path.is_file():
            raise SpecdraftError(f"feature shard {path} is missing: run `specdraft data features --data DATA "
                                 f"--layers {','.join(map(str, layers))} --out {feat_dir}` first")
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                miss = [x for x in layers if f"layer_{x}" not in keys]
                if miss:
                    raise SpecdraftError(f"{path} has no features of layer {miss[0]} (has {', '.join(sorted(keys))})")
                if mapped:
                    maps.append(_mapped(path, [f"layer_{x}" for x in layers]))
                    continue
                cols = [f.get_tensor(f"layer_{x}") for x in layers]
        except SpecdraftError:
            raise
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise SpecdraftError(f"corrupt feature shard {path}: {e}") from None
        parts.append(torch.cat(cols, 1) if len(cols) > 1 else cols[0])
    return FeatureRows(maps) if mapped else torch.cat(parts)


def check_data_target(manifest: dict, target, data_dir) -> None:
    """Raise unless the data folder ``data_dir`` (its ``manifest``) was generated by ``target``."""
    if manifest["target_hash"] != target.weight_hash:
        raise SpecdraftError(f"{data_dir} was generated by target {manifest['target_name']!r}, not the loaded target")


def manifest_sha256(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


BUILD_RECORD = ("wall_s", "created")  # when a data folder was built and how long it took: not what it holds


def data_sha256(manifest: dict) -> str:
    """A data folder's identity, as checkpoints record it: its manifest's hash without ``BUILD_RECORD``, so a
    rebuild on another machine or day (the fast mode's responses are bit-exact) is the same data, and a
    drafter trained on one can be profiled or fine-tuned on the other."""
    return manifest_sha256({k: v for k, v in manifest.items() if k not in BUILD_RECORD})


def data_record(data_dir, manifest: dict, sequences: int) -> dict:
    """A trained checkpoint's record of one data folder it trained on (``manifest``: the folder's, with
    ``shards_used``; ``sequences``: how many of its sequences the run read, in order)."""
    return {"dir": str(data_dir), "manifest_sha256": data_sha256(manifest), "shards": manifest["shards_used"],
            "sequences": sequences,
            "response_tokens": sum(s["response_tokens"] for s in manifest["shards"][: manifest["shards_used"]])}


def data_hashes(manifest: dict) -> tuple[str, str]:
    """Every hash a checkpoint may have recorded for this data (``data_sha256``; the whole manifest's,
    as checkpoints made before it did)."""
    return data_sha256(manifest), manifest_sha256(manifest)


def build_datastore(target, data_dirs: list[str | Path], out: str | Path) -> dict:
    """Write a datastore of every response in ``data_dirs`` (data folders of ``target``'s own answers from
    ``specdraft data build``) to ``out``; returns its manifest.  Give the held-out folder none of its answers:
    a datastore that holds a measurement's answers measures nothing."""
    responses, record = [], []
    for d in data_dirs:
        manifest = read_manifest(Path(d))
        check_data_target(manifest, target, d)
        seqs = load_sequences(d)
        responses += [s.response for s in seqs]
        record.append({"dir": str(d), "manifest_sha256": data_sha256(manifest), "sequences": len(seqs),
                       "response_tokens": sum(len(s.response) for s in seqs)})
    if not responses:
        raise SpecdraftError("no responses in the data folders given")
    store = Datastore.from_sequences(responses)
    manifest = {"target_name": target.name, "target_hash": target.weight_hash,
                "target_model": getattr(target, "model_hash", None), "data": record}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return store.save(out, manifest)
