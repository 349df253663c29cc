"""Phrase drafter training: vocabulary mining, labels and the head's training loop (the head
itself: ``specdraft.nn.phrase``).

Words are the target tokenizer's pre-tokenizer units (a BPE token never crosses one).  A draft
entry is a span of one to three consecutive words of the target's regenerated responses; a span
may start inside a word (the *remainder* of that word counts as its first word), so a position
left mid-word by a rejected draft still gets proposals.  Each entry's expansion into target
tokens is the greedy longest match of its text over the target vocabulary; an entry is kept
only when that expansion equals the tokenization the target itself produced in context.
Entries are ranked by the tokens they are expected to save (occurrences x length).

Head input at a decoding step whose root (last committed, not yet verified) token is x_n: the
final hidden state h_{n-1} (the state that predicted x_n) and the embedding of x_n.  It predicts
the entry that continues x_{n+1}, ...: the label is the longest entry whose expansion is a prefix
of the continuation; positions without one are masked out of the loss.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from specdraft.drafters.phrase import PhraseDrafter, PhraseOptions
from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import load_checkpoint, save_checkpoint, target_identity
from specdraft.nn.phrase import FEATURE_LAYER, PhraseHead, PhraseHeadConfig, PhraseVocab
from specdraft.replay import simulate
from specdraft.train.data import check_data_target, data_sha256, load_sequences, read_features, read_manifest
from specdraft.train.loop import adamw, optimizer_step, resume, save_fp16, save_state, set_lr, state_path
from specdraft.train.profile import PROFILE_BUDGETS

# ---------------------------------------------------------------------------- words and expansion


class Vocab:
    """Byte-level view of a target tokenizer: pieces, greedy longest match, word starts."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.special = set(tokenizer.all_special_ids)
        self.piece_of = {i: p for p, i in vocab.items()}
        self.id_of = {p: i for p, i in vocab.items() if i not in self.special}
        self.max_piece = max(len(p) for p in self.id_of)
        self.pre = tokenizer.backend_tokenizer.pre_tokenizer

    def pieces(self, ids: list[int]) -> str:
        return "".join(self.piece_of[i] for i in ids)

    def longest_match(self, text: str) -> list[int] | None:
        """Greedy longest-match expansion of a byte-level string into token ids (None if stuck)."""
        out, p = [], 0
        while p < len(text):
            for n in range(min(self.max_piece, len(text) - p), 0, -1):
                tid = self.id_of.get(text[p : p + n])
                if tid is not None:
                    out.append(tid)
                    p += n
                    break
            else:
                return None
        return out

    def word_starts(self, ids: list[int]) -> list[bool] | None:
        """For each token, whether it starts a pre-tokenizer word (None if the text does not round-trip)."""
        byte_text = self.pieces(ids)
        try:
            text = self.tokenizer.convert_tokens_to_string([self.piece_of[i] for i in ids])
        except Exception:
            return None
        words = self.pre.pre_tokenize_str(text)
        if "".join(w for w, _ in words) != byte_text:
            return None  # undecodable bytes: skip the response
        bounds, pos = set(), 0
        for w, _ in words:
            bounds.add(pos)
            pos += len(w)
        starts, pos = [], 0
        for i in ids:
            starts.append(pos in bounds)
            pos += len(self.piece_of[i])
        return starts


def split_response(seq_tokens: list[int], prompt_len: int, special: set[int]) -> list[int]:
    """The response tokens up to (not including) the first special token."""
    out = []
    for t in seq_tokens[prompt_len:]:
        if t in special:
            break
        out.append(t)
    return out


# ---------------------------------------------------------------------------- mining


def count_spans(responses: list[list[int]], vocab: Vocab, max_words: int = 3, max_tokens: int = 8) -> tuple[Counter, int]:
    """Occurrences of every 1..max_words-word span (starting at any token) of the responses."""
    counts: Counter = Counter()
    skipped = 0
    for r in responses:
        starts = vocab.word_starts(r)
        if starts is None:
            skipped += 1
            continue
        ends = [j for j in range(1, len(r)) if starts[j]] + [len(r)]  # token index where each word ends
        w = 0  # first word end strictly after i
        for i in range(len(r)):
            while ends[w] <= i:
                w += 1
            for k in range(max_words):
                if w + k >= len(ends):
                    break
                e = ends[w + k]
                if e - i > max_tokens:
                    break
                counts[tuple(r[i:e])] += 1
    return counts, skipped


def mine_vocab(responses: list[list[int]], vocab: Vocab, size: int = 8000, max_words: int = 3,
               max_tokens: int = 8, min_count: int = 2) -> PhraseVocab:
    """The ``size`` entries expected to save the most tokens (occurrences x expansion length)."""
    if size < 1:
        raise SpecdraftError(f"vocabulary size must be >= 1 (got {size})")
    counts, skipped = count_spans(responses, vocab, max_words, max_tokens)
    ranked = sorted(((c * len(s), c, s) for s, c in counts.items() if c >= min_count), key=lambda x: (-x[0], x[2]))
    texts, exps, cnts = [], [], []
    seen: set[str] = set()
    mismatched = partial = 0
    for _, c, span in ranked:
        text = vocab.pieces(list(span))
        if text in seen:
            continue
        if "\ufffd" in vocab.tokenizer.convert_tokens_to_string([vocab.piece_of[i] for i in span]):
            partial += 1  # starts or ends inside a multi-byte character: not a phrase of text
            continue
        exp = vocab.longest_match(text)
        if exp != list(span):
            mismatched += 1  # the target tokenizes this text differently in context: not expandable
            continue
        seen.add(text)
        texts.append(text)
        exps.append(list(span))
        cnts.append(c)
        if len(texts) >= size:
            break
    stats = {"responses": len(responses), "responses_skipped": skipped, "distinct_spans": len(counts),
             "spans_min_count": sum(1 for c in counts.values() if c >= min_count),
             "dropped_expansion_mismatch": mismatched, "dropped_partial_character": partial, "max_words": max_words, "max_tokens": max_tokens,
             "min_count": min_count}
    return PhraseVocab(texts, exps, cnts, stats)


def longest_entry(trie: dict, tokens: list[int], start: int, end: int | None = None) -> int:
    """Index of the longest entry whose expansion is a prefix of tokens[start:end] (-1 if none)."""
    end = len(tokens) if end is None else end
    node, best = trie, -1
    for p in range(start, end):
        node = node.get(tokens[p])
        if node is None:
            break
        best = node.get(-1, best)
    return best


# ---------------------------------------------------------------------------- head


# ---------------------------------------------------------------------------- training data


@dataclass
class PhraseExamples:
    feat_index: Tensor  # [N] row of the flat feature tensor holding h_{n-1}
    root: Tensor  # [N] token x_n
    label: Tensor  # [N] entry index
    seq: Tensor  # [N] sequence index (for the held-out split)
    positions: int  # response positions considered (labelled or not)


def build_examples(seqs, pvocab: PhraseVocab, special: set[int]) -> PhraseExamples:
    """One example per response position n (root x_n) with a matching entry; features row = n - 1."""
    trie = pvocab.trie()
    fi, roots, labels, sid = [], [], [], []
    offset, positions = 0, 0
    for k, s in enumerate(seqs):
        toks = s.tokens
        resp_end = s.prompt_len + len(split_response(toks, s.prompt_len, special))
        for n in range(s.prompt_len, resp_end - 1):
            positions += 1
            lab = longest_entry(trie, toks, n + 1, resp_end)
            if lab >= 0:
                fi.append(offset + n - 1)
                roots.append(toks[n])
                labels.append(lab)
                sid.append(k)
        offset += len(toks)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return PhraseExamples(t(fi), t(roots), t(labels), t(sid), positions)


def load_feature_rows(feat_dir: str | Path, data_manifest: dict, layer: int = FEATURE_LAYER) -> Tensor:
    """The cached fp16 features of ``layer`` for every token of every shard, concatenated."""
    return read_features(feat_dir, [s["file"] for s in data_manifest["shards"]], (layer,))


def held_out(n_seq: int, seed: int, share: float) -> list[int]:
    """Indices of the sequences held out for validation (the same split for training and profiling)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n_seq, generator=g)[: max(1, int(n_seq * share))].tolist()


def seq_offsets(seqs) -> list[int]:
    """Row of each sequence's first token in the concatenated feature rows (and the total at the end)."""
    offsets = [0]
    for sq in seqs:
        offsets.append(offsets[-1] + len(sq.tokens))
    return offsets


# ---------------------------------------------------------------------------- training


@dataclass
class PhraseTrainConfig:
    vocab_size: int = 8000  # draft vocabulary entries mined
    epochs: int = 4
    batch_size: int = 1024  # labelled positions per step
    lr: float = 2e-3
    weight_decay: float = 0.01  # on the weight matrices (not the biases)
    warmup_steps: int = 100  # linear warm-up, then cosine to zero
    holdout: float = 0.05  # share of sequences held out for validation
    seed: int = 0
    bottleneck: int = 256  # the head's hidden width
    use_root_embedding: bool = True  # the head also reads the root token's embedding


def train_phrase(target, data_dir: str | Path | list, feat_dir: str | Path | list, out: str | Path,
                 cfg: PhraseTrainConfig, quiet: bool = False, log=print) -> dict:
    """Mine the vocabulary, train the head, write ``out`` (safetensors + manifest).  Resumable.
    ``data_dir`` / ``feat_dir``: one folder each, or lists paired in order (trained on together; each
    folder holds out its own share, so the first folder's held-out sequences are the same whatever
    folders train beside it, and a profile can replay them from that folder alone)."""
    out = Path(out)
    dirs = [Path(d) for d in (data_dir if isinstance(data_dir, (list, tuple)) else [data_dir])]
    fdirs = [Path(d) for d in (feat_dir if isinstance(feat_dir, (list, tuple)) else [feat_dir])]
    if len(dirs) != len(fdirs):
        raise SpecdraftError(f"{len(dirs)} data folders but {len(fdirs)} feature folders: give one --features per --data")
    manifests, seqs, parts, held = [], [], [], []
    for d, fd in zip(dirs, fdirs):
        m = read_manifest(d)
        check_data_target(m, target, d)
        mine = load_sequences(d)
        f = load_feature_rows(fd, m)
        if f.shape[0] != sum(len(s.tokens) for s in mine):
            raise SpecdraftError(f"features in {fd} do not match the data in {d}: recompute them")
        held += [len(seqs) + i for i in held_out(len(mine), cfg.seed, cfg.holdout)]
        manifests.append(m)
        seqs += mine
        parts.append(f)
    feats = parts[0] if len(parts) == 1 else torch.cat(parts)
    del parts
    voc = Vocab(target.tokenizer)
    responses = [split_response(s.tokens, s.prompt_len, voc.special) for s in seqs]
    t0 = time.perf_counter()
    pvocab = mine_vocab(responses, voc, cfg.vocab_size)
    ex = build_examples(seqs, pvocab, voc.special)
    cover = len(ex.label) / max(1, ex.positions)
    log(f"vocabulary: {len(pvocab)} entries mined in {time.perf_counter() - t0:.0f}s; "
        f"{len(ex.label):,} of {ex.positions:,} response positions ({cover:.1%}) have a matching entry")
    embed = target.model.embed.weight.detach().float().cpu()

    n_seq = len(seqs)
    is_held = torch.zeros(n_seq, dtype=torch.bool)
    is_held[held] = True
    val = is_held[ex.seq]
    tr_idx, va_idx = (~val).nonzero().squeeze(1), val.nonzero().squeeze(1)

    torch.manual_seed(cfg.seed)
    head = PhraseHead(PhraseHeadConfig(target.config.hidden_size, len(pvocab), cfg.bottleneck, cfg.use_root_embedding))
    n_target = sum(p.numel() for p in target.model.parameters())
    log(f"head: {head.n_params():,} parameters ({head.n_params() / n_target:.3%} of the target's {n_target:,}); "
        f"output layer {len(pvocab)} x {cfg.bottleneck + 1}")
    opt = adamw(head, cfg.lr, cfg.weight_decay)
    steps_per_epoch = math.ceil(len(tr_idx) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs

    spath = state_path(out)
    data_ids = [data_sha256(m) for m in manifests]
    fingerprint = json.loads(json.dumps({"config": asdict(cfg), "data": data_ids[0] if len(dirs) == 1 else data_ids,
                                         "target": target.weight_hash}))
    start_epoch, history = 0, []
    meta = resume(spath, fingerprint, head, opt, log)
    if meta is not None:
        start_epoch, history = meta["epoch"], meta["history"]
        log(f"resuming from {spath} after epoch {start_epoch}")

    def batch(idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = feats[ex.feat_index[idx]].float()
        e = embed[ex.root[idx]]
        return h, e, ex.label[idx]

    @torch.no_grad()
    def evaluate() -> dict:
        head.eval()
        top1 = top8 = 0
        loss = 0.0
        for i in range(0, len(va_idx), 4096):
            h, e, y = batch(va_idx[i : i + 4096])
            logits = head(h, e)
            loss += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            top = logits.topk(min(8, logits.shape[-1]), -1).indices
            top1 += int((top[:, 0] == y).sum())
            top8 += int((top == y[:, None]).any(-1).sum())
        head.train()
        n = max(1, len(va_idx))
        return {"val_loss": loss / n, "val_top1": top1 / n, "val_top8": top8 / n}

    t_train = time.perf_counter()
    for epoch in range(start_epoch, cfg.epochs):
        perm = tr_idx[torch.randperm(len(tr_idx), generator=torch.Generator().manual_seed(cfg.seed + epoch))]
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=quiet)
        run_loss = 0.0
        for step in bar:
            h, e, y = batch(perm[step * cfg.batch_size : (step + 1) * cfg.batch_size])
            set_lr(opt, cfg.lr, epoch * steps_per_epoch + step, total, cfg.warmup_steps)
            loss = nn.functional.cross_entropy(head(h, e), y)
            lv = optimizer_step(head, opt, loss, f"at epoch {epoch + 1}", clip=None)
            run_loss = 0.98 * run_loss + 0.02 * lv if step else lv
            if step % 20 == 0:
                bar.set_postfix(loss=f"{run_loss:.3f}")
        bar.close()
        ev = evaluate()
        ev["epoch"] = epoch + 1
        history.append(ev)
        log(f"epoch {epoch + 1}: train loss {run_loss:.3f}, val loss {ev['val_loss']:.3f}, "
            f"top-1 {ev['val_top1']:.1%}, top-8 {ev['val_top8']:.1%}")
        save_state(spath, head, opt, {"fingerprint": fingerprint, "epoch": epoch + 1, "history": history})

    manifest = {
        "kind": "phrase",
        **target_identity(target),
        "head": asdict(head.cfg),
        "train": asdict(cfg),
        "feature_layer": FEATURE_LAYER,
        "vocab": pvocab.to_json(),
        "coverage": {"labelled_positions": len(ex.label), "response_positions": ex.positions, "share": cover},
        # the first folder's sequences and hash: the held-out split a profile replays from it alone
        "data": {"dir": str(dirs[0]), "manifest_sha256": data_ids[0], "sequences": manifests[0]["sequences"],
                 "response_tokens": sum(m["response_tokens"] for m in manifests),
                 **({"folders": [{"dir": str(d), "manifest_sha256": h, "sequences": m["sequences"],
                                  "response_tokens": m["response_tokens"]} for d, h, m in zip(dirs, data_ids, manifests)]}
                    if len(dirs) > 1 else {})},
        "history": history,
        "params": head.n_params(),
        "target_params": n_target,
        "train_wall_s": time.perf_counter() - t_train,
    }
    offsets = seq_offsets(seqs)
    head16 = PhraseHead(head.cfg)
    head16.load_state_dict({k: v.to(torch.float16).float() for k, v in head.state_dict().items()})
    manifest["acceptance_by_budget"] = acceptance_profile(head16, pvocab, target, [seqs[i] for i in held],
                                                          [feats[offsets[i] : offsets[i + 1]] for i in held])
    log(f"held-out tokens per pass by budget (offline replay, with prompt lookup): {manifest['acceptance_by_budget']}")
    save_fp16(out, head.state_dict(), manifest)
    log(f"wrote {out}")
    return manifest


@torch.no_grad()
def acceptance_profile(head: PhraseHead, pvocab: PhraseVocab, target, seqs, feats: list[Tensor],
                       budgets=PROFILE_BUDGETS, max_seqs: int = 48) -> dict[str, float]:
    """Tokens per pass by node budget, replaying held-out responses offline (shipped configuration:
    phrase entries + prompt lookup).  Lets the drafter pick its budget from a machine's cost curve."""
    drafter = PhraseDrafter(head.eval(), pvocab, target.model.embed.weight.detach().cpu(), PhraseOptions())
    special = set(target.tokenizer.all_special_ids) if target.tokenizer is not None else set()
    tot = {b: [0, 0] for b in budgets}
    for sq, f in list(zip(seqs, feats))[:max_seqs]:
        resp = split_response(sq.tokens, sq.prompt_len, special)
        if len(resp) < 2:
            continue
        hidden = {FEATURE_LAYER: f[None, : sq.prompt_len + len(resp)].float()}
        for b in budgets:
            r = simulate(drafter, sq.tokens[: sq.prompt_len], resp, hidden, b)
            tot[b][0] += r["tokens"]
            tot[b][1] += r["passes"]
    return {str(b): (t / p if p else 1.0) for b, (t, p) in tot.items()}


def add_acceptance_profile(target, checkpoint: str | Path, data_dir: str | Path, feat_dir: str | Path) -> dict:
    """Compute and store ``acceptance_by_budget`` in an existing phrase checkpoint (same held-out split)."""
    tensors, manifest = load_checkpoint(checkpoint, target_hash=target.weight_hash, kind="phrase")
    seqs = load_sequences(data_dir)
    feats = load_feature_rows(feat_dir, read_manifest(Path(data_dir)))
    cfg = manifest["train"]
    held = held_out(len(seqs), cfg["seed"], cfg["holdout"])
    offsets = seq_offsets(seqs)
    head = PhraseHead(PhraseHeadConfig(**manifest["head"]))
    head.load_state_dict({k: v.float() for k, v in tensors.items()})
    manifest["acceptance_by_budget"] = acceptance_profile(head, PhraseVocab.from_json(manifest["vocab"]), target,
                                                          [seqs[i] for i in held],
                                                          [feats[offsets[i] : offsets[i + 1]] for i in held])
    save_checkpoint(checkpoint, tensors, manifest)
    return manifest["acceptance_by_budget"]
