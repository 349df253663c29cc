"""Training corpus shared by the hybrid and block trainers: sequences with their cached target
features, the held-out split, the draft vocabulary, and batches of whole sequences with sampled
anchor positions.

An *anchor* i is a position whose drafts the batch trains: the target's feature at i predicted
x_{i+1}, so the draft of depth d from anchor i is labelled x_{i+1+d} (``token_at``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.model.llama import FINAL
from specdraft.train.data import FeatureRows, check_data_target, load_shard, read_features, read_manifest


@dataclass
class Corpus:
    tokens: list[list[int]]  # per sequence: prompt + response
    prompt_len: list[int]
    offsets: list[int]  # first row of each sequence in the flat feature tensors
    feats: FeatureRows  # [rows, n_layers * H] fp16, the drafter's input features (memory-mapped)
    final: FeatureRows | None  # [rows, H] fp16 final features (regression targets) or None


def load_corpora(folders: list[tuple[str | Path, str | Path]], layers: tuple[int, ...], need_final: bool,
                 shards: int = 0) -> tuple[Corpus, list[dict], list[int]]:
    """One corpus from several (data folder, feature folder) pairs, in order, each cut to its first
    ``shards`` data shards (0 = all).  Returns (corpus, the folders' manifests with ``shards_used``,
    sequences per folder)."""
    read = layers if not need_final or FINAL in layers else layers + (FINAL,)
    seqs, parts, manifests, sizes = [], [], [], []
    for data_dir, feat_dir in folders:
        manifest = read_manifest(Path(data_dir))
        use = manifest["shards"][: shards or None]
        if not use:
            raise SpecdraftError(f"{data_dir} has no data shards yet")
        mine = []
        for s in use:
            path = Path(data_dir) / s["file"]
            if not path.is_file():
                raise SpecdraftError(f"data shard {path} listed in the manifest is missing")
            mine += load_shard(path)
        feats = read_features(feat_dir, [s["file"] for s in use], read, mapped=True)
        if feats.shape[0] != sum(len(s.tokens) for s in mine):
            raise SpecdraftError(f"features in {feat_dir} do not match the data in {data_dir}: recompute them")
        seqs += mine
        parts.append(feats)
        manifests.append({**manifest, "shards_used": len(use)})
        sizes.append(len(mine))
    feats = FeatureRows.concat(parts)  # on disk, read as batches index it
    final = feats.layers([read.index(FINAL)]) if need_final else None
    if len(read) > len(layers):
        feats = feats.layers(list(range(len(layers))))
    offsets = [0]
    for s in seqs[:-1]:
        offsets.append(offsets[-1] + len(s.tokens))
    return Corpus([s.tokens for s in seqs], [s.prompt_len for s in seqs], offsets, feats, final), manifests, sizes


def held_out_split(n_seq: int, seed: int, holdout: float) -> tuple[list[int], list[int]]:
    """(train_ids, val_ids) of the hybrid and block trainers (and of a budget profile, which must
    replay the same held-out sequences): the first ``holdout`` share of a seeded permutation, at
    least one sequence on each side."""
    n_held = min(n_seq - 1, max(1, int(n_seq * holdout))) if n_seq > 1 else 0
    perm = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_held:]), sorted(perm[:n_held])


def load_training_data(target, data_dir, feat_dir, layers: tuple[int, ...], need_final: bool,
                       shards: int = 0) -> tuple[Corpus, list, list[dict], list[int]]:
    """What a trainer reads: a data folder and its feature folder, or equal-length lists of them, loaded as one
    corpus (``load_corpora``), each checked to hold ``target``'s own responses and to share no prompt with
    another (``check_apart``).  Returns (corpus, the data folders, their manifests, sequences per folder)."""
    data_dirs = [data_dir] if isinstance(data_dir, (str, Path)) else list(data_dir)
    feat_dirs = [feat_dir] if isinstance(feat_dir, (str, Path)) else list(feat_dir)
    if not data_dirs or len(data_dirs) != len(feat_dirs):
        raise SpecdraftError(f"give one feature folder per data folder (got {len(data_dirs)} data and "
                             f"{len(feat_dirs)} feature folders)")
    corpus, manifests, groups = load_corpora(list(zip(data_dirs, feat_dirs)), layers, need_final, shards)
    for d, m in zip(data_dirs, manifests):
        check_data_target(m, target, d)
    check_apart(corpus, groups)
    return corpus, data_dirs, manifests, groups


def check_apart(corpus: Corpus, groups: list[int]) -> None:
    """Refuse data folders (``groups``: sequences per folder, in order) that share a prompt (token-identical):
    one folder's held-out sequence would be trained on in another."""
    owner: dict[tuple, int] = {}
    shared, start = 0, 0
    for g, n in enumerate(groups):
        for k in range(start, start + n):
            key = tuple(corpus.tokens[k][: corpus.prompt_len[k]])
            if owner.setdefault(key, g) != g:
                shared += 1
        start += n
    if shared:
        raise SpecdraftError(f"{shared} prompts occur in more than one --data folder (one folder's held-out "
                             "sequence would be trained on in another): build the later folder with "
                             "`data build --exclude EARLIER`")


def split_and_vocabulary(corpus: Corpus, seed: int, holdout: float, size: int, target,
                         groups: list[int] | None = None, vocab_ids: Tensor | None = None):
    """What the hybrid and block trainers share: the held-out split (``held_out_split``), the draft
    vocabulary of the training responses, the target-id -> draft-index map (-100 outside, on the
    target's device) and the share of training response tokens it covers.  ``groups`` (sequences
    per data folder, in order) splits each folder on its own, so a folder's held-out sequences are
    the same whatever folders train beside it; ``vocab_ids`` fixes the draft vocabulary (a run
    started from a trained drafter keeps its vocabulary).
    Returns (train_ids, val_ids, vocab_ids, t2d, coverage)."""
    train_ids, val_ids, start = [], [], 0
    for n in groups or [len(corpus.tokens)]:
        tr, va = held_out_split(n, seed, holdout)
        train_ids += [start + i for i in tr]
        val_ids += [start + i for i in va]
        start += n
    if start != len(corpus.tokens):
        raise SpecdraftError(f"the folder sizes ({sum(groups)} sequences) do not add up to the corpus ({len(corpus.tokens)})")
    vocab_size = target.config.vocab_size
    if vocab_ids is None:
        vocab_ids = draft_vocabulary(corpus, train_ids, size, vocab_size, target.eos_ids)
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    t2d = t2d.to(target.device)
    resp = [t for k in train_ids for t in corpus.tokens[k][corpus.prompt_len[k]:]]
    covered = float((t2d[torch.tensor(resp, device=target.device)] >= 0).float().mean()) if resp else 0.0
    return train_ids, val_ids, vocab_ids, t2d, covered


def draft_vocabulary(corpus: Corpus, seq_ids: list[int], size: int, vocab_size: int, always: set[int]) -> Tensor:
    """The ``size`` token ids most frequent in the responses of ``seq_ids`` (then in prompts, then by
    id), most frequent first after ``always`` (by id); every id, ranked the same way, when ``size`` is 0 or covers the
    vocabulary (so a drafter can draft from its first rows alone: ``TrainedOptions.vocab``)."""
    if size <= 0 or size >= vocab_size:
        size = vocab_size
    resp, prompt = Counter(), Counter()
    for k in seq_ids:
        toks, p = corpus.tokens[k], corpus.prompt_len[k]
        resp.update(toks[p:])
        prompt.update(toks[:p])
    forced = sorted(t for t in always if 0 <= t < vocab_size)
    rank = sorted((t for t in set(resp) | set(prompt) if t not in always), key=lambda t: (-resp[t], -prompt[t], t))
    ids = forced + rank[: max(0, size - len(forced))]
    if len(ids) < size:  # fewer distinct tokens than asked: pad with the lowest unused ids
        used = set(ids)
        ids += [t for t in range(vocab_size) if t not in used][: size - len(ids)]
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class AnchorBatch:
    tokens: Tensor  # [B, T] ids, right-padded with 0
    lengths: Tensor  # [B]
    prompt_len: Tensor  # [B]
    feats: Tensor  # [B, T, n_layers * H]
    final: Tensor | None  # [B, T, H]
    anchors: Tensor  # [B, A] anchor positions i (padded with 0)
    anchor_ok: Tensor  # [B, A] real anchors

    def rows(self, sl: slice) -> "AnchorBatch":
        """The sequences ``sl`` of this batch (the same padded width)."""
        return AnchorBatch(*(None if x is None else x[sl] for x in (self.tokens, self.lengths, self.prompt_len,
                                                                     self.feats, self.final, self.anchors,
                                                                     self.anchor_ok)))


def valid_anchors(length: int, prompt_len: int) -> range:
    """Anchors whose depth-1 label x_{i+2} is a response token."""
    return range(max(0, prompt_len - 2), max(0, length - 2))


def plan_epoch(corpus: Corpus, seq_ids: list[int], batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Shuffled batches of whole sequences, similar lengths together, <= batch_tokens padded tokens."""
    order = [seq_ids[i] for i in torch.randperm(len(seq_ids), generator=gen).tolist()]
    batches: list[list[int]] = []
    for c in range(0, len(order), 64):
        chunk = sorted(order[c : c + 64], key=lambda k: len(corpus.tokens[k]))
        cur: list[int] = []
        for k in chunk:
            width = max([len(corpus.tokens[j]) for j in cur + [k]])
            if cur and width * (len(cur) + 1) > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(k)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def make_batch(corpus: Corpus, seq_ids: list[int], anchors: int, gen: torch.Generator, device) -> AnchorBatch:
    lens = [len(corpus.tokens[k]) for k in seq_ids]
    b, t = len(seq_ids), max(lens)
    tokens = torch.zeros(b, t, dtype=torch.long)
    rows = torch.zeros(b, t, dtype=torch.long)
    picks = []
    for r, k in enumerate(seq_ids):
        n = lens[r]
        tokens[r, :n] = torch.tensor(corpus.tokens[k])
        rows[r, :n] = torch.arange(corpus.offsets[k], corpus.offsets[k] + n)
        cand = torch.tensor(list(valid_anchors(n, corpus.prompt_len[k])), dtype=torch.long)
        if anchors and len(cand) > anchors:
            cand = cand[torch.randperm(len(cand), generator=gen)[:anchors]].sort().values
        picks.append(cand)
    a = max(1, max(len(p) for p in picks))
    anc = torch.zeros(b, a, dtype=torch.long)
    ok = torch.zeros(b, a, dtype=torch.bool)
    for r, p in enumerate(picks):
        anc[r, : len(p)] = p
        ok[r, : len(p)] = True
    feats = corpus.feats[rows].float()
    final = corpus.final[rows].float() if corpus.final is not None else None
    return AnchorBatch(tokens.to(device), torch.tensor(lens, device=device),
                 torch.tensor([corpus.prompt_len[k] for k in seq_ids], device=device), feats.to(device),
                 None if final is None else final.to(device), anc.to(device), ok.to(device))


def take(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, T, ...] at positions idx [B, A] -> [B, A, ...]."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], idx]


def token_at(batch: AnchorBatch, offset: int) -> tuple[Tensor, Tensor]:
    """Token x_{i+offset} of every anchor i [B, A] and whether it is a response token."""
    j = batch.anchors + offset
    ok = batch.anchor_ok & (j < batch.lengths[:, None]) & (j >= batch.prompt_len[:, None])
    return batch.tokens.gather(1, j.clamp(max=batch.tokens.shape[1] - 1)), ok
