"""The drafter interface every drafter implements, the empty drafter (plain decoding), and what
the drafters around a trained network share (their options, state and the way they read the
target's features)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.model.llama import ForwardOutput
from specdraft.model.packed import native_bf16
from specdraft.nn.layers import DraftCache
from specdraft.tree import Tree
from specdraft.verify import Accepted


class Drafter(Protocol):
    name: str
    hidden_layers: tuple[int, ...]  # target features the drafter reads (see ForwardOutput.hidden)
    default_budget: int  # drafted nodes per tree when the user gives no --budget

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        """Start a new sequence: the prompt, the target's first token (the first root), prefill output."""

    def propose(self, budget: int) -> Tree:
        """A tree rooted at the last committed token with at most ``budget`` drafted nodes."""

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        """The verifier kept ``accepted``: ``out.hidden[layer][0, accepted.path]`` are the features of the
        committed nodes, ``accepted.new_tokens`` the token after each.  A drafter reads nothing else: the
        batch (``batch.Batcher``) may hand it several passes at once, rows concatenated, ``out.logits``
        None."""

    def fork(self) -> "Drafter":
        """A drafter for another sequence: the same network, options and budget, its own state (the
        batched server gives every request one)."""


class NoDrafter:
    """Drafts nothing: every pass verifies the root alone, i.e. plain decoding."""

    name = "none"
    hidden_layers: tuple[int, ...] = ()
    default_budget = 0

    def __init__(self) -> None:
        self.last = -1

    def reset(self, prompt_ids: list[int], first_token: int, prefill: ForwardOutput) -> None:
        self.last = first_token

    def propose(self, budget: int) -> Tree:
        return Tree.single(self.last)

    def commit(self, accepted: Accepted, out: ForwardOutput) -> None:
        self.last = accepted.bonus

    def fork(self) -> "NoDrafter":
        return type(self)()


@dataclass
class TrainedOptions:
    """The ``NAME@key=value`` options every trained network drafter (hybrid, block) takes."""

    bf16: int = -1  # 1 = draft in bfloat16 with weights packed once, 0 = the target's dtype, -1 = 1 where the CPU has native bfloat16
    int8: int = -1  # 1 = drafting matmuls on the fast kernel (Q8_0 weights, 8-bit activations; wins over bf16),
    # 0 = off, -1 = 1 when the target runs in the fast precision mode
    ngram: int = 0  # tree nodes given to prompt-lookup candidates (0 = none; ``drafters.combine``)
    fused: int = 1  # with int8: 1 = each decoder layer one C++ call and the top-k in C++, 0 = torch's modules
    # around the same 8-bit projections (the reference; slower)
    wbits: int = 8  # with int8: the weights rounded to 8-bit (Q8_0) or 4-bit (Q4_0, half the bytes a step reads) blocks
    vocab: int = -1  # draft from the draft vocabulary's N most frequent tokens (a smaller head scored each step); 0 = all
    # of it, -1 = the checkpoint's choice (its manifest's ``draft_rows``, else all)

    def __post_init__(self) -> None:
        if self.bf16 not in (-1, 0, 1):
            raise SpecdraftError(f"option bf16 must be 0 or 1 (got {self.bf16})")
        if self.int8 not in (-1, 0, 1):
            raise SpecdraftError(f"option int8 must be 0 or 1 (got {self.int8})")
        if self.wbits not in (4, 8):
            raise SpecdraftError(f"option wbits must be 8 or 4 (got {self.wbits})")
        if self.fused not in (0, 1):
            raise SpecdraftError(f"option fused must be 0 or 1 (got {self.fused})")
        if self.ngram < 0:
            raise SpecdraftError(f"option ngram must be >= 0 (tree nodes given to prompt lookup; got {self.ngram})")
        if self.vocab < -1:
            raise SpecdraftError(f"option vocab must be >= 0 (draft-vocabulary tokens drafted from, 0 = all) or -1 (the "
                                 f"checkpoint's choice; got {self.vocab})")


def draft_rows(manifest: dict | None) -> int:
    """A checkpoint's ``draft_rows``: the draft-vocabulary rows it drafts from by default (0 = all)."""
    rows = (manifest or {}).get("draft_rows", 0)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
        raise SpecdraftError(f"the checkpoint's draft_rows must be an integer >= 0 (got {rows!r})")
    return rows


def prepare_network(model, target, options: TrainedOptions, manifest: dict | None = None):
    """A drafter network ready to draft for ``target``: its draft vocabulary cut to ``options.vocab`` tokens (or
    the checkpoint ``manifest``'s ``draft_rows``), its matmuls on the fast kernel (``options.int8``;
    by default when the target runs in the fast mode), else in bfloat16 with packed weights
    (``options.bf16``; by default where the CPU has native bfloat16), else as loaded.  Drafting is
    lossless whatever its arithmetic or vocabulary: the target verifies."""
    model.keep_vocab(options.vocab if options.vocab >= 0 else draft_rows(manifest))
    int8 = options.int8 == 1 or (options.int8 < 0 and target.precision == "fast")
    kind = "Q8_0" if options.wbits == 8 else "Q4_0"
    if int8 and target.device.type == "cpu" and model.prepack(int8=True, fused=bool(options.fused), kind=kind):
        return model
    if options.bf16 == 1 or (options.bf16 < 0 and native_bf16(target.device)):
        model = model.to(torch.bfloat16)  # RoPE angles stay fp32 (DraftModel.inv_freq is no buffer)
        model.prepack()  # oneDNN reorders each weight once, not per call
    return model


class TrainedDrafter:
    """The state of a drafter around a trained network (``nn.layers.DraftModel``): the network, its
    options, the root and its own K/V cache of the committed positions."""

    def __init__(self, model, options, name: str, manifest: dict | None, cache_layers: int) -> None:
        self.model = model.eval()
        self.cfg = model.cfg
        self.opts = options
        self.name = name
        self.hidden_layers: tuple[int, ...] = tuple(self.cfg.feature_layers)  # target features read
        self.manifest = manifest or {}
        self.calibration = None  # raw path probability -> probability of acceptance (the registry sets the fitted
        # one, drafters.calibration); None: trees carry no probabilities and are used as proposed
        self.cache_layers = cache_layers  # layers with K/V of committed positions
        self.start(-1)

    def fork(self) -> "TrainedDrafter":
        """The same network and options (shared, read-only), a fresh sequence state."""
        new = copy.copy(self)
        new.start(-1)
        return new

    def start(self, root: int) -> None:
        """A new sequence: ``root`` is the first tree's root; nothing committed in the cache yet."""
        self.root = root
        self.n = 0  # committed positions in the cache (= position of the root)
        shape = self.model.layer_cfg  # the network's own layers (narrower than the target's where it has a width)
        self.cache = DraftCache(self.cache_layers, shape.num_kv_heads, shape.head_dim)

    def target_features(self, out: ForwardOutput, rows) -> Tensor:
        """The features this drafter reads, of the given rows of a target pass: [..rows, n_layers * H]
        in the network's dtype (rows: an index, a list or a slice of the pass's nodes)."""
        return torch.cat([out.hidden[layer][0, rows] for layer in self.cfg.feature_layers], -1).to(self.model.head_w.dtype)
