"""Hybrid drafter (Gumiho, ICML 2025): serial Transformer steps for the first draft tokens,
parallel MLP heads for the later ones.  Medusa (S = 0) and EAGLE-style (M = 0) are
configurations of the same module.

Notation: committed tokens x_0 .. x_n, where the root x_n is committed but not yet run through
the target; f_i is the target's feature at position i (it predicted x_{i+1}).

Serial part (S steps, EAGLE-style).  A few target-shaped decoder layers over
u_i = fc([e(x_{i+1}) ; g(f_i)]), g = identity for one feature layer or a linear fusion of several
(EAGLE-3).  The drafter keeps its own K/V cache of the committed positions, computed from the
target's true features of accepted nodes only.  Step 1 is position n-1 (input f_{n-1}, x_n): its
output h^1 scores depth 1 through the frozen target LM head.  Step s >= 2 runs at position
n+s-2 on the kept beams, input [e(x^_{s-1}) ; h^{s-1}] (the drafter's own state replaces the
target's feature), attending to the cache plus its own path's earlier steps.

Parallel part (M heads, Medusa/Gumiho-style).  Head j reads [h^1 .. h^S ; e(x^_S)] of a depth-S
path (for S = 0: [g(f_{n-1}) ; e(x_n)]) and scores depth S+1+j in one step: SiLU(Linear) then
zero-initialised residual blocks SiLU(Linear), then the frozen LM head.  (Gumiho's heads read
the serial states only; the path's last token is added here so siblings get their own heads.)

Every LM-head product runs over a draft vocabulary: the rows of the target's frozen LM head for
the tokens most frequent in the training responses (EAGLE-3's reduced draft vocabulary), so a
step costs a fraction of a full-vocabulary head on a CPU.  Only their ids are stored.

Tree: beam expansion per depth (top-k children per expanded node, at most ``beams`` nodes kept
per depth), then the global top-(budget) nodes by cumulative log-probability, prefix-closed,
plus the root (``build_beam_tree``).  Training: ``specdraft.train.hybrid``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput, RMSNorm
from specdraft.model.packed import native_bf16, prepack_model
from specdraft.tree import Tree
from specdraft.verify import Accepted

NAMES = ("gumiho", "medusa", "eagle")  # registered names, each with its own default weights file
WEIGHTS = "{name}_smollm2_135m.safetensors"
TRAIN_ARGS = {"gumiho": "--serial 2 --parallel 5 --serial-layers 2 --head-blocks 5 --head-grad 0 --distill 1.0 --feature-loss 1.0 --layers 3,15,27,-1",
              "medusa": "--serial 0 --parallel 7 --distill 1.0 --layers 3,15,27,-1",
              "eagle": "--serial 7 --parallel 0 --distill 1.0 --layers 3,15,27,-1"}


def default_weights_path(name: str) -> Path:
    return Path(__file__).resolve().parents[1] / "weights" / WEIGHTS.format(name=name)


# ---------------------------------------------------------------------------- module


@dataclass
class HybridConfig:
    hidden_size: int  # target width H
    vocab_size: int  # target vocabulary
    num_heads: int  # query heads of a serial layer (target-shaped)
    num_kv_heads: int  # key/value heads of a serial layer
    head_dim: int
    intermediate_size: int  # SwiGLU width of a serial layer
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    serial: int = 2  # S: draft positions produced by the serial (EAGLE-style) part
    parallel: int = 5  # M: MLP heads, head j drafts position S+1+j
    serial_layers: int = 1  # decoder layers of the serial part
    head_blocks: int = 1  # zero-initialised residual blocks per MLP head (Gumiho: 5)
    feature_layers: tuple[int, ...] = (-1,)  # target features read (-1 = final normed state)
    draft_vocab: int = 8192  # LM-head rows drafted from (the most frequent tokens; 0 = all)

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        if self.serial < 0 or self.parallel < 0 or self.serial + self.parallel < 1:
            raise SpecdraftError(f"a hybrid drafter needs serial >= 0, parallel >= 0 and serial + parallel >= 1 "
                                 f"(got {self.serial}, {self.parallel})")
        if self.serial_layers < 1 or self.head_blocks < 0 or not self.feature_layers:
            raise SpecdraftError("serial layers must be >= 1, head blocks >= 0, and at least one feature layer")

    @classmethod
    def for_target(cls, tcfg, **kw) -> "HybridConfig":
        """Serial layers shaped like the target's decoder blocks."""
        return cls(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, num_heads=tcfg.num_heads,
                   num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size,
                   rms_eps=tcfg.rms_eps, rope_theta=tcfg.rope_theta, **kw)

    @classmethod
    def from_json(cls, d: dict) -> "HybridConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def depth(self) -> int:
        return self.serial + self.parallel

    @property
    def kind(self) -> str:
        """The paper this configuration reproduces."""
        return "medusa" if self.serial == 0 else "eagle" if self.parallel == 0 else "gumiho"


class DraftLayer(nn.Module):
    """One decoder layer (pre-norm attention + SwiGLU), returning its new keys/values so the
    caller decides where they live: a cache at inference, plain tensors in training."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.wqkv = nn.Linear(h, (self.hq + 2 * self.hkv) * d, bias=False)
        self.wo = nn.Linear(self.hq * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.w_gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: Tensor, rot: Tensor, mask: Tensor | None, past_k: Tensor | None = None,
                past_v: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        # x: [B, T, H]; rot: complex [B, T, 1, D/2]; mask: bool [B, 1, T, P+T] (True = may attend) or
        # None (all visible); past_k/v: [B, Hkv, P, D].  Returns (y [B, T, H], k, v [B, Hkv, T, D]).
        b, t, _ = x.shape
        qkv = self.wqkv(self.attn_norm(x)).unflatten(-1, (self.hq + 2 * self.hkv, self.d))  # [B, T, heads, D]
        qk = qkv[:, :, : self.hq + self.hkv]
        # RoPE on (2i, 2i+1) pairs: one complex multiply by e^{i pos theta}
        qk = torch.view_as_real(torch.view_as_complex(qk.float().unflatten(-1, (self.d // 2, 2))) * rot)
        qk = qk.flatten(-2).to(x.dtype).transpose(1, 2)  # [B, Hq + Hkv, T, D]
        q, k = qk[:, : self.hq], qk[:, self.hq :]
        v = qkv[:, :, self.hq + self.hkv :].transpose(1, 2)  # [B, Hkv, T, D]
        keys = k if past_k is None else torch.cat([past_k, k], 2)
        values = v if past_v is None else torch.cat([past_v, v], 2)
        # grouped-query attention without expanding K/V: the G query heads sharing a KV head become
        # G*T query rows of that head ([B, Hq, T, D] -> [B, Hkv, G*T, D]), mask rows likewise
        g = self.hq // self.hkv
        if mask is not None and g > 1:
            mask = mask.repeat(1, 1, g, 1)
        att = F.scaled_dot_product_attention(q.reshape(b, self.hkv, g * t, self.d), keys, values, attn_mask=mask)
        x = x + self.wo(att.reshape(b, self.hq, t, self.d).transpose(1, 2).reshape(b, t, self.hq * self.d))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up), k, v


class MLPHead(nn.Module):
    """SiLU(Linear(d_in -> H)), then ``blocks`` residual blocks x + SiLU(Linear(x)), zero-initialised
    (identity at the start of training)."""

    def __init__(self, d_in: int, h: int, blocks: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, h)
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(blocks))
        for blk in self.blocks:
            nn.init.zeros_(blk.weight)
            nn.init.zeros_(blk.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.silu(self.inp(x))
        for blk in self.blocks:
            x = x + F.silu(blk(x))
        return x


class HybridModel(nn.Module):
    """The trainable drafter; the target's embeddings and LM head are frozen, non-persistent
    buffers (shared, never saved).  ``vocab_ids`` [V'] = target ids of the draft vocabulary."""

    def __init__(self, cfg: HybridConfig, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H]
        self.register_buffer("head_w", lm_head.detach()[self.vocab_ids].contiguous(), persistent=False)  # [V', H]
        n_feat = len(cfg.feature_layers)
        # several target layers (EAGLE-3 style): each is RMS-normalised before the fusing
        # projection, as the target's own next layer would read it; the raw residual stream of
        # middle layers carries massive activations (SmolLM2-135M layers 15, 27: |x| up to 2.5e4,
        # RMS ~65 vs 1.9 for the final state) that would otherwise swamp the projection
        self.feat_norms = nn.ModuleList(RMSNorm(h, cfg.rms_eps) for _ in range(n_feat)) if n_feat > 1 else None
        self.fuse = nn.Linear(n_feat * h, h, bias=False) if n_feat > 1 else None
        if cfg.serial > 0:
            self.fc = nn.Linear(2 * h, h)
            self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.serial_layers))
        self.heads = nn.ModuleList(MLPHead((max(cfg.serial, 1) + 1) * h, h, cfg.head_blocks)
                                   for _ in range(cfg.parallel))
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._head = None  # PackedWeight of head_w once prepack() ran

    def prepack(self) -> bool:
        """Inference on a bfloat16 CPU: let oneDNN reorder every weight once (``model.packed``)
        instead of on every call.  Returns whether it did."""
        self._head = prepack_model(self, self.head_w)
        return self._head is not None

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def feature(self, f: Tensor) -> Tensor:
        """[..., n_layers * H] target features -> [..., H]."""
        if self.fuse is None:
            return f
        parts = f.split(self.cfg.hidden_size, -1)
        return self.fuse(torch.cat([norm(x) for norm, x in zip(self.feat_norms, parts)], -1))

    def serial(self, state: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None,
               past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """One serial step over T rows: state [B, T, H] (g(f) or the previous step's output),
        tokens [B, T] (the token each row reads), positions [B, T].  Returns (out [B, T, H], the
        new (k, v) of every layer)."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, D/2]
        rot = torch.polar(torch.ones_like(freqs), freqs)[:, :, None]
        x = self.fc(torch.cat([self.embed[tokens], state], -1))
        new = []
        for i, layer in enumerate(self.layers):
            pk, pv = past[i] if past is not None else (None, None)
            x, k, v = layer(x, rot, mask, pk, pv)
            new.append((k, v))
        return x, new

    def logits(self, h: Tensor) -> Tensor:
        """[..., H] -> [..., V'] scores over the draft vocabulary (frozen LM-head rows)."""
        if self._head is not None:
            return self._head(h)
        return h @ self.head_w.T

    def head_states(self, x: Tensor, n: int | None = None) -> Tensor:
        """[R, (max(S,1)+1) H] -> [R, n, H] outputs of the first ``n`` MLP heads."""
        heads = self.heads if n is None else self.heads[:n]
        return torch.stack([hd(x) for hd in heads], 1)


# ---------------------------------------------------------------------------- tree


@dataclass
class Level:
    """Candidates at one depth: parent = index in the previous level (0 = the root for the first
    level), the token (target id) and its log-probability given the parent's path."""

    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


def build_beam_tree(root: int, levels: list[Level], budget: int) -> tuple[Tree, list[tuple[int, int]]]:
    """The ``budget`` candidates with the highest cumulative log-probability, prefix-closed, plus
    the root, as a Tree (best first within the topological order).

    Best-first search from the root: a node becomes eligible once its parent is taken, so the
    result is prefix-closed even with ties; because a child never scores above its parent
    (log-probabilities <= 0), it is exactly the global top-(budget).  Ties: shallower first,
    then candidate order.  Also returns (level, index) of every drafted node, in tree order.
    """
    children: list[dict[int, list[int]]] = []
    for lv in levels:
        ch: dict[int, list[int]] = {}
        for i, p in enumerate(lv.parents):
            ch.setdefault(p, []).append(i)
        children.append(ch)
    tokens, parents, picked = [root], [-1], []
    heap: list[tuple[float, int, int, int]] = []  # (-cumulative, depth-1, index, tree node of the parent)

    def push(depth: int, parent_idx: int, parent_node: int, parent_cum: float) -> None:
        if depth < len(levels):
            lv = levels[depth]
            for i in children[depth].get(parent_idx, []):
                heapq.heappush(heap, (-(parent_cum + lv.logps[i]), depth, i, parent_node))

    push(0, 0, 0, 0.0)
    while heap and len(tokens) - 1 < budget:
        neg, depth, i, parent_node = heapq.heappop(heap)
        tokens.append(int(levels[depth].tokens[i]))
        parents.append(parent_node)
        picked.append((depth, i))
        push(depth + 1, i, len(tokens) - 1, -neg)
    return Tree(tokens=tokens, parents=parents), picked


def expand_level(parent_cums: list[float], tokens: list[list[int]], logps: list[list[float]],
                 width: int) -> tuple[Level, list[float]]:
    """Children of the expanded nodes of one depth: ``tokens[p]``/``logps[p]`` are the top-k of
    node p; keeps the ``width`` best by cumulative log-probability (ties: candidate order).
    Returns the level (parents index into ``parent_cums``) and the kept nodes' cumulative scores."""
    cands = [(c + lp, p, t, lp) for p, c in enumerate(parent_cums) for t, lp in zip(tokens[p], logps[p])]
    cands = sorted(cands, key=lambda x: -x[0])[:width]  # stable: equal scores keep candidate order
    return Level([p for _, p, _, _ in cands], [t for _, _, t, _ in cands], [lp for *_, lp in cands]), \
        [c for c, *_ in cands]


def parallel_levels(beam_cums: list[float], tokens: list[list[list[int]]], logps: list[list[list[float]]],
                    width: int) -> list[Level]:
    """Beam expansion of the parallel heads.  Beam b (a depth-S node, score ``beam_cums[b]``) has
    per head j its top-k ``tokens[b][j]`` / ``logps[b][j]``; the heads' marginals multiply along a
    path.  The first level's parents index the beams; every level keeps ``width`` nodes."""
    out: list[Level] = []
    owner = list(range(len(beam_cums)))  # the beam each frontier node descends from
    cums = list(beam_cums)
    n_heads = len(tokens[0]) if tokens else 0
    for j in range(n_heads):
        lv, new_cums = expand_level(cums, [tokens[owner[p]][j] for p in range(len(cums))],
                                    [logps[owner[p]][j] for p in range(len(cums))], width)
        owner = [owner[p] for p in lv.parents]
        cums = new_cums
        out.append(lv)
    return out


# ---------------------------------------------------------------------------- drafter


@dataclass
class HybridDraftConfig:
    budget: int = 3  # drafted nodes per tree when no cost curve is stored
    topk: int = 8  # children scored per expanded node and depth (capped by the budget)
    beams: int = 4  # nodes kept per depth for further expansion (capped by the budget)
    bf16: int = -1  # 1 = run the drafter in bfloat16, weights packed once (-1: where the CPU has native bfloat16)


class HybridDrafter:
    """Drafter protocol around a trained ``HybridModel`` (see the module docstring)."""

    def __init__(self, model: HybridModel, config: HybridDraftConfig | None = None, name: str | None = None,
                 manifest: dict | None = None) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.opts = config or HybridDraftConfig()
        self.default_budget = self.opts.budget
        self.name = name or self.cfg.kind
        self.hidden_layers: tuple[int, ...] = tuple(self.cfg.feature_layers)
        self.manifest = manifest or {}
        self.root = -1
        self.state: Tensor | None = None  # [H]: h^1 (S > 0) or g(f_{n-1}) (S = 0)
        self.n = 0  # committed positions in the serial cache (= index of the root)
        self.cache: list[tuple[Tensor, Tensor]] = []  # per serial layer: k, v [1, Hkv, capacity, D]

    # ------------------------------------------------------------------ protocol
    def _features(self, out: ForwardOutput, rows) -> Tensor:
        """g(f) of the given rows of ``out``: [rows, H]."""
        f = torch.cat([out.hidden[layer][0, rows] for layer in self.cfg.feature_layers], -1)
        return self.model.feature(f.to(self.model.head_w.dtype))

    @torch.inference_mode()
    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.root = first_token
        p = len(prompt_ids)
        self.n = 0
        self.cache = []
        if self.cfg.serial == 0:
            self.state = self._features(prefill, p - 1)
            return
        g = self._features(prefill, slice(0, p))  # f_0 .. f_{p-1}
        self._advance(g, list(prompt_ids[1:]) + [first_token])

    @torch.inference_mode()
    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.root = accepted.bonus
        if self.cfg.serial == 0:
            self.state = self._features(out, accepted.path[-1])
            return
        # positions n .. n+d: the accepted nodes' true features with the token each predicted
        self._advance(self._features(out, accepted.path), accepted.new_tokens)

    def _advance(self, g: Tensor, next_tokens: list[int]) -> None:
        """Run the serial layers over new committed positions (true features) and cache their K/V."""
        t, n, dev = len(next_tokens), self.n, g.device
        self._reserve(n + t + self.cfg.depth + 1)
        mask = None
        if t > 1:
            mask = torch.ones(1, 1, t, n + t, dtype=torch.bool, device=dev)
            mask[0, 0, :, n:] = torch.tril(mask[0, 0, :, n:])
        past = [(k[:, :, :n], v[:, :, :n]) for k, v in self.cache]
        pos = torch.arange(n, n + t, device=dev)[None]
        toks = torch.tensor([next_tokens], device=dev)
        h, new = self.model.serial(g[None], toks, pos, mask, past)
        for (ck, cv), (k, v) in zip(self.cache, new):
            ck[:, :, n : n + t] = k
            cv[:, :, n : n + t] = v
        self.n = n + t
        self.state = h[0, -1]

    def _reserve(self, slots: int) -> None:
        if self.cache and self.cache[0][0].shape[2] >= slots:
            return
        cap = max(slots, 2 * (self.cache[0][0].shape[2] if self.cache else 256))
        ref = self.model.head_w
        shape = (1, self.cfg.num_kv_heads, cap, self.cfg.head_dim)
        grown = []
        for i in range(self.cfg.serial_layers):
            k, v = torch.zeros(shape, dtype=ref.dtype, device=ref.device), torch.zeros(shape, dtype=ref.dtype, device=ref.device)
            if self.cache:
                k[:, :, : self.n] = self.cache[i][0][:, :, : self.n]
                v[:, :, : self.n] = self.cache[i][1][:, :, : self.n]
            grown.append((k, v))
        self.cache = grown

    # ------------------------------------------------------------------ drafting
    def _topk(self, h: Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k draft tokens (target ids) and log-probabilities of the rows of ``h`` [..., H]."""
        lp = torch.log_softmax(self.model.logits(h).float(), -1)
        top = lp.topk(min(k, lp.shape[-1]), -1)
        return self.model.vocab_ids[top.indices].tolist(), top.values.tolist()

    @torch.inference_mode()
    def levels(self, budget: int) -> list[Level]:
        """Candidate levels for a tree of ``budget`` drafted nodes (no level deeper than the budget)."""
        m, cfg = self.model, self.cfg
        max_depth = min(cfg.depth, budget)
        k, width = min(self.opts.topk, budget), min(self.opts.beams, budget)
        dev = self.state.device
        if cfg.serial == 0:  # Medusa: the heads read [g(f_{n-1}) ; e(root)]
            x = torch.cat([self.state, m.embed[self.root]])[None]
            toks, lps = self._topk(m.head_states(x, max_depth), k)  # [1][heads][k]
            return parallel_levels([0.0], toks, lps, budget)
        levels: list[Level] = []
        # depth 1 from h^1 (computed at commit time)
        toks, lps = self._topk(self.state[None], k)
        lv, cums = expand_level([0.0], toks, lps, budget)
        levels.append(lv)
        states = [[self.state] for _ in lv.tokens]  # per node: h^1 .. h^depth along its path
        rows = [[] for _ in lv.tokens]  # per node: its ancestors' rows in the step blocks 2 .. depth
        blocks: list[list[tuple[Tensor, Tensor]]] = []  # per step >= 2: per layer (k, v) [1, Hkv, beams, D]
        past = [(ck[:, :, : self.n], cv[:, :, : self.n]) for ck, cv in self.cache]
        for s in range(2, min(cfg.serial, max_depth) + 1):
            beam = list(range(min(width, len(lv.tokens))))  # levels are sorted best first
            nb = len(beam)
            # mask: every committed slot, the beam's own ancestors in earlier step blocks, itself
            mask = torch.zeros(1, 1, nb, self.n + sum(b[0][0].shape[2] for b in blocks) + nb, dtype=torch.bool, device=dev)
            mask[..., : self.n] = True
            off = self.n
            for r, blk in enumerate(blocks):
                for i, b in enumerate(beam):
                    mask[0, 0, i, off + rows[b][r]] = True
                off += blk[0][0].shape[2]
            mask[0, 0, :, off:] = torch.eye(nb, dtype=torch.bool, device=dev)
            keys = [(torch.cat([pk] + [blk[i][0] for blk in blocks], 2), torch.cat([pv] + [blk[i][1] for blk in blocks], 2))
                    for i, (pk, pv) in enumerate(past)]
            st = torch.stack([states[b][-1] for b in beam])[None]  # [1, nb, H]
            tk = torch.tensor([[lv.tokens[b] for b in beam]], device=dev)
            pos = torch.full((1, nb), self.n + s - 2, device=dev)
            h, new = m.serial(st, tk, pos, mask, keys)
            blocks.append(new)
            toks, lps = self._topk(h[0], k)
            lv, cums = expand_level([cums[b] for b in beam], toks, lps, budget)
            states = [states[beam[p]] + [h[0, p]] for p in lv.parents]
            rows = [rows[beam[p]] + [p] for p in lv.parents]
            levels.append(lv)
        if max_depth > cfg.serial:  # parallel heads on the best depth-S paths
            beam = list(range(min(width, len(lv.tokens))))
            x = torch.cat([torch.stack([torch.cat(states[b]) for b in beam]), m.embed[[lv.tokens[b] for b in beam]]], -1)
            toks, lps = self._topk(m.head_states(x, max_depth - cfg.serial), k)  # [beams][heads][k]
            par = parallel_levels([cums[b] for b in beam], toks, lps, budget)
            levels += par  # the first parallel level's parents are beam rows = indices in the depth-S level
        return levels

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        return build_beam_tree(self.root, self.levels(budget), budget)[0]


# ---------------------------------------------------------------------------- loading


def load_model(target, path: str | Path) -> tuple[HybridModel, dict]:
    """A trained ``HybridModel`` for ``target`` from a checkpoint (clear errors for the wrong target,
    a corrupt file or one of another kind)."""
    from specdraft.checkpoint import check_fits, load_checkpoint

    tensors, manifest = load_checkpoint(path, target_hash=target.weight_hash, kind="hybrid")
    try:
        cfg = HybridConfig.from_json(manifest["config"])
        check_fits(cfg, target, path)
        tm = target.model
        model = HybridModel(cfg, tm.embed.weight, tm.lm_head.weight, tensors["vocab_ids"].to(tm.embed.weight.device))
        model.load_state_dict(tensors)
    except (KeyError, TypeError, RuntimeError, IndexError) as e:
        raise SpecdraftError(f"checkpoint {path} does not hold a valid hybrid drafter ({e})") from None
    return model.to(device=target.device, dtype=target.model.embed.weight.dtype), manifest


def load_hybrid(target, name: str, path: str | Path | None = None, budget: int | None = None,
                opts: dict[str, str] | None = None) -> HybridDrafter:
    """``make_drafter`` entry: ``gumiho``/``medusa``/``eagle`` (shipped weights) or a checkpoint path."""
    if target is None:
        raise SpecdraftError(f"the {name} drafter needs the target (its features, embeddings and LM head)")
    cfg = HybridDraftConfig()
    for key, value in (opts or {}).items():
        try:
            setattr(cfg, key, int(value))
        except ValueError:
            raise SpecdraftError(f"{name} option {key} must be an integer (got {value!r})") from None
        if getattr(cfg, key) < (0 if key == "bf16" else 1) or (key == "bf16" and cfg.bf16 > 1):
            raise SpecdraftError(f"{name} option {key} must be " + ("0 or 1" if key == "bf16" else ">= 1") + f" (got {value})")
    if path is None:
        if name not in NAMES:
            raise SpecdraftError(f"drafter {name!r} needs a checkpoint path")
        path = default_weights_path(name)
        if not path.is_file():
            raise SpecdraftError(
                f"the {name} drafter's weights ({path}) are not in this install yet; train them with "
                f"`specdraft train hybrid {TRAIN_ARGS[name]} --data data/smollm2 --features DIR --out {path}` "
                f"(see README, Hybrid drafters) or pass a checkpoint path as --drafter")
    model, manifest = load_model(target, path)
    if budget is not None:
        cfg.budget = budget
    else:
        from specdraft.bench.cost import budget_from_curve, load_cost_curve, profile_budget

        # with a budget profile in the manifest (`specdraft train profile`): the budget with the best
        # predicted speed on this machine's cost curve; else the largest tree costing <= 1.5x a token
        if manifest.get("acceptance_by_budget"):
            cfg.budget = profile_budget(target, manifest, cfg.budget)
        elif (curve := load_cost_curve(target)) is not None:
            cfg.budget = budget_from_curve(curve, default=cfg.budget)
    if cfg.bf16 < 0:
        cfg.bf16 = int(native_bf16(target.device))
    if cfg.bf16:
        inv_freq = model.inv_freq
        model = model.to(torch.bfloat16)
        model.inv_freq = inv_freq  # RoPE angles stay fp32 (bf16 would shift every position's angle)
        model.prepack()  # oneDNN reorders each weight once, not per call
    return HybridDrafter(model, cfg, name=name if name in NAMES else None, manifest=manifest)
