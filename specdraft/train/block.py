"""Training the block drafter (DFlash, arXiv 2602.06036) and its multi-mode version (Multi-Future
Drafting, arXiv 2611.13017).

Data: the target's own greedy responses (``specdraft data build``) and its cached features
(``specdraft data features --layers 3,15,27,-1``).  An *anchor* is a root position a inside a
response (x_{a+1} is a response token): the block [x_a, MASK x (B-1)] at positions a .. a+B-1 sees
the context f_0 .. f_{a-1} and drafts x_{a+1} .. x_{a+B-1}.

One pass per batch of whole sequences holds many blocks per sequence (DFlash): ``anchors`` roots
per sequence, each drafted by all K modes, Q = A*K*B query rows after the sequence's context
keys, under a block mask: the rows of block (a, k) see context keys < a and their own block's
keys only, so the pass equals running every block on its own.

Loss of one block and mode: L_{a,k} = sum_j w_j CE_{a,k,j} over the labelled depths j, with
w_j = exp(-(j-1)/gamma).  Winner-take-all over modes (MFD): each block trains its winning mode,
k* = argmin_k (L_{a,k}/W_a + beta log(K s_k)), where W_a = sum_j w_j and s_k is a running
average of mode k's win share (a balancing nudge against one mode taking every block), and a
small share lambda of the loss goes to every mode so none is left untrained (against collapse):
  loss = sum_a [(1 - lambda) L_{a,k*} + lambda mean_k L_{a,k}] / sum_a W_a.
With K = 1 this is exactly the weighted cross-entropy of the single-mode drafter.  Labels outside
the draft vocabulary are masked.  The anchors of every batch are fixed by (seed, epoch, batch),
and the state (weights, optimizer, step, history, win shares) is saved every ``save_every``
steps and after every epoch, so an interrupted run resumes to the same weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from specdraft.errors import SpecdraftError
from specdraft.model.packed import native_bf16
from specdraft.nn.block import BlockConfig, BlockModel
from specdraft.nn.checkpoint import target_identity
from specdraft.train.corpus import (AnchorBatch, Corpus, load_training_data, make_batch, plan_epoch,
                                    split_and_vocabulary, token_at)
from specdraft.train.data import data_record, data_sha256
from specdraft.train.loop import adamw, optimizer_step, resume, save_fp16, save_state, set_lr, state_path


@dataclass
class BlockTrainConfig:
    modes: int = 1  # K: mode embeddings (1 = single-mode DFlash)
    draft_layers: int = 1  # drafter decoder layers
    block_size: int = 8  # B: root + B-1 drafted positions
    feature_layers: tuple[int, ...] = (3, 15, 27)  # target features fused into the context
    draft_vocab: int = 8192  # LM-head rows drafted from (0 = the full vocabulary)
    draft_rows: int = 0  # drafting reads only the draft vocabulary's first N rows by default (written as the
    # manifest's draft_rows; 0 = all of them): e.g. a full vocabulary kept for an export, drafted from its most frequent rows
    epochs: int = 1  # passes over the training sequences (ignored when ``steps`` is set)
    steps: int = 0  # optimizer steps in all (0 = ``epochs`` full epochs); same steps = same data for any K
    anchors: int = 12  # blocks per sequence and batch (0 = every response position); the defaults fit a
    # K=4 run on data/smollm2 (237 steps) in ~12-13 min on the 2-core CPU
    batch_tokens: int = 4096  # padded tokens per batch (whole sequences)
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup: float = 0.04  # share of the steps with linear warm-up, then cosine to zero
    gamma: float = 4.0  # depth weight w_j = exp(-(j-1)/gamma)
    wta_mean: float = 0.1  # lambda: share of the loss given to every mode's mean (K > 1)
    balance: float = 0.1  # beta: win-share penalty when assigning the winning mode (K > 1)
    gate: bool = True  # K > 1: train a mode gate pi_k (cross-entropy on the winning mode)
    qk_norm: bool = False  # q/k RMSNorm per head (DFlash's layers)
    mask_token: int = -1  # >= 0: mask rows = the target's embedding of this token, no mode embedding (DFlash)
    gate_weight: float = 0.1  # weight of the gate's cross-entropy in the loss
    holdout: float = 0.05  # share of sequences held out for validation
    shards: int = 0  # use the first N data shards only (0 = all)
    save_every: int = 100  # steps between resume-state saves inside an epoch
    bf16: int = -1  # bfloat16 autocast for the matmuls (fp32 weights, optimizer and loss): 1 on, 0 off, -1 where the
    # device does bfloat16 matmuls natively (a GPU that does, or a CPU whose oneDNN says so); elsewhere autocast
    # emulates them (an mfd step ~8x a float32 one on an AVX2 CPU).  Runs saved before this option autocast
    # everywhere: resume one with bf16=1
    width: int = 0  # the drafter's own hidden size (0 = the target's)
    seed: int = 0

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        if self.bf16 not in (-1, 0, 1) or self.width < 0:
            raise SpecdraftError(f"bf16 must be -1, 0 or 1 and width >= 0 (got {self.bf16}, {self.width})")

    def model_config(self, tcfg) -> BlockConfig:
        return BlockConfig.for_target(tcfg, layers=self.draft_layers, block_size=self.block_size,
                                      feature_layers=self.feature_layers, modes=self.modes,
                                      draft_vocab=self.draft_vocab, gate=self.gate, qk_norm=self.qk_norm,
                                      mask_token=self.mask_token, width=self.width)

    def use_bf16(self, device: torch.device) -> bool:
        """Whether this run autocasts to bfloat16 on ``device`` (``bf16``)."""
        if self.bf16 >= 0:
            return bool(self.bf16)
        if device.type == "cuda":
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return native_bf16(device)


# ---------------------------------------------------------------------------- forward and loss


def block_states(model: BlockModel, batch: AnchorBatch) -> Tensor:
    """Final-normed drafter states of every anchor's blocks in one pass: [Bs, A, K, B, W], row 0
    the root (the mode gate reads it), row j scoring x_{a+j}.  ``batch.anchors`` holds a-1 (the position of the last context feature, as in
    ``specdraft.train.hybrid``), so the root x_a is ``token_at(batch, 1)``."""
    cfg = model.cfg
    kk, bb = cfg.modes, cfg.block_size
    root_pos = batch.anchors + 1  # [Bs, A]
    bs, a = root_pos.shape
    dev = root_pos.device
    t = max(1, int(root_pos.max()))  # context keys at or after the last root are never visible
    c = model.context(batch.feats[:, :t])  # [Bs, t, W]
    ctx = model.context_kv(c, torch.arange(t, device=dev)[None].expand(bs, -1))
    root, _ = token_at(batch, 1)
    x = model.block_inputs(root)  # [Bs, A, K, B, W]
    pos = (root_pos[:, :, None, None] + torch.arange(bb, device=dev)).expand(bs, a, kk, bb)
    q = a * kk * bb
    sees = torch.arange(t, device=dev) < root_pos[:, :, None, None, None]  # [Bs, A, 1, 1, t]
    sees = sees.expand(bs, a, kk, bb, t).reshape(bs, q, t)
    blk = torch.arange(q, device=dev) // bb
    own = (blk[:, None] == blk[None]).expand(bs, q, q)  # block-diagonal: each block sees itself only
    mask = torch.cat([sees, own], -1)[:, None]  # [Bs, 1, Q, t + Q]
    h = model.run_blocks(x.reshape(bs, q, -1), pos.reshape(bs, q), mask, ctx)
    return h.view(bs, a, kk, bb, -1)


@dataclass
class BlockOut:
    logits: Tensor  # [N, K, D, V'] of the N blocks with at least one label
    ce: Tensor  # [N, K, D] cross-entropy, 0 where unlabelled
    labels: Tensor  # [N, D] draft-vocabulary ids (-100 = none)
    ok: Tensor  # [N, D] labelled depths
    gate: Tensor  # [N, K] log pi_k of the mode gate (uniform without one)


def forward_blocks(model: BlockModel, batch: AnchorBatch, t2d: Tensor) -> BlockOut:
    """Logits and per-depth cross-entropy of every labelled block of ``batch``."""
    hb = block_states(model, batch)
    h, h_root = hb[..., 1:, :], hb[..., 0, :]  # [Bs, A, K, D, W], [Bs, A, K, W]
    d = model.cfg.depth
    labs, oks = zip(*(token_at(batch, 1 + j) for j in range(1, d + 1)))
    lab = t2d[torch.stack(labs, -1)]  # [Bs, A, D]
    ok = torch.stack(oks, -1) & (lab >= 0)
    keep = batch.anchor_ok & ok.any(-1)
    h, lab, ok, h_root = h[keep], lab[keep], ok[keep], h_root[keep]  # [N, K, D, W], [N, D], [N, D], [N, K, W]
    logits = model.logits(h).float()
    n, k = logits.shape[:2]
    tgt = lab.clamp(min=0)[:, None].expand(n, k, d)
    ce = F.cross_entropy(logits.flatten(0, 2), tgt.flatten(), reduction="none").view(n, k, d) * ok[:, None]
    return BlockOut(logits, ce, lab, ok, model.mode_logp(h_root))


def depth_weights(depth: int, gamma: float, device=None) -> Tensor:
    """w_j = exp(-(j-1)/gamma), j = 1 .. D."""
    return torch.exp(-torch.arange(depth, dtype=torch.float32, device=device) / gamma)


def wta_loss(out: BlockOut, w: Tensor, shares: Tensor, cfg: BlockTrainConfig) -> tuple[Tensor, Tensor]:
    """The winner-take-all loss (module docstring) and each block's winning mode [N]."""
    s = (out.ce * w).sum(-1)  # [N, K]
    ws = (out.ok * w).sum(-1)  # [N]
    k = s.shape[1]
    per_mode = s.detach() / ws[:, None]  # [N, K] each mode's weighted mean cross-entropy
    win = (per_mode + cfg.balance * torch.log(k * shares.clamp(min=1e-3))).argmin(1)
    per_block = (1 - cfg.wta_mean) * s.gather(1, win[:, None])[:, 0] + cfg.wta_mean * s.mean(1)
    loss = per_block.sum() / ws.sum()
    if k > 1 and cfg.gate:  # the gate learns which mode wins (the block's own best, without the balance term)
        loss = loss + cfg.gate_weight * F.nll_loss(out.gate, per_mode.argmin(1))
    return loss, win


@dataclass
class EvalStats:
    """Held-out statistics: per depth, top-1 of the best mode (the block's lowest loss, an oracle)
    and of the product marginal (the modes' mixture sum_k pi_k q_k, pi the gate or uniform), the
    mean accepted length of their argmax chains and of the gate's chosen mode, and how often the
    gate picks the best mode."""

    depth: int
    modes: int
    n: list[int] = field(default_factory=list)  # labelled blocks per depth
    best: list[int] = field(default_factory=list)  # best-mode top-1 hits per depth
    marginal: list[int] = field(default_factory=list)  # product-marginal top-1 hits per depth
    ce: list[float] = field(default_factory=list)  # best-mode cross-entropy summed per depth
    chain_best: float = 0.0  # summed accepted length of the best mode's argmax chain
    chain_marginal: float = 0.0
    chain_gated: float = 0.0  # summed accepted length of the argmax chain of the gate's top mode
    gate_hits: int = 0  # blocks whose gate top mode is the best mode
    blocks: int = 0
    wins: list[int] = field(default_factory=list)  # blocks per best mode

    def __post_init__(self) -> None:
        for name in ("n", "best", "marginal", "ce"):
            setattr(self, name, [0] * self.depth)
        self.wins = [0] * self.modes

    def add(self, out: BlockOut, w: Tensor) -> None:
        best = ((out.ce * w).sum(-1)).argmin(1)  # [N]
        rows = torch.arange(len(best), device=best.device)
        lp = torch.log_softmax(out.logits, -1)  # [N, K, D, V']
        hit_best = (lp[rows, best].argmax(-1) == out.labels) & out.ok  # [N, D]
        hit_marg = (torch.logsumexp(lp + out.gate[:, :, None, None], 1).argmax(-1) == out.labels) & out.ok
        top = out.gate.argmax(1)  # [N]
        hit_gate = (lp[rows, top].argmax(-1) == out.labels) & out.ok
        for j in range(self.depth):
            self.n[j] += int(out.ok[:, j].sum())
            self.best[j] += int(hit_best[:, j].sum())
            self.marginal[j] += int(hit_marg[:, j].sum())
            self.ce[j] += float(out.ce[rows, best, j].sum())
        self.chain_best += float(hit_best.int().cumprod(1).sum())
        self.chain_marginal += float(hit_marg.int().cumprod(1).sum())
        self.chain_gated += float(hit_gate.int().cumprod(1).sum())
        self.gate_hits += int((top == best).sum())
        self.blocks += len(best)
        for k, c in enumerate(torch.bincount(best, minlength=self.modes).tolist()):
            self.wins[k] += c

    def summary(self) -> dict:
        div = lambda xs: [x / n if n else 0.0 for x, n in zip(xs, self.n)]  # noqa: E731
        b = max(1, self.blocks)
        return {"top1_best": div(self.best), "top1_marginal": div(self.marginal), "ce_best": div(self.ce),
                "chain_best": self.chain_best / b, "chain_marginal": self.chain_marginal / b,
                "chain_gated": self.chain_gated / b, "gate_accuracy": self.gate_hits / b,
                "best_share": [x / b for x in self.wins]}


# ---------------------------------------------------------------------------- training


def schedule(corpus: Corpus, train_ids: list[int], cfg: BlockTrainConfig) -> list[tuple[int, int, list[int]]]:
    """(epoch, batch index, sequence ids) of every optimizer step: whole epochs, or epochs cut at
    ``steps``."""
    out: list[tuple[int, int, list[int]]] = []
    epoch = 0
    while True:
        plan = plan_epoch(corpus, train_ids, cfg.batch_tokens, torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        out += [(epoch, i, ids) for i, ids in enumerate(plan)]
        epoch += 1
        if (len(out) >= cfg.steps) if cfg.steps else (epoch >= cfg.epochs):
            return out[: cfg.steps] if cfg.steps else out


def batch_generator(cfg: BlockTrainConfig, epoch: int, index: int) -> torch.Generator:
    """The anchors of a batch depend on (seed, epoch, batch) only, so a resumed run draws the same."""
    return torch.Generator().manual_seed((cfg.seed * 1_000_003 + epoch) * 1_000_003 + index)


def train_block(target, data_dir, feat_dir, out: str | Path, cfg: BlockTrainConfig,
                quiet: bool = False, log=print) -> dict:
    """Train a block drafter (K = ``cfg.modes``) for ``target`` and write ``out`` (safetensors +
    manifest).  ``data_dir`` / ``feat_dir``: a data folder and its feature folder, or equal-length lists
    of them (trained on together; each folder keeps its own held-out split).  Re-running the
    same command after an interruption resumes from the last save."""
    out = Path(out)
    dev = target.device
    tcfg = target.config
    mcfg = cfg.model_config(tcfg)
    tcfg.check_layers(cfg.feature_layers)
    corpus, data_dirs, data_manifests, groups = load_training_data(target, data_dir, feat_dir, cfg.feature_layers,
                                                                   need_final=False, shards=cfg.shards)
    n_seq = len(corpus.tokens)
    if n_seq < 2:
        raise SpecdraftError(f"{', '.join(map(str, data_dirs))} hold(s) {n_seq} sequence(s); training needs at least "
                             "2 (one held out)")
    train_ids, val_ids, vocab_ids, t2d, covered = split_and_vocabulary(corpus, cfg.seed, cfg.holdout, cfg.draft_vocab,
                                                                       target, groups=groups)

    torch.manual_seed(cfg.seed)
    tm = target.model
    model = BlockModel(mcfg, tm.embed.weight.float(), tm.lm_head.weight.float(), vocab_ids.to(dev)).to(dev).train()
    n_target = sum(p.numel() for p in tm.parameters())
    name = "mfd" if cfg.modes > 1 else "block"
    width = f", width {model.layer_cfg.hidden_size}" if model.layer_cfg.hidden_size != tcfg.hidden_size else ""
    bf16 = cfg.use_bf16(dev)
    log(f"{name} drafter (K={cfg.modes}, B={cfg.block_size}, {cfg.draft_layers} layer(s){width}): {model.n_params():,} "
        f"trainable parameters ({model.n_params() / n_target:.1%} of the target); draft vocabulary {len(vocab_ids)} "
        f"tokens covering {covered:.2%} of training response tokens; {len(train_ids)} training / {len(val_ids)} "
        f"held-out sequences; {'bfloat16 autocast' if bf16 else 'float32'}")
    opt = adamw(model, cfg.lr, cfg.weight_decay)
    steps = schedule(corpus, train_ids, cfg)
    total = len(steps)
    warm = max(1, int(cfg.warmup * total))
    w = depth_weights(mcfg.depth, cfg.gamma, dev)

    spath = state_path(out)
    fp_cfg = asdict(cfg)
    fp_cfg["bf16"] = bf16  # what the run does, whatever the option said
    if not fp_cfg["width"]:  # absent at its default, so runs started before the option still resume
        del fp_cfg["width"]
    fp_data = data_sha256(data_manifests[0]) if len(data_manifests) == 1 else [data_sha256(m) for m in data_manifests]
    fingerprint = json.loads(json.dumps({"config": fp_cfg, "data": fp_data, "target": target.weight_hash}))
    fresh = {"step": 0, "history": [], "shares": [1.0 / cfg.modes] * cfg.modes, "wins": [0] * cfg.modes,
             "loss_sum": 0.0, "loss_n": 0}
    meta = dict(fresh)
    got = resume(spath, fingerprint, model, opt, log)
    if got is not None:
        meta = {k: got[k] for k in fresh}
        log(f"resuming from {spath} at step {meta['step']} of {total}")
    shares = torch.tensor(meta["shares"], dtype=torch.float32, device=dev)

    def autocast():
        return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16)

    @torch.no_grad()
    def evaluate() -> dict:
        model.eval()
        st = EvalStats(mcfg.depth, cfg.modes)
        gen = torch.Generator().manual_seed(12345)
        for ids in plan_epoch(corpus, val_ids, cfg.batch_tokens, gen):
            with autocast():
                fb = forward_blocks(model, make_batch(corpus, ids, cfg.anchors, gen, dev), t2d)
            st.add(fb, w)
        model.train()
        return st.summary()

    def save() -> None:
        save_state(spath, model, opt, {"fingerprint": fingerprint, **meta, "shares": shares.tolist()})

    t_train = time.perf_counter()
    bar = tqdm(total=total, initial=meta["step"], desc=name, disable=quiet)
    t0, s0 = time.perf_counter(), meta["step"]
    while meta["step"] < total:
        step = meta["step"]
        epoch, index, ids = steps[step]
        batch = make_batch(corpus, ids, cfg.anchors, batch_generator(cfg, epoch, index), dev)
        set_lr(opt, cfg.lr, step, total, warm)
        with autocast():
            fb = forward_blocks(model, batch, t2d)
        loss, win = wta_loss(fb, w, shares, cfg)
        lv = optimizer_step(model, opt, loss, f"at step {step + 1}")
        counts = torch.bincount(win, minlength=cfg.modes).float()
        shares = 0.99 * shares + 0.01 * counts / counts.sum().clamp(min=1)
        meta["wins"] = [a + int(b) for a, b in zip(meta["wins"], counts.tolist())]
        meta["loss_sum"] += lv
        meta["loss_n"] += 1
        meta["step"] = step + 1
        bar.update(1)
        if step - s0 == 4 and total - s0 > 20:
            per = (time.perf_counter() - t0) / 5
            log(f"{total} steps: expected {per * (total - s0) / 60:.1f} min at {per:.2f} s per step")
        if step % 10 == 0:
            bar.set_postfix(loss=f"{lv:.3f}")
        epoch_done = meta["step"] == total or steps[meta["step"]][0] != epoch
        if epoch_done:
            ev = evaluate()
            n_w = max(1, sum(meta["wins"]))
            meta["history"].append({"epoch": epoch + 1, "step": meta["step"],
                                    "train_loss": meta["loss_sum"] / max(1, meta["loss_n"]),
                                    "win_share": [x / n_w for x in meta["wins"]], "val": ev,
                                    "wall_s": time.perf_counter() - t_train})
            log(f"epoch {epoch + 1} (step {meta['step']}/{total}): train loss {meta['history'][-1]['train_loss']:.3f}; "
                f"mode win shares " + " ".join(f"{x:.2f}" for x in meta["history"][-1]["win_share"])
                + "; held-out top-1 per depth, best mode " + " ".join(f"{x:.1%}" for x in ev["top1_best"])
                + ", product marginal " + " ".join(f"{x:.1%}" for x in ev["top1_marginal"])
                + f"; chain length best {ev['chain_best']:.2f} / marginal {ev['chain_marginal']:.2f}"
                + (f" / gated {ev['chain_gated']:.2f} (gate picks the best mode {ev['gate_accuracy']:.1%})"
                   if cfg.modes > 1 else ""))
            meta.update(wins=[0] * cfg.modes, loss_sum=0.0, loss_n=0)
            save()
        elif meta["step"] % cfg.save_every == 0:
            save()
    bar.close()

    manifest = {
        "kind": "block",
        **target_identity(target),
        "config": asdict(mcfg),
        "drafter": name,
        "train": {**asdict(cfg), "bf16": int(bf16)},  # what the run did, whatever the option said
        "draft_vocab_coverage": covered,
        **({"draft_rows": cfg.draft_rows} if cfg.draft_rows else {}),
        "data": data_record(data_dirs[0], data_manifests[0], groups[0]),
        "history": meta["history"],
        "steps": total,
        "params": model.n_params(),
        "target_params": n_target,
        "train_wall_s": time.perf_counter() - t_train,
    }
    if len(data_dirs) > 1:  # "data" stays the first folder, whose held-out split a budget profile replays
        manifest["data_more"] = [data_record(d, m, n) for d, m, n in zip(data_dirs[1:], data_manifests[1:], groups[1:])]
    save_fp16(out, model.state_dict(), manifest)
    log(f"wrote {out}")
    return manifest
