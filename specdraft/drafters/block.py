"""Block drafter (DFlash, "Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036) and
Multi-Future Drafting (MFD, "Mixture Block Drafters for Tree-Verified Speculative Decoding",
arXiv 2611.13017).

Notation: committed tokens x_0 .. x_n, where the root x_n is committed but not yet run through
the target; f_i = the target's hidden states at position i (layers ``feature_layers``,
concatenated), so f_0 .. f_{n-1} are known.

Context.  c_i = RMSNorm(W_fuse f_i) [H].  In every drafter layer l the context enters as keys and
values only ("KV injection"): K_i = RoPE(W_k^l c_i, i), V_i = W_v^l c_i, with the layer's own K/V
projection.  They depend on committed positions only, so the drafter caches them and extends the
cache on commit with the features of the newly accepted tokens.

Block.  Input rows at positions n .. n+B-1: [e(x_n), m, .., m] + u_k, with e the target's frozen
embedding, m a learned MASK embedding and u_k the learned embedding of mode k (K modes; K = 1 is
the single-mode DFlash drafter, whose one u acts as a bias).  Each target-shaped decoder layer
takes queries from the block rows only; keys/values are [context ; block], bidirectional inside
the block, the context strictly before the anchor n.  Row j (1 <= j <= B-1) scores x_{n+j} through
a final RMSNorm and the frozen target LM head restricted to a draft vocabulary (the training
responses' most frequent tokens; only their ids are stored).  All K blocks share the context and
run in one pass (K*B query rows, a block-diagonal mask between the modes).

Trees (``tree`` option), all verified by the same engine:
- ``linear`` (DFlash): the argmax chain, min(B-1, budget) nodes; for K > 1 the chain of the mode
  whose chain has the highest joint log-probability;
- ``ddtree`` (DDTree): the top-budget prefixes under the product of per-position marginals; for
  K > 1 the marginal is the modes' average probability;
- ``mixture`` (MFD): the top-budget prefixes under the best mode's log-probability,
  max_k sum_j log q_k(y_j), prefix-closed and merged (``specdraft.search.mixture_tree``).

Training: ``specdraft.train.block`` (many anchors per sequence in one pass; winner-take-all
over modes for K > 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.drafters.hybrid import DraftLayer
from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput, RMSNorm
from specdraft.model.packed import PackedWeight, native_bf16, prepack_model
from specdraft.search import ddtree, mixture_tree
from specdraft.tree import Tree
from specdraft.verify import Accepted

NAMES = {"block": 1, "mfd": 4}  # registered names -> modes of their shipped weights
WEIGHTS = "{name}_smollm2_135m.safetensors"
TREES = ("linear", "ddtree", "mixture")


def default_weights_path(name: str) -> Path:
    return Path(__file__).resolve().parents[1] / "weights" / WEIGHTS.format(name=name)


# ---------------------------------------------------------------------------- module


@dataclass
class BlockConfig:
    hidden_size: int  # target width H (copied from the target config)
    vocab_size: int  # target vocabulary
    num_heads: int  # query heads of a drafter layer (target-shaped)
    num_kv_heads: int  # key/value heads of a drafter layer
    head_dim: int
    intermediate_size: int  # SwiGLU width of a drafter layer
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    layers: int = 1  # drafter decoder layers
    block_size: int = 8  # B: the root plus B-1 drafted positions
    feature_layers: tuple[int, ...] = (3, 15, 27)  # target layers fused into the context (-1 = final)
    modes: int = 1  # K: mode embeddings, blocks drafted per pass (1 = single-mode DFlash)
    draft_vocab: int = 8192  # LM-head rows drafted from (the most frequent tokens; 0 = all)
    gate: bool = False  # K > 1: a mode gate pi_k(context) scored from each mode's root row

    def __post_init__(self) -> None:
        self.feature_layers = tuple(int(x) for x in self.feature_layers)
        self.gate = bool(self.gate) and self.modes > 1
        if self.layers < 1 or self.block_size < 2 or self.modes < 1 or not self.feature_layers:
            raise SpecdraftError(f"a block drafter needs >= 1 layer, block size >= 2, >= 1 mode and a feature "
                                 f"layer (got {self.layers}, {self.block_size}, {self.modes}, {self.feature_layers})")

    @classmethod
    def for_target(cls, tcfg, **kw) -> "BlockConfig":
        """Drafter layers shaped like the target's decoder blocks."""
        return cls(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size, num_heads=tcfg.num_heads,
                   num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim, intermediate_size=tcfg.intermediate_size,
                   rms_eps=tcfg.rms_eps, rope_theta=tcfg.rope_theta, **kw)

    @classmethod
    def from_json(cls, d: dict) -> "BlockConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def depth(self) -> int:
        """D: drafted positions per block."""
        return self.block_size - 1


def rope(x: Tensor, rot: Tensor) -> Tensor:
    """x [B, T, heads, D] with (2i, 2i+1) pairs rotated by rot (complex [B, T, 1, D/2])."""
    y = torch.view_as_complex(x.float().unflatten(-1, (x.shape[-1] // 2, 2))) * rot
    return torch.view_as_real(y).flatten(-2).to(x.dtype)


class BlockModel(nn.Module):
    """The trainable block drafter; the target's embeddings and LM head are frozen, non-persistent
    buffers (shared, never saved).  ``vocab_ids`` [V'] = target ids of the draft vocabulary."""

    def __init__(self, cfg: BlockConfig, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("embed", embed.detach(), persistent=False)  # [V, H]
        self.register_buffer("head_w", lm_head.detach()[self.vocab_ids].contiguous(), persistent=False)  # [V', H]
        self.fuse = nn.Linear(len(cfg.feature_layers) * h, h, bias=False)
        self.ctx_norm = RMSNorm(h, cfg.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(h, cfg.rms_eps)
        std = float(embed.float().std())  # new embeddings on the scale of the target's
        self.mask_emb = nn.Parameter(torch.randn(h) * std)
        self.mode_emb = nn.Parameter(torch.randn(cfg.modes, h) * std)  # [K, H]
        if cfg.gate:
            self.gate = nn.Linear(h, 1, bias=False)  # score of mode k = w . (final state of mode k's root row)
        self._head = None  # PackedWeight of head_w once prepack() ran
        self._kv: list | None = None  # per layer PackedWeight of the K/V rows of wqkv

    def prepack(self) -> bool:
        """Inference on a bfloat16 CPU: let oneDNN reorder every weight once (``model.packed``)
        instead of on every call.  Returns whether it did."""
        self._head = prepack_model(self, self.head_w)
        if self._head is None:
            return False
        q_rows = self.cfg.num_heads * self.cfg.head_dim
        self._kv = [PackedWeight(layer.wqkv.weight[q_rows:]) for layer in self.layers]
        return True

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def rotation(self, positions: Tensor) -> Tensor:
        """positions [B, T] -> e^{i pos theta}, complex [B, T, 1, D/2]; theta in fp32 whatever the
        weights' dtype (a bfloat16 theta would shift every angle)."""
        d = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device).float() / d))
        freqs = positions[..., None].float() * inv
        return torch.polar(torch.ones_like(freqs), freqs)[:, :, None]

    def context(self, feats: Tensor) -> Tensor:
        """[B, T, n_layers * H] target features -> c [B, T, H]."""
        return self.ctx_norm(self.fuse(feats))

    def context_kv(self, c: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per drafter layer the context's keys (RoPE at ``positions`` [B, T]) and values, each
        [B, Hkv, T, D], through the layer's own K/V projection (KV injection)."""
        cfg = self.cfg
        rot = self.rotation(positions)
        q_rows = cfg.num_heads * cfg.head_dim
        out = []
        for i, layer in enumerate(self.layers):
            kv = c @ layer.wqkv.weight[q_rows:].T if self._kv is None else self._kv[i](c)
            kv = kv.unflatten(-1, (2 * cfg.num_kv_heads, cfg.head_dim))  # [B, T, 2 Hkv, D]
            k, v = kv[:, :, : cfg.num_kv_heads], kv[:, :, cfg.num_kv_heads :]
            out.append((rope(k, rot).transpose(1, 2), v.transpose(1, 2)))
        return out

    def block_inputs(self, first: Tensor) -> Tensor:
        """first [...] root tokens -> block inputs [..., K, B, H]: [e(root), m x (B-1)] + u_k."""
        cfg = self.cfg
        e = self.embed[first]  # [..., H]
        rows = torch.cat([e[..., None, :], self.mask_emb.expand(*e.shape[:-1], cfg.block_size - 1, -1)], -2)  # [..., B, H]
        return rows[..., None, :, :] + self.mode_emb[:, None, :]  # [..., K, B, H]

    def run_blocks(self, x: Tensor, positions: Tensor, mask: Tensor | None, ctx: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Block rows x [B, Q, H] at ``positions`` [B, Q] through the layers, attending to the
        context K/V ``ctx`` (per layer [B, Hkv, P, D]) and to block rows as ``mask`` allows
        (bool [B, 1, Q, P+Q], True = may attend; None = everything).  Returns RMSNorm(out) [B, Q, H]."""
        rot = self.rotation(positions)
        for layer, (k, v) in zip(self.layers, ctx):
            x, _, _ = layer(x, rot, mask, k, v)
        return self.norm(x)

    def mode_logp(self, h_root: Tensor) -> Tensor:
        """Final states of the K root rows [..., K, H] -> log pi_k [..., K]: the gate's
        log-probability that mode k's block is the one the target continues (uniform without a gate)."""
        if not self.cfg.gate:
            return torch.full(h_root.shape[:-1], -math.log(self.cfg.modes), device=h_root.device)
        return torch.log_softmax(self.gate(h_root).squeeze(-1).float(), -1)

    def logits(self, h: Tensor) -> Tensor:
        """[..., H] -> [..., V'] scores over the draft vocabulary (frozen LM-head rows)."""
        h2 = h.reshape(-1, h.shape[-1])  # one matmul, not a batched one
        return (F.linear(h2, self.head_w) if self._head is None else self._head(h2)).view(*h.shape[:-1], -1)


def modes_mask(modes: int, block: int, context: int, device=None) -> Tensor | None:
    """[1, 1, K*B, P+K*B]: every context slot, then the query's own block (block-diagonal);
    None when K = 1 (everything visible)."""
    if modes == 1:
        return None
    blk = torch.arange(modes * block, device=device) // block
    own = blk[:, None] == blk[None]
    return torch.cat([torch.ones(modes * block, context, dtype=torch.bool, device=device), own], 1)[None, None]


# ---------------------------------------------------------------------------- drafter


@dataclass
class BlockDraftConfig:
    tree: str = "ddtree"  # linear (DFlash) | ddtree (product) | mixture (MFD best-mode)
    topk: int = 16  # candidates per depth (per mode) handed to the tree search, capped by the budget
    budget: int = 12  # drafted nodes per tree when no measured profile says otherwise (4 on a CPU, see load_block)


class BlockDrafter:
    """Drafter protocol around a trained ``BlockModel`` (see the module docstring)."""

    def __init__(self, model: BlockModel, config: BlockDraftConfig | None = None, name: str | None = None,
                 manifest: dict | None = None) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.opts = config or BlockDraftConfig(tree="mixture" if self.cfg.modes > 1 else "ddtree")
        if self.opts.tree not in TREES:
            raise SpecdraftError(f"unknown tree {self.opts.tree!r} (choose from {', '.join(TREES)})")
        self.default_budget = self.opts.budget
        self.name = name or ("mfd" if self.cfg.modes > 1 else "block")
        self.hidden_layers: tuple[int, ...] = tuple(self.cfg.feature_layers)
        self.manifest = manifest or {}
        self.root = -1
        self.n = 0  # committed positions with context K/V in the cache (= position of the root)
        self.cache: list[tuple[Tensor, Tensor]] = []  # per layer: k, v [1, Hkv, capacity, D]
        self._logp: Tensor | None = None  # [K, D, V'] of the current state, computed on demand
        self._prior: Tensor | None = None  # [K] log pi_k of the current state, with _logp

    # ------------------------------------------------------------------ protocol
    def _features(self, out: ForwardOutput, rows) -> Tensor:
        """Target features of the given rows of ``out``: [1, rows, n_layers * H]."""
        f = torch.cat([out.hidden[layer][0, rows] for layer in self.cfg.feature_layers], -1)
        return f.to(self.model.head_w.dtype)[None]

    @torch.inference_mode()
    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.root = first_token
        self.n = 0
        self.cache = []
        self._extend(self._features(prefill, slice(0, len(prompt_ids))))

    @torch.inference_mode()
    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        # the root and the accepted nodes are now committed at positions n .. n+len(path)-1
        self.root = accepted.bonus
        self._extend(self._features(out, accepted.path))

    def _extend(self, feats: Tensor) -> None:
        """Append the context K/V of new committed positions (features [1, T, n_layers * H])."""
        t, n = feats.shape[1], self.n
        self._reserve(n + t)
        pos = torch.arange(n, n + t, device=feats.device)[None]
        for (ck, cv), (k, v) in zip(self.cache, self.model.context_kv(self.model.context(feats), pos)):
            ck[:, :, n : n + t] = k
            cv[:, :, n : n + t] = v
        self.n = n + t
        self._logp = None

    def _reserve(self, slots: int) -> None:
        if self.cache and self.cache[0][0].shape[2] >= slots:
            return
        cap = max(slots, 2 * (self.cache[0][0].shape[2] if self.cache else 256))
        ref = self.model.head_w
        shape = (1, self.cfg.num_kv_heads, cap, self.cfg.head_dim)
        grown = []
        for i in range(self.cfg.layers):
            k, v = torch.zeros(shape, dtype=ref.dtype, device=ref.device), torch.zeros(shape, dtype=ref.dtype, device=ref.device)
            if self.cache:
                k[:, :, : self.n] = self.cache[i][0][:, :, : self.n]
                v[:, :, : self.n] = self.cache[i][1][:, :, : self.n]
            grown.append((k, v))
        self.cache = grown

    # ------------------------------------------------------------------ drafting
    @torch.inference_mode()
    def block_logp(self, depth: int | None = None) -> Tensor:
        """Log-probabilities [K, depth, V'] over the draft vocabulary of the next block's first
        ``depth`` positions (default all D; all K modes in one pass over the shared context).  A
        tree of budget b never goes deeper than b, so propose scores only min(D, b) rows."""
        depth = self.cfg.depth if depth is None else max(1, min(depth, self.cfg.depth))
        if self._logp is None or self._logp.shape[1] < depth:
            m, cfg, n = self.model, self.cfg, self.n
            dev = m.head_w.device
            x = m.block_inputs(torch.tensor([self.root], device=dev))  # [1, K, B, H]
            pos = (n + torch.arange(cfg.block_size, device=dev)).repeat(cfg.modes)[None]  # [1, K*B]
            ctx = [(k[:, :, :n], v[:, :, :n]) for k, v in self.cache]
            h = m.run_blocks(x.flatten(1, 2), pos, modes_mask(cfg.modes, cfg.block_size, n, dev), ctx)
            h = h.view(cfg.modes, cfg.block_size, -1)  # [K, B, H]: row 0 = the root, rows 1 .. B-1 draft positions 1 .. D
            self._logp = torch.log_softmax(m.logits(h[:, 1 : depth + 1]).float(), -1)
            self._prior = m.mode_logp(h[:, 0])
        return self._logp[:, :depth]

    def mode_prior(self) -> Tensor:
        """log pi_k [K] of the next block: the gate's (uniform for an ungated drafter)."""
        if self._logp is None:
            self.block_logp()
        return self._prior

    def marginals(self, k: int, depth: int | None = None) -> tuple[Tensor, Tensor]:
        """Per mode and depth the top-k draft tokens (target ids) and their log-probabilities, sorted
        descending: (tokens LongTensor [K, depth, k], logp FloatTensor [K, depth, k]; depth default D)."""
        top = self.block_logp(depth).topk(min(k, self.model.head_w.shape[0]), -1)
        return self.model.vocab_ids[top.indices], top.values

    def propose(self, budget: int) -> Tree:
        if budget <= 0:
            return Tree.single(self.root)
        k = min(self.opts.topk, budget)
        depth = min(self.cfg.depth, budget)  # no path of a budget-b tree is longer than b
        self.block_logp(depth)
        prior = self.mode_prior()  # [K]
        if self.opts.tree == "linear":
            tokens, logp = self.marginals(1, depth)  # [K, depth, 1]
            best = int((prior + logp[:, :, 0].sum(1)).argmax())  # the mode whose chain is most likely
            chain = tokens[best, :, 0].tolist()
            return Tree(tokens=[self.root] + chain, parents=list(range(-1, depth)))
        if self.opts.tree == "mixture":
            tokens, logp = self.marginals(k, depth)
            return mixture_tree(self.root, tokens, logp, budget, prior=prior if self.cfg.gate else None).tree
        lp = self.block_logp(depth)  # [K, depth, V']: the product tree over the modes' mixture sum_k pi_k q_k
        avg = lp[0] if lp.shape[0] == 1 else torch.logsumexp(lp + prior[:, None, None], 0)  # [D, V']
        top = avg.topk(min(k, avg.shape[-1]), -1)
        return ddtree(self.root, self.model.vocab_ids[top.indices], top.values, budget).tree


# ---------------------------------------------------------------------------- loading


def load_model(target, path: str | Path) -> tuple[BlockModel, dict]:
    """A trained ``BlockModel`` for ``target`` from a checkpoint (clear errors for the wrong target,
    a corrupt file or one of another kind)."""
    from specdraft.checkpoint import check_fits, load_checkpoint

    tensors, manifest = load_checkpoint(path, target_hash=target.weight_hash, kind="block")
    try:
        cfg = BlockConfig.from_json(manifest["config"])
        check_fits(cfg, target, path)
        tm = target.model
        model = BlockModel(cfg, tm.embed.weight, tm.lm_head.weight, tensors["vocab_ids"].to(tm.embed.weight.device))
        model.load_state_dict(tensors)
    except (KeyError, TypeError, RuntimeError, IndexError) as e:
        raise SpecdraftError(f"checkpoint {path} does not hold a valid block drafter ({e})") from None
    return model.to(device=target.device, dtype=target.model.embed.weight.dtype), manifest


def load_block(target, name: str, path: str | Path | None = None, budget: int | None = None,
               opts: dict[str, str] | None = None) -> BlockDrafter:
    """``make_drafter`` entry: ``block``/``mfd`` (shipped weights) or a checkpoint path; options
    ``tree=linear|ddtree|mixture``, ``topk=N`` and ``bf16=0|1`` (default: 1 where ``native_bf16``)."""
    if target is None:
        raise SpecdraftError(f"the {name} drafter needs the target (its features, embeddings and LM head)")
    opts = dict(opts or {})
    tree = opts.pop("tree", None)
    if tree is not None and tree not in TREES:
        raise SpecdraftError(f"{name} option tree must be one of {', '.join(TREES)} (got {tree!r})")
    topk = None
    if "topk" in opts:
        try:
            topk = int(opts.pop("topk"))
        except ValueError:
            raise SpecdraftError(f"{name} option topk must be an integer") from None
        if topk < 1:
            raise SpecdraftError(f"{name} option topk must be >= 1 (got {topk})")
    bf16 = opts.pop("bf16", None)
    if bf16 not in (None, "0", "1"):
        raise SpecdraftError(f"{name} option bf16 must be 0 or 1 (got {bf16!r})")
    if opts:
        raise SpecdraftError(f"drafter {name!r} has no option {sorted(opts)[0]!r} (options: bf16, topk, tree)")
    shipped = path is None
    if shipped:
        if name not in NAMES:
            raise SpecdraftError(f"drafter {name!r} needs a checkpoint path")
        path = default_weights_path(name)
        if not path.is_file():
            raise SpecdraftError(
                f"the {name} drafter's weights ({path}) are not in this install yet; train them with "
                f"`specdraft train block --modes {NAMES[name]} --data data/smollm2 --features data/smollm2_feat "
                f"--out {path}` (about 7 / 13 min on a 2-core CPU for K=1 / 4) or pass a checkpoint path as --drafter")
    model, manifest = load_model(target, path)
    if bf16 == "1" or (bf16 is None and native_bf16(target.device)):
        model = model.to(torch.bfloat16)  # the drafting matmuls read half the bytes (lossless: the target verifies)
        model.prepack()  # and oneDNN reorders each weight once, not per call
    cfg = BlockDraftConfig(tree=tree or ("mixture" if model.cfg.modes > 1 else "ddtree"))
    if topk is not None:
        cfg.topk = topk
    if budget is None:
        from specdraft.bench.cost import profile_budget

        # without a measured cost curve: 4 nodes on a CPU (a pass grows with its tokens there; the
        # best budget measured on a 2-core CPU), cfg.budget on a GPU (where 13 tokens cost about one)
        fallback = 4 if target.device.type == "cpu" else cfg.budget
        budget = profile_budget(target, manifest, fallback)
    cfg.budget = budget
    return BlockDrafter(model, cfg, name=name if shipped else None, manifest=manifest)
