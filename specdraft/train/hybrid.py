"""Training the hybrid drafter (Gumiho; Medusa with S = 0, EAGLE-style with M = 0) and the EAGLE-3
drafter (``arch="eagle3"``: ``nn.eagle3``, S serial steps, no heads, the same loss).

Data: the target's own greedy responses (``specdraft data build``) and its cached features
(``specdraft data features``).  The response tokens are the labels: the target's feature at
position i predicted x_{i+1}, so for an *anchor* i the draft of depth d is labelled x_{i+1+d}.

Per batch of whole sequences (teacher forcing, EAGLE-3's training-time test for the serial part):
- serial step 1 runs over every position i with input (f_i, x_{i+1}) under a causal mask: its K/V
  are the context every later step attends to, exactly as the drafter's cache at inference;
- serial step s >= 2 runs only at the sampled anchors (position i+s-1, input: the anchor's step
  s-1 output and x_{i+s}), attending to step 1's K/V at positions <= i plus the anchor's own
  earlier steps (a diagonal mask per step block);
- parallel head j reads [h^1 .. h^S ; e(x_{i+S+1})] (S = 0: [g(f_i) ; e(x_{i+1})]) and predicts
  x_{i+S+2+j}.
Loss: cross-entropy over the draft vocabulary at every depth d, weighted ``decay^(d-1)``, plus
optionally SmoothL1 of serial state h^s onto the target's final feature f_{i+s}.  ``distill`` A
takes share A of each depth's cross-entropy against the target's own distribution (softmax of its
final feature f_{i+d} through the same LM-head rows) instead of the one-hot label.  Labels outside
the draft vocabulary or outside the response are masked.  Every epoch samples ``anchors``
positions per sequence (fixed by seed and epoch), so its cost is set, and the per-epoch state
(weights, optimizer, history) makes training resumable to the same weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import MODELS, load_draft_model, target_identity
from specdraft.nn.eagle3 import Eagle3Config
from specdraft.nn.hybrid import HybridConfig, HybridModel
from specdraft.train.corpus import (AnchorBatch, load_training_data, make_batch, plan_epoch,
                                    split_and_vocabulary, take, token_at)
from specdraft.train.data import data_hashes, data_record, data_sha256, manifest_sha256
from specdraft.train.loop import (adamw, all_sum, barrier, current_ranks, optimizer_step, resume, save_fp16, save_state,
                                  set_lr, shard_rows, state_path)


@dataclass
class HybridTrainConfig:
    arch: str = "hybrid"  # "hybrid" (nn.hybrid) or "eagle3" (nn.eagle3: EAGLE-3's exact architecture; parallel 0)
    serial: int = 2  # S: serial draft positions
    parallel: int = 5  # M: parallel MLP heads
    serial_layers: int = 1  # decoder layers of the serial part
    head_blocks: int = 1  # residual blocks per MLP head
    feature_layers: tuple[int, ...] = (-1,)  # target features read by the drafter
    draft_vocab: int = 8192  # LM-head rows drafted from (0 = the full vocabulary)
    draft_rows: int = 0  # drafting reads only the draft vocabulary's first N rows by default (written as the
    # manifest's draft_rows; 0 = all of them): e.g. a full vocabulary kept for an export, drafted from its most frequent rows
    width: int = 0  # the drafter's own hidden size (0 = the target's; hybrid only)
    epochs: int = 4
    anchors: int = 64  # anchors sampled per sequence and epoch (0 = every response position)
    batch_tokens: int = 4096  # padded tokens per batch (whole sequences)
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_steps: int = 50
    decay: float = 0.8  # loss weight of draft depth d: decay^(d-1)
    feature_loss: float = 0.0  # weight of SmoothL1(h^s, f_{i+s}) for the serial states (0 = CE only)
    serial_unroll: int = 0  # serial steps unrolled in training (0 = S); steps past S train the serial part only
    head_grad: float = 1.0  # share of the MLP heads' loss gradient that reaches the serial states they read (0 = detached)
    distill: float = 0.0  # share of each depth's cross-entropy taken against the target's own distribution (0 = labels only)
    init: str = ""  # a trained hybrid checkpoint of the same shape to start from (its weights and draft vocabulary)
    holdout: float = 0.05  # share of sequences held out for validation
    shards: int = 0  # use the first N data shards only (0 = all)
    seed: int = 0

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        if self.arch not in MODELS or self.arch == "block":
            raise SpecdraftError(f"arch must be 'hybrid' or 'eagle3' (got {self.arch!r})")
        if self.arch == "eagle3" and (self.parallel or self.serial_layers != 1 or self.serial < 1 or self.width):
            raise SpecdraftError("an eagle3 drafter is serial steps of one layer at the target's width: serial >= 1, "
                                 "parallel 0, serial_layers 1, width 0")
        if not 0.0 <= self.head_grad <= 1.0:
            raise SpecdraftError(f"head_grad must be in [0, 1] (got {self.head_grad})")
        if not 0.0 <= self.distill <= 1.0:
            raise SpecdraftError(f"distill must be in [0, 1] (got {self.distill})")
        if self.serial_unroll and (self.serial == 0 or self.serial_unroll < self.serial):
            raise SpecdraftError(f"serial_unroll ({self.serial_unroll}) needs a serial part and must be >= serial "
                                 f"({self.serial}); 0 unrolls exactly the serial steps")

    def model_config(self, tcfg) -> HybridConfig | Eagle3Config:
        if self.arch == "eagle3":
            return Eagle3Config.for_target(tcfg, feature_layers=self.feature_layers, steps=self.serial,
                                           draft_vocab=self.draft_vocab)
        return HybridConfig.for_target(tcfg, serial=self.serial, parallel=self.parallel,
                                       serial_layers=self.serial_layers, head_blocks=self.head_blocks,
                                       feature_layers=self.feature_layers, draft_vocab=self.draft_vocab,
                                       width=self.width)


# ---------------------------------------------------------------------------- loss


@dataclass
class DepthStats:
    n: list[int]  # labelled anchors per depth
    correct: list[int]  # top-1 hits per depth
    ce: list[float]  # summed cross-entropy per depth

    @classmethod
    def empty(cls, depth: int) -> "DepthStats":
        return cls([0] * depth, [0] * depth, [0.0] * depth)

    def add(self, other: "DepthStats") -> None:
        for i in range(len(self.n)):
            self.n[i] += other.n[i]
            self.correct[i] += other.correct[i]
            self.ce[i] += other.ce[i]

    def summary(self) -> dict:
        return {"top1": [c / n if n else 0.0 for c, n in zip(self.correct, self.n)],
                "ce": [c / n if n else 0.0 for c, n in zip(self.ce, self.n)], "labels": list(self.n)}


def final_at(batch: AnchorBatch, offset: int) -> Tensor:
    """The target's final feature f_{i+offset} of every anchor i [B, A, H] (it predicted
    x_{i+offset+1}, the label of draft depth ``offset``)."""
    return take(batch.final, (batch.anchors + offset).clamp(max=batch.tokens.shape[1] - 1))


def scale_grad(x: Tensor, share: float) -> Tensor:
    """``x`` in the forward pass (exactly: the added term is zero); in the backward pass only
    ``share`` of the gradient flows into it."""
    if share >= 1.0:
        return x
    base = x.detach()
    return base if share <= 0.0 else base + share * (x - base)


def draft_states(model: HybridModel, batch: AnchorBatch, unroll: int = 0, head_grad: float = 1.0) -> list[Tensor]:
    """Teacher-forced drafter states at every anchor: per depth d = 1 .. S+M, [B, A, W], the state
    whose LM-head scores draft depth d (label x_{i+1+d}); the same maths as the drafter's steps.
    ``unroll`` > S runs the serial part for that many steps and appends the extra serial states
    (depths S+1 .. unroll) after the S+M drafter states: a training signal for the serial part only
    (EAGLE-3's training-time test past S); the heads still read the first S.  ``head_grad`` < 1
    lets only that share of the heads' gradient into the serial states (0: the serial part trains on
    its own depths only, and the heads learn to read whatever it computes)."""
    mc = model.cfg
    tok, anc = batch.tokens, batch.anchors
    b, t = tok.shape
    a = anc.shape[1]
    dev = tok.device
    if mc.serial > 0:
        # step 1 over every position i (input f_i, x_{i+1}), causal
        g = model.feature(batch.feats)  # [B, T, W]
        causal = torch.tril(torch.ones(t - 1, t - 1, dtype=torch.bool, device=dev))[None, None]
        pos = torch.arange(t - 1, device=dev)[None].expand(b, -1)
        h1, ctx = model.serial(g[:, : t - 1], tok[:, 1:], pos, causal)
        hs = [take(h1, anc)]  # [B, A, W]
        sees_ctx = torch.arange(t - 1, device=dev)[None, None] <= anc[:, :, None]  # [B, A, T-1]
        own = torch.eye(a, dtype=torch.bool, device=dev)[None].expand(b, -1, -1)
        blocks: list[list[tuple[Tensor, Tensor]]] = []
        for s in range(2, max(mc.serial, unroll) + 1):
            x_tok, _ = token_at(batch, s)
            mask = torch.cat([sees_ctx] + [own] * (len(blocks) + 1), -1)[:, None]  # [B, 1, A, T-1 + (s-1) A]
            past = [(torch.cat([ctx[i][0]] + [blk[i][0] for blk in blocks], 2),
                     torch.cat([ctx[i][1]] + [blk[i][1] for blk in blocks], 2)) for i in range(len(ctx))]
            h, new = model.serial(hs[-1], x_tok, anc + s - 1, mask, past)
            blocks.append(new)
            hs.append(h)
        hs, extra = hs[: mc.serial], hs[mc.serial:]
        head_in = [scale_grad(h, head_grad) for h in hs]
    else:
        extra = []
        hs, head_in = [], [model.feature(take(batch.feats, anc))]
    if mc.parallel > 0:
        last_tok, _ = token_at(batch, mc.serial + 1)
        x = torch.cat(head_in + [model.embed[last_tok]], -1)  # [B, A, max(S,1) W + H]
        states = model.head_states(x.flatten(0, 1)).unflatten(0, (b, a))  # [B, A, M, W]
        hs += [states[:, :, j] for j in range(mc.parallel)]
    return hs + extra


def loss_depths(mc, cfg: HybridTrainConfig) -> list[int]:
    """The draft depth of every state ``draft_states`` returns: 1 .. S+M, then the unrolled serial
    steps' own depths S+1 .. unroll."""
    extra = max(0, cfg.serial_unroll - mc.serial) if mc.serial else 0
    return list(range(1, mc.depth + 1)) + list(range(mc.serial + 1, mc.serial + 1 + extra))


def labels(batch: AnchorBatch, t2d: Tensor, d: int) -> tuple[Tensor, Tensor]:
    """Draft-vocabulary labels of depth d at every anchor [B, A] and which are real (a response token
    inside the draft vocabulary)."""
    lab, ok = token_at(batch, 1 + d)
    lab = t2d[lab]
    return lab, ok & (lab >= 0)


def label_counts(mc, batch: AnchorBatch, t2d: Tensor, cfg: HybridTrainConfig) -> list[int]:
    """Labelled anchors of every loss term of ``losses`` (what it divides by when alone)."""
    return [int(labels(batch, t2d, d)[1].sum()) for d in loss_depths(mc, cfg)]


def losses(model: HybridModel, batch: AnchorBatch, t2d: Tensor, cfg: HybridTrainConfig,
           counts: list[float] | None = None) -> tuple[Tensor, DepthStats]:
    """Weighted loss of one batch and its per-depth statistics (see the module docstring).  Each
    term is divided by ``counts`` (default: this batch's own label counts; across processes the
    global ones, ``train.loop``)."""
    mc = model.cfg
    stats = DepthStats.empty(mc.depth)
    total = torch.zeros((), device=batch.tokens.device)
    depths = loss_depths(mc, cfg)
    for k, (h, d) in enumerate(zip(draft_states(model, batch, cfg.serial_unroll, cfg.head_grad), depths), 1):
        w = cfg.decay ** (d - 1)
        lab, ok = labels(batch, t2d, d)
        n = int(ok.sum())
        if n == 0:
            continue
        norm = counts[k - 1] if counts is not None else n
        logits = model.logits(h[ok]).float()  # [n, V'] only for labelled anchors
        ce = F.cross_entropy(logits, lab[ok], reduction="sum")
        if cfg.distill > 0 and batch.final is not None:
            # soft labels: the target's own distribution over the draft vocabulary at the position
            # that predicted the label (its final feature f_{i+d} through the same LM-head rows)
            with torch.no_grad():
                teacher = torch.softmax(model.teacher_logits(final_at(batch, d)[ok]).float(), -1)
            soft = -(teacher * torch.log_softmax(logits, -1)).sum()
            total = total + w * ((1 - cfg.distill) * ce + cfg.distill * soft) / norm
        else:
            total = total + w * ce / norm
        if k > mc.depth:
            continue  # an unrolled serial step past S: trains the serial part, not a drafter depth
        stats.n[d - 1] += n
        stats.correct[d - 1] += int((logits.argmax(-1) == lab[ok]).sum())
        stats.ce[d - 1] += float(ce.detach())
        if d <= mc.serial and cfg.feature_loss > 0 and batch.final is not None:
            # h^d (lifted to the target's width) should match the target's final feature f_{i+d} (which
            # predicted the same token)
            lifted = model.lift_state(h[ok])
            reg = F.smooth_l1_loss(lifted, final_at(batch, d)[ok], reduction="sum") / lifted.shape[-1]
            total = total + cfg.feature_loss * w * reg / norm
    return total, stats


class TrainStep(nn.Module):
    """One batch's loss as a module's forward, the unit DistributedDataParallel wraps."""

    def __init__(self, model: HybridModel, t2d: Tensor, cfg: HybridTrainConfig) -> None:
        super().__init__()
        self.model, self.cfg = model, cfg
        self.register_buffer("t2d", t2d, persistent=False)

    def forward(self, batch: AnchorBatch, counts: list[float] | None = None, scale: float = 1.0):
        if batch.tokens.shape[0] == 0:  # a rank without sequences in this batch still joins the gradient average
            return sum(p.sum() for p in self.model.parameters()) * 0.0, DepthStats.empty(self.model.cfg.depth)
        loss, stats = losses(self.model, batch, self.t2d, self.cfg, counts)
        return loss * scale, stats


# ---------------------------------------------------------------------------- training


def _init_checkpoint(target, cfg: HybridTrainConfig, mcfg: HybridConfig) -> tuple[dict, dict]:
    """The state (weights and ``vocab_ids``) and manifest of ``cfg.init``, loaded as the drafter
    loader does (target, kind and tensors checked), refused unless its configuration is exactly the
    one this run trains."""
    ckpt = load_draft_model(target, cfg.init, cfg.arch)
    model, manifest = ckpt.model, ckpt.manifest
    theirs, ours = asdict(model.cfg), asdict(mcfg)
    diff = sorted(k for k in ours if theirs.get(k) != ours[k])
    if diff:
        raise SpecdraftError(f"--init {cfg.init} is a drafter of another shape: "
                             + ", ".join(f"{k} {theirs.get(k)!r} (this run: {ours[k]!r})" for k in diff))
    return model.state_dict(), manifest


def _check_init_split(init: str, manifest: dict, cfg: HybridTrainConfig, data_dirs: list, data_manifests: list[dict],
                      groups: list[int]) -> None:
    """Refuse a fine-tune whose held-out sequences the starting checkpoint trained on: a folder it was
    trained on must be split the same way here (same seed, holdout share and sequences)."""
    train = manifest.get("train") or {}
    ours = {h: (d, n) for d, m, n in zip(data_dirs, data_manifests, groups) for h in data_hashes(m)}
    for rec in [manifest.get("data") or {}] + list(manifest.get("data_more") or []):
        if rec.get("manifest_sha256") not in ours:
            continue
        d, n = ours[rec["manifest_sha256"]]
        theirs = (train.get("seed"), train.get("holdout"), rec.get("sequences"))
        if theirs != (cfg.seed, cfg.holdout, n):
            raise SpecdraftError(f"--init {init} was trained on {d} with seed {theirs[0]}, holdout {theirs[1]} and "
                                 f"{theirs[2]} sequences; this run has seed {cfg.seed}, holdout {cfg.holdout} and {n}, "
                                 "so its held-out sequences would include ones the checkpoint trained on")


def _init_fingerprint(manifest: dict) -> str:
    """What identifies a starting checkpoint for resuming (not the budget profile `train profile` adds later)."""
    return manifest_sha256({k: manifest.get(k) for k in ("config", "train", "data", "data_more", "history", "train_wall_s")})


def train_hybrid(target, data_dir, feat_dir, out: str | Path, cfg: HybridTrainConfig,
                 quiet: bool = False, log=print) -> dict:
    """Train a hybrid drafter for ``target`` and write ``out`` (safetensors + manifest).  Re-running
    the same command after an interruption resumes after the last finished epoch.

    ``data_dir`` / ``feat_dir``: a data folder and its feature folder, or equal-length lists of them
    (trained on together; each folder keeps its own held-out split).  ``cfg.init``: start from a
    trained checkpoint of the same configuration (fine-tuning), keeping its draft vocabulary."""
    out = Path(out)
    ranks = current_ranks()  # across processes (``train.loop``): rank 0 logs and writes
    if not ranks.main:
        quiet, log = True, (lambda *a, **k: None)
    dev = target.device
    tcfg = target.config
    mcfg = cfg.model_config(tcfg)
    tcfg.check_layers(cfg.feature_layers)
    corpus, data_dirs, data_manifests, groups = load_training_data(
        target, data_dir, feat_dir, cfg.feature_layers, shards=cfg.shards,
        need_final=(cfg.feature_loss > 0 and cfg.serial > 0) or cfg.distill > 0)
    data_manifest = data_manifests[0]
    init_tensors, init_manifest = _init_checkpoint(target, cfg, mcfg) if cfg.init else (None, None)
    if init_manifest is not None:
        if Path(cfg.init).resolve() == out.resolve():
            raise SpecdraftError(f"--init and --out are the same file ({out}); write the fine-tuned drafter elsewhere")
        _check_init_split(cfg.init, init_manifest, cfg, data_dirs, data_manifests, groups)
    train_ids, val_ids, vocab_ids, t2d, covered = split_and_vocabulary(
        corpus, cfg.seed, cfg.holdout, cfg.draft_vocab, target, groups=groups,
        vocab_ids=None if init_tensors is None else init_tensors["vocab_ids"].long())

    torch.manual_seed(cfg.seed)
    tm = target.model
    model = MODELS[cfg.arch][1](mcfg, tm.embed.weight.float(), tm.lm_head.weight.float(), vocab_ids.to(dev)).to(dev).train()
    if init_tensors is not None:
        model.load_state_dict({k: v.to(dev) for k, v in init_tensors.items()})
        log(f"starting from {cfg.init} ({len(init_manifest.get('history', []))} epochs trained)")
    n_target = sum(p.numel() for p in tm.parameters())
    width = f", width {model.layer_cfg.hidden_size}" if model.layer_cfg.hidden_size != tcfg.hidden_size else ""
    log(f"{mcfg.kind} drafter (serial {mcfg.serial}, parallel {mcfg.parallel}{width}): {model.n_params():,} trainable "
        f"parameters ({model.n_params() / n_target:.1%} of the target); draft vocabulary {len(vocab_ids)} tokens "
        f"covering {covered:.2%} of training response tokens; {len(train_ids)} training / {len(val_ids)} held-out sequences")
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    step_fn = TrainStep(model, t2d, cfg)
    runner = DistributedDataParallel(step_fn) if ranks.world > 1 else step_fn
    if ranks.world > 1:
        log(f"training on {ranks.world} processes: each takes its share of every batch's sequences")
    plans = [plan_epoch(corpus, train_ids, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed * 1000 + e))
             for e in range(cfg.epochs)]
    total_steps = sum(len(p) for p in plans)
    spath = state_path(out)
    fp_cfg = asdict(cfg)
    for name in ("distill", "init", "arch", "width"):  # absent at their defaults, so runs started before the options still resume
        if not fp_cfg[name] or fp_cfg[name] == "hybrid":
            del fp_cfg[name]
    fp_data = data_sha256(data_manifest) if len(data_manifests) == 1 else [data_sha256(m) for m in data_manifests]
    fp = {"config": fp_cfg, "data": fp_data, "target": target.weight_hash}
    if init_manifest is not None:
        fp["init"] = _init_fingerprint(init_manifest)
    fingerprint = json.loads(json.dumps(fp))
    start_epoch, history = 0, []
    meta = resume(spath, fingerprint, model, opt, log)
    if meta is not None:
        start_epoch, history = meta["epoch"], meta["history"]
        log(f"resuming from {spath} after epoch {start_epoch}")

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        st = DepthStats.empty(mcfg.depth)
        gen = torch.Generator().manual_seed(12345)
        for ids in plan_epoch(corpus, val_ids, cfg.batch_tokens, gen):
            st.add(losses(model, make_batch(corpus, ids, cfg.anchors, gen, dev), t2d, cfg)[1])
        model.train()
        return st.summary()

    t_train = time.perf_counter()
    step = sum(len(p) for p in plans[:start_epoch])
    for epoch in range(start_epoch, cfg.epochs):
        gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch + 7)
        bar = tqdm(plans[epoch], desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=quiet)
        run_loss, seen, t_epoch = 0.0, DepthStats.empty(mcfg.depth), time.perf_counter()
        for i, ids in enumerate(bar):
            batch = make_batch(corpus, ids, cfg.anchors, gen, dev)
            set_lr(opt, cfg.lr, step, total_steps, cfg.warmup_steps)
            counts = None
            if ranks.world > 1:  # every rank built the whole batch: it trains on its rows, normalised by the batch's counts
                counts = label_counts(mcfg, batch, t2d, cfg)
                batch = batch.rows(shard_rows(len(ids), ranks))
            loss, st = runner(batch, counts, float(ranks.world))
            lv = optimizer_step(model, opt, loss, f"at epoch {epoch + 1}")
            if ranks.world > 1:
                lv = all_sum([lv], ranks)[0] / ranks.world
                st = DepthStats(*[[int(x) if j < 2 else x for x in all_sum(v, ranks)] for j, v in
                                  enumerate((st.n, st.correct, st.ce))])
            step += 1
            run_loss = 0.95 * run_loss + 0.05 * lv if i else lv
            seen.add(st)
            if i == 4 and len(plans[epoch]) > 10:
                per = (time.perf_counter() - t_epoch) / 5
                log(f"epoch {epoch + 1}: {len(plans[epoch])} batches, expected {per * len(plans[epoch]) / 60:.1f} min "
                    f"per epoch at {per:.2f} s per batch")
            if i % 10 == 0:
                bar.set_postfix(loss=f"{run_loss:.3f}", top1=f"{seen.summary()['top1'][0]:.2f}")
        bar.close()
        ev = evaluate()
        tr = seen.summary()
        history.append({"epoch": epoch + 1, "train_loss": run_loss, "train_top1": tr["top1"], "val_top1": ev["top1"],
                        "val_ce": ev["ce"], "epoch_s": time.perf_counter() - t_epoch})
        log(f"epoch {epoch + 1}: train loss {run_loss:.3f}; held-out top-1 per depth "
            + " ".join(f"{x:.1%}" for x in ev["top1"]) + "; CE " + " ".join(f"{x:.2f}" for x in ev["ce"])
            + f" ({time.perf_counter() - t_epoch:.0f}s)")
        if ranks.main:
            save_state(spath, model, opt, {"fingerprint": fingerprint, "epoch": epoch + 1, "history": history})
        barrier(ranks)

    manifest = {
        "kind": cfg.arch,
        **target_identity(target),
        "config": asdict(mcfg),
        "drafter": mcfg.kind,
        "train": asdict(cfg),
        "draft_vocab_coverage": covered,
        **({"draft_rows": cfg.draft_rows} if cfg.draft_rows else {}),
        "data": data_record(data_dirs[0], data_manifest, groups[0]),
        "history": history,
        "params": model.n_params(),
        "target_params": n_target,
        "train_wall_s": time.perf_counter() - t_train,
    }
    if len(data_dirs) > 1:  # "data" stays the first folder, whose held-out split a budget profile replays
        manifest["data_more"] = [data_record(d, m, n) for d, m, n in zip(data_dirs[1:], data_manifests[1:], groups[1:])]
    if init_manifest is not None:
        manifest["init"] = {"path": str(cfg.init), "manifest_sha256": manifest_sha256(init_manifest),
                            "train": init_manifest.get("train"), "data": init_manifest.get("data"),
                            "history": init_manifest.get("history"), "train_wall_s": init_manifest.get("train_wall_s")}
        for key in ("data_more", "init"):  # a fine-tune of a fine-tune keeps the whole history
            if key in init_manifest:
                manifest["init"][key] = init_manifest[key]
    if ranks.main:
        save_fp16(out, model.state_dict(), manifest)
        log(f"wrote {out}")
    barrier(ranks)
    return manifest
