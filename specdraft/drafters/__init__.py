"""Drafter registry: ``make_drafter(name, target)``.

``name`` is a registered drafter (``none``, ``ngram``, ``phrase``, ...), which loads the weights
shipped for the default target, or the path of a drafter checkpoint (``.safetensors``) trained
with ``specdraft train``; its manifest says which kind it is.
"""

from __future__ import annotations

from pathlib import Path

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.ngram import NgramConfig, NgramDrafter
from specdraft.errors import SpecdraftError

DRAFTERS = ("none", "ngram", "phrase", "gumiho", "medusa", "eagle", "block", "mfd")
HYBRID = ("gumiho", "medusa", "eagle", "hybrid")  # trained hybrid drafters (checkpoint kind "hybrid")
BLOCK = ("block", "mfd")  # block drafters, single- and multi-mode (checkpoint kind "block")


def _checkpoint_kind(path: Path) -> str:
    import json

    from safetensors import safe_open

    from specdraft.checkpoint import MANIFEST_KEY

    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {})[MANIFEST_KEY])["kind"]
    except Exception:
        raise SpecdraftError(f"{path} is not a specdraft drafter checkpoint (corrupt or missing manifest)") from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME[@key=value,...]`` -> (NAME, options); e.g. ``phrase@ngram=0,top_n=4``."""
    name, _, rest = spec.partition("@")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SpecdraftError(f"drafter option {item!r} in {spec!r} is not key=value")
        opts[key.strip()] = value.strip()
    return name, opts


def _lookup_nodes(name: str, value: str) -> int:
    """``NAME@ngram=N``: up to N tree nodes for prompt-lookup candidates (0 = none)."""
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise SpecdraftError(f"{name} option ngram must be an integer >= 0 (nodes given to prompt lookup; got {value!r})")
    return n


def _with_lookup(drafter, lookup_nodes: int):
    if lookup_nodes == 0:
        return drafter
    from specdraft.drafters.combine import WithNgram

    return WithNgram(drafter, lookup_nodes)


def make_drafter(name: str, target=None, budget: int | None = None) -> Drafter:
    """Build the drafter ``name`` (or load a checkpoint path) for ``target``.

    Options after ``@`` tune a drafter: ``NAME@budget=N`` (any drafter: its node budget), ``phrase@ngram=0`` (no prompt-lookup candidates in the
    tree), ``phrase@top_n=4`` (entries expanded per step), ``gumiho@topk=4,beams=2,bf16=1``
    (children scored per node, nodes expanded per depth, bfloat16 drafting; also ``medusa``, ``eagle``),
    ``gumiho@ngram=4`` (up to 4 tree nodes for prompt-lookup candidates, the model's best nodes fill the rest).
    ``block@tree=linear|ddtree|mixture,topk=16,bf16=0`` (tree shape, candidates per depth, bfloat16 drafting;
    also ``mfd``).
    """
    name, opts = parse_spec(name)
    if "budget" in opts:  # NAME@budget=N: this drafter's node budget (any drafter)
        value = opts.pop("budget")
        if not value.isdigit():
            raise SpecdraftError(f"drafter option budget must be an integer >= 0 (got {value!r})")
        budget = int(value)
    path = None
    if name.endswith(".safetensors") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise SpecdraftError(f"drafter checkpoint {path} not found")
        name = _checkpoint_kind(path)
    allowed = {"phrase": {"ngram", "top_n"}, **dict.fromkeys(HYBRID, {"topk", "beams", "bf16", "ngram"}),
               **dict.fromkeys(BLOCK, {"tree", "topk", "bf16", "ngram"})}.get(name, set())
    bad = sorted(set(opts) - allowed)
    if bad:
        raise SpecdraftError(f"drafter {name!r} has no option {bad[0]!r}" + (f" (options: {', '.join(sorted(allowed))})" if allowed else ""))
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        cfg = NgramConfig()
        if target is not None:
            from specdraft.bench.cost import budget_from_curve, load_cost_curve

            curve = load_cost_curve(target)
            if curve is not None:
                cfg.budget = budget_from_curve(curve, default=cfg.budget)
        if budget is not None:
            cfg.budget = budget
        return NgramDrafter(cfg)
    if name == "phrase":
        if target is None:
            raise SpecdraftError("the phrase drafter needs the target (its hidden states and embeddings)")
        from specdraft.drafters.phrase import load_phrase

        try:
            with_ngram = opts.get("ngram", "1") not in ("0", "false", "no")
            top_n = int(opts["top_n"]) if "top_n" in opts else None
        except ValueError:
            raise SpecdraftError(f"phrase option top_n must be an integer (got {opts['top_n']!r})") from None
        return load_phrase(target, path, budget=budget, with_ngram=with_ngram, top_n=top_n)
    if name in HYBRID:
        from specdraft.drafters.hybrid import load_hybrid

        lookup = _lookup_nodes(name, opts.pop("ngram", "0"))
        return _with_lookup(load_hybrid(target, name, path, budget=budget, opts=opts), lookup)
    if name in BLOCK:
        from specdraft.drafters.block import load_block

        lookup = _lookup_nodes(name, opts.pop("ngram", "0"))
        return _with_lookup(load_block(target, name, path, budget=budget, opts=opts), lookup)
    raise SpecdraftError(f"unknown drafter {name!r} (available: {', '.join(DRAFTERS)}, or a checkpoint path)")
