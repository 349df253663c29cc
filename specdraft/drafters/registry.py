"""The drafter registry: one table of drafter specs, and ``make_drafter`` built from it.

``make_drafter("NAME@key=value,...", target)`` looks NAME up in ``REGISTRY`` (or, for a path,
reads the checkpoint's kind from its manifest), parses the options into the spec's options
dataclass (which validates them), loads the shipped weights or the checkpoint through
``nn.checkpoint.load_draft_model`` (target-fit checks included), builds the drafter, wraps it
with prompt lookup when ``ngram=N`` asks for it, and sets its node budget by the one budget
policy (``drafters.budget.default_budget``).  ``NAME@budget=N`` fixes the budget for any drafter;
a trained drafter loads on any quantization of the model it was trained for (one note) and
``NAME@any_target=1`` on another model of the same shape (one warning; lossless, acceptance may differ).

Adding a drafter: one module with the drafter, its options dataclass and a builder
``(target, checkpoint, options, name) -> Drafter``, plus one ``DrafterSpec`` row below.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Callable, get_type_hints

from specdraft.drafters.base import Drafter, NoDrafter
from specdraft.drafters.block import BlockDrafter, BlockOptions, load_block
from specdraft.drafters.budget import default_budget
from specdraft.drafters.calibration import Calibration, calibration_for, sampled_maps
from specdraft.drafters.combine import WithNgram
from specdraft.drafters.hybrid import HybridDrafter, HybridOptions, load_hybrid
from specdraft.drafters.datastore import shipped_stores
from specdraft.drafters.ngram import NgramDrafter, NgramOptions, load_ngram
from specdraft.drafters.phrase import PhraseDrafter, PhraseOptions, load_phrase
from specdraft.errors import SpecdraftError
from specdraft.nn.checkpoint import checkpoint_kind, checkpoint_manifest, fits_target, load_draft_model

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"  # shipped weights: NAME_MODEL.safetensors per target
# the folders a drafter's recipe trains on (scripts/train_drafters.sh): the fast mode's own responses and their
# features of target layers 2, 15, 27 and the final state (phrase, gumiho, mfd and block ship trained on the broad mix instead:
# docs/training.md)
DATA_HINT = "--data data/smollm2 --features data/smollm2_feat --precision fast"


@dataclass
class NoOptions:
    """A drafter without options (``NAME@budget=N`` still sets its budget)."""


@dataclass(frozen=True)
class DrafterSpec:
    name: str  # what --drafter takes
    summary: str  # one line for --help, `specdraft drafters` and the README's table
    options: type  # dataclass of the NAME@key=value options; validates itself in __post_init__
    build: Callable  # (target, DraftCheckpoint | None, options, name | None) -> Drafter
    fallback_budget: int  # drafted nodes per tree without a cost curve (0 = drafts nothing: always 0)
    kind: str = ""  # checkpoint kind it loads (phrase / hybrid / block); "" = no weights
    weights: str = ""  # file in specdraft/weights shipped for the default target
    train: str = ""  # the command that trains the shipped weights (told when the file is missing)
    gpu_budget: int | None = None  # fallback on a GPU where it differs (a pass there costs about one token)
    lookup: bool = False  # its ``ngram=N`` option gives N tree nodes to prompt lookup (``WithNgram``)
    scale_with_curve: bool = False  # without a budget profile, its budget follows the cost curve (budget policy rule 2)


def _hybrid(name: str, summary: str, args: str) -> DrafterSpec:
    return DrafterSpec(name, summary, HybridOptions, load_hybrid, HybridDrafter.default_budget, kind="hybrid",
                       weights=f"{name}_smollm2_135m.safetensors",
                       train=f"specdraft train hybrid {args} {DATA_HINT} --out {{path}}", lookup=True,
                       scale_with_curve=True)


def _block(name: str, summary: str, args: str) -> DrafterSpec:
    # without a measured cost curve: 4 nodes on a CPU (a pass grows with its tokens there; the best
    # budget measured on a 2-core CPU), the drafter's 12 on a GPU (where 13 tokens cost about one)
    return DrafterSpec(name, summary, BlockOptions, load_block, 4, kind="block", gpu_budget=BlockDrafter.default_budget,
                       weights=f"{name}_smollm2_135m.safetensors", lookup=True,
                       train=f"specdraft train block {args} {DATA_HINT} --out {{path}}")


REGISTRY: dict[str, DrafterSpec] = {s.name: s for s in (
    DrafterSpec("none", "plain decoding: every pass verifies the root alone", NoOptions,
                lambda target, ckpt, opts, name: NoDrafter(), 0),
    DrafterSpec("ngram", "prompt lookup as a tree (training-free): continuations of earlier n-gram matches in the "
                "context and in a datastore of the target's own answers", NgramOptions, load_ngram,
                NgramDrafter.default_budget, scale_with_curve=True),
    DrafterSpec("phrase", "MLP head over a vocabulary of 1-3 word phrases, expanded into one prefix tree with "
                "prompt lookup", PhraseOptions, load_phrase, PhraseDrafter.default_budget, kind="phrase", weights="phrase_smollm2_135m.safetensors",
                train=f"specdraft train phrase {DATA_HINT} --out {{path}}"),
    _hybrid("gumiho", "Gumiho: serial Transformer steps for early tokens, parallel MLP heads for later ones",
            "--serial 2 --parallel 5 --serial-layers 2 --head-blocks 1 --head-grad 0 --distill 1.0 --feature-loss 1.0 "
            "--layers 2,15,27,-1 --width 256"),
    _hybrid("medusa", "Medusa: parallel MLP heads on the target's features", "--serial 0 --parallel 7 --distill 1.0 "
            "--layers 2,15,27,-1"),
    _hybrid("eagle", "EAGLE-style: a serial decoder layer on fused target features, run step by step",
            "--serial 7 --parallel 0 --distill 1.0 --layers 2,15,27,-1"),
    DrafterSpec("eagle3", "EAGLE-3 exactly: fc over 3 target layers, one decoder layer over [embedding ; state], its own "
                "LM head; exports to vLLM, SGLang and llama.cpp", HybridOptions, load_hybrid, HybridDrafter.default_budget,
                kind="eagle3", weights="eagle3_smollm2_135m.safetensors", lookup=True, scale_with_curve=True,
                train=f"specdraft train eagle3 {DATA_HINT} --out {{path}}"),
    _block("block", "DFlash block drafter: one pass drafts a block of 4 positions, DDTree product tree",
           "--modes 1 --block-size 5 --layers 2,15,27 --steps 1800 --width 256"),
    _block("mfd", "Multi-Future Drafting: K=4 mode embeddings draft 4 blocks in one pass, mixture tree",
           "--modes 4 --block-size 5 --layers 2,15,27 --steps 1800 --width 256"),
    _block("dflash", "DFlash exactly (q/k norm, the target's mask-token embedding, the full LM head; it drafts from the "
           "8,192 most frequent rows): a block of 7, DDTree product tree; exports to vLLM, SGLang and llama.cpp",
           "--dflash --draft-vocab 0 --draft-rows 8192 --layers 2,15,27 --steps 1800"),
)}
BY_KIND = {"phrase": REGISTRY["phrase"], "hybrid": REGISTRY["gumiho"], "eagle3": REGISTRY["eagle3"],
           "block": REGISTRY["block"]}  # for checkpoint paths
DRAFTERS = tuple(REGISTRY)


def shipped_files(name: str) -> list[Path]:
    """Registered drafter ``name``'s shipped weights: the default target's file (``DrafterSpec.weights``) first,
    then the other targets' ``NAME_*.safetensors`` in name order."""
    default = WEIGHTS_DIR / REGISTRY[name].weights
    return [default] + sorted(p for p in WEIGHTS_DIR.glob(f"{name}_*.safetensors") if p != default)


def weights_path(name: str, target=None) -> Path:
    """The shipped weights file of registered drafter ``name``: for ``target``, another target's file whose
    manifest names its model (these weights or another quantization of that model), else the default
    target's file, whose loading then says which model it was trained for."""
    default, *others = shipped_files(name)
    if target is not None:
        for path in others:
            if fits_target(checkpoint_manifest(path), target):
                return path
    return default


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME[@key=value,...]`` -> (NAME, options); e.g. ``phrase@ngram=0,top_n=4``."""
    name, at, rest = spec.partition("@")
    if at and not rest.strip(","):
        raise SpecdraftError(f"drafter {spec!r} has an '@' but no options (NAME@key=value,...)")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise SpecdraftError(f"drafter option {item!r} in {spec!r} is not key=value")
        if key.strip() in opts:
            raise SpecdraftError(f"drafter option {key.strip()!r} is given twice in {spec!r}")
        opts[key.strip()] = value.strip()
    return name, opts


def parse_options(name: str, cls: type, raw: dict[str, str]):
    """``raw`` key=value strings -> an instance of the options dataclass ``cls`` (its field types
    say how each value is read; its ``__post_init__`` checks ranges)."""
    known = {f.name: f for f in fields(cls)}
    types = get_type_hints(cls)
    bad = sorted(set(raw) - set(known))
    if bad:
        raise SpecdraftError(f"drafter {name!r} has no option {bad[0]!r}"
                             + (f" (options: {', '.join(sorted(known))})" if known else ""))
    values: dict = {}
    for key, text in raw.items():
        kind = types[key]
        if kind is bool:
            values[key] = text.lower() not in ("0", "false", "no")
        elif kind is int:
            try:
                values[key] = int(text)
            except ValueError:
                raise SpecdraftError(f"{name} option {key} must be an integer (got {text!r})") from None
        else:
            values[key] = text
    try:
        return cls(**values)
    except SpecdraftError as e:
        raise SpecdraftError(f"{name} {e}") from None


def option_defaults(cls: type) -> str:
    """``key=default, ...`` of an options dataclass as a user writes them (booleans 0/1, "" = auto)."""
    def shown(v) -> str:
        return str(int(v)) if isinstance(v, bool) else "auto" if v == "" else str(v)

    return ", ".join(f"{f.name}={shown(f.default)}" for f in fields(cls) if f.default is not MISSING) or "-"


AUTO = "auto"  # the commands' default drafter: DEFAULT_DRAFTER where its shipped weights fit the target, else FALLBACK
DEFAULT_DRAFTER = "phrase"  # the fastest on fresh prompts (docs/benchmarks.md, "Fresh prompts")
FALLBACK_DRAFTER = "ngram"  # training-free: fits any target


def make_drafter(spec: str, target=None, budget: int | None = None) -> Drafter:
    """Build the drafter ``spec`` (``NAME[@key=value,...]``, NAME registered or a checkpoint path, or ``auto``)
    for ``target``; ``budget``: drafted nodes per tree (None = the budget policy's choice)."""
    if spec == AUTO:
        try:
            return make_drafter(DEFAULT_DRAFTER, target, budget)
        except SpecdraftError:  # another target (or no weights in this install): prompt lookup fits any
            return make_drafter(FALLBACK_DRAFTER, target, budget)
    name, raw = parse_spec(spec)
    if "budget" in raw:  # NAME@budget=N: this drafter's node budget (any drafter)
        value = raw.pop("budget")
        if not (value.isascii() and value.isdigit()):  # str.isdigit() also takes "²", which int() does not
            raise SpecdraftError(f"drafter option budget must be an integer >= 0 (got {value!r})")
        budget = int(value)
    any_target = raw.pop("any_target", "0")  # NAME@any_target=1: a trained drafter on another model of its shape
    if any_target not in ("0", "1"):
        raise SpecdraftError(f"drafter option any_target must be 0 or 1 (got {any_target!r})")
    path, shown = None, name
    if name.endswith(".safetensors") or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise SpecdraftError(f"drafter checkpoint {path} not found")
        kind = checkpoint_kind(path)
        if kind not in BY_KIND:
            raise SpecdraftError(f"{path} holds a drafter of unknown kind {kind!r}")
        entry, shown = BY_KIND[kind], kind
    elif name in REGISTRY:
        entry = REGISTRY[name]
    else:
        raise SpecdraftError(f"unknown drafter {name!r} (available: {', '.join(DRAFTERS)}, {AUTO}, or a checkpoint path)")
    options = parse_options(shown, entry.options, raw)
    ckpt = None
    if entry.kind:
        if target is None:
            raise SpecdraftError(f"the {shown} drafter needs the target (its features, embeddings and LM head)")
        if path is None:
            path = weights_path(name, target)
            if not path.is_file():
                raise SpecdraftError(f"the {name} drafter's weights ({path}) are not in this install yet; train them "
                                     f"with `{entry.train.format(path=path)}` or pass a checkpoint path as --drafter")
        ckpt = load_draft_model(target, path, entry.kind, any_target=any_target == "1")
    drafter = entry.build(target, ckpt, options, name if name in REGISTRY else None)  # a checkpoint names itself
    if entry.kind in ("hybrid", "block", "eagle3"):  # node probabilities: the shipped weights' fitted map; raw
        drafter.calibration = calibration_for(name, target) if name in REGISTRY else Calibration()  # for a path
    if entry.lookup and options.ngram > 0:
        drafter = WithNgram(drafter, options.ngram)
    # node probabilities -> acceptance under sampling, per temperature: fitted on the shipped weights only
    drafter.sampled = sampled_maps(name, target) if name in REGISTRY else {}
    if entry.fallback_budget == 0:
        budget = 0  # a drafter that drafts nothing verifies the root alone
    elif budget is None and target is not None:
        fallback = entry.gpu_budget if entry.gpu_budget is not None and target.device.type != "cpu" else entry.fallback_budget
        profiled = ckpt is not None and getattr(options, "profiled", True)
        budget = default_budget(target, fallback, ckpt.manifest if profiled else None, entry.scale_with_curve)
    if budget is not None:
        drafter.default_budget = budget
    return drafter


def drafters_table() -> str:
    """The registry as a Markdown table (``specdraft drafters --markdown``; the README's table)."""
    rows = ["| drafter | what it drafts with | options (`NAME@key=value`) | shipped weights |", "|---|---|---|---|"]
    for s in REGISTRY.values():
        shipped = ", ".join(f"`{f.name}`" for f in shipped_files(s.name)) if s.weights else "none needed"
        if s.name == "ngram" and shipped_stores():
            shipped += "; datastores " + ", ".join(f"`{f.name}`" for f in shipped_stores())
        rows.append(f"| `{s.name}` | {s.summary} | {option_defaults(s.options)} | {shipped} |")
    return "\n".join(rows)
