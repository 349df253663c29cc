"""Command line (argument parsing only): ``specdraft generate``, ``chat``, ``serve``, ``drafters``,
``bench``, ``analyze``, ``data`` and ``train``.  Every command that needs a model starts from
``Engine.load``."""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

from specdraft.bench.acceptance import acceptance_sweep
from specdraft.bench.batch_curve import batch_curve
from specdraft.bench.chimeras import ChimeraConfig, chimera_report, format_summary
from specdraft.bench.cost import PEER_PASSES, PREFILL_LENGTHS, measure_cost_curve, measure_prefill
from specdraft.bench.coverage import coverage_report
from specdraft.bench.llamacpp import find_binaries, pass_costs, target_gguf, with_working_repack
from specdraft.bench.report import (format_cost_table, format_decomposition, format_live_passes, format_table,
                                    write_report)
from specdraft.bench.runner import plot_cost_curve, run_bench
from specdraft.bench.stats import format_comparison
from specdraft.chat import ChatSession, run_chat
from specdraft.drafters.budget import load_cost_curve, save_cost_curve
from specdraft.drafters.registry import AUTO, DEFAULT_DRAFTER, DRAFTERS, FALLBACK_DRAFTER, drafters_table
from specdraft.engine import Engine
from specdraft.errors import SpecdraftError, SpecdraftNote
from specdraft.generate import GenerateConfig
from specdraft.paths import existing_folder, writable_file, writable_folder
from specdraft.model.fast import DEFAULT_PRECISION, PRECISIONS, kernel_info
from specdraft.nn.phrase import FEATURE_LAYER
from specdraft.server.queue import RequestQueue
from specdraft.train.block import BlockTrainConfig, train_block
from specdraft.train.data import BuildConfig, build_data, build_datastore, cache_features, read_manifest
from specdraft.nn.eagle3 import default_layers
from specdraft.train.hybrid import HybridTrainConfig, train_hybrid
from specdraft.train.phrase import PhraseTrainConfig, train_phrase
from specdraft.train.profile import add_budget_profile
from specdraft.train.prompts import MIX, MIX_SOURCES
from specdraft.verify import Sampling

DRAFTER_HELP = f"{', '.join(DRAFTERS)} (options: NAME@key=value; see `specdraft drafters`) or a drafter checkpoint path"


class _Parser(argparse.ArgumentParser):
    """Usage errors as every other error: one ``error:`` line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def _finite(text: str) -> float:
    """A float option: NaN and infinity are refused at parse time (exit code 2)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return x


def _seed(text: str) -> int:
    """A seed option: an integer in 0 .. 2^63 - 1 (what torch's generators take), refused at parse time."""
    try:
        x = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= x < 2**63:
        raise argparse.ArgumentTypeError(f"{text} is not in 0 .. 2^63-1")
    return x


def _layers(text: str) -> tuple[int, ...]:
    """``--layers 3,15,27,-1`` -> (3, 15, 27, -1)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecdraftError(f"--layers must be comma-separated integers (got {text!r})") from None


AUTO_HELP = (f" (default: {AUTO} = {DEFAULT_DRAFTER} where its shipped weights fit the target, else "
             f"{FALLBACK_DRAFTER})")


def _engine(args, drafter: str = "none", budget: int | None = None) -> Engine:
    """The target of ``--target/--device/--dtype`` with ``drafter``: every command loads through here."""
    return Engine.load(args.target, drafter, device=args.device, dtype=args.dtype, budget=budget,
                       precision=args.precision)


def _add_trainer_args(p, many: bool = False) -> None:
    """Arguments `train hybrid` and `train block` share (``many``: --data / --features repeatable)."""
    more = " (repeatable, paired in order with --features: trained on together)" if many else ""
    p.add_argument("--data", required=True, action="append" if many else "store",
                   help="data folder from `specdraft data build`" + more)
    p.add_argument("--features", required=True, action="append" if many else "store",
                   help="feature folder from `specdraft data features --layers ...` holding the --layers"
                        + (" (one per --data)" if many else ""))
    p.add_argument("--draft-vocab", type=int, default=8192, help="LM-head rows drafted from (0 = all; default 8192)")
    p.add_argument("--draft-rows", type=int, default=0,
                   help="draft from the draft vocabulary's N most frequent rows by default (the checkpoint's draft_rows; "
                        "0 = all): a full vocabulary kept for an export, drafted from its most frequent rows")
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=_finite, default=6e-4)
    p.add_argument("--shards", type=int, default=0,
                   help="train on the first N data shards only (of each --data folder; default all)")
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--out", required=True, help="checkpoint to write (.safetensors); re-run to resume")
    p.add_argument("--quiet", action="store_true")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or an HF folder")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--precision", default=DEFAULT_PRECISION, choices=tuple(PRECISIONS),
                   help="fast: 8-bit activations, bit-exact rows (speculative = plain decoding, token for token); "
                        "exact: fp32, equal to HF transformers within 1e-4 (default: fast where it can run, "
                        "on the CPU in float32, else exact)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdraft", description="Lossless tree-verified speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text; the text streams to stdout, stats to stderr")
    g.add_argument("prompt", nargs="?", help="the prompt (or use --file)")
    g.add_argument("--file", help="read the prompt from this file ('-' = stdin)")
    _add_target_args(g)
    g.add_argument("--drafter", default=AUTO, help=DRAFTER_HELP + AUTO_HELP)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=_finite, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=_finite, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--budget", type=int, default=None, help="drafted nodes per tree (default: the drafter's)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--quiet", action="store_true", help="no stats line on stderr")
    g.add_argument("--verbose", action="store_true",
                   help="also say on stderr what runs the passes (precision, kernel instruction set, block formats)")

    pr = sub.add_parser("prepare", help="build the CPU kernels, convert the target's tokenizer and pack its weights "
                                        "once, so the first run is as quick as the next (`make install` runs it)")
    _add_target_args(pr)
    pr.add_argument("--cost-curve", choices=("auto", "again", "skip"), default="auto",
                    help="the pass-cost curve the budget policy reads: measure it when none is stored for this machine "
                         "(auto), measure it again, or skip it")

    b = sub.add_parser("bench", help="benchmark against our plain decoding, llama.cpp and HF generate() on the same prompts")
    b.add_argument("--drafter", action="append", default=[], help="drafter to run (repeatable): " + DRAFTER_HELP)
    b.add_argument("--dataset", action="append", default=[], help="mtbench, humaneval, gsm or a .jsonl file (repeatable)")
    b.add_argument("--n", type=int, default=20, help="prompts per dataset")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--budget", type=int, default=None)
    b.add_argument("--out", default="bench_out", help="output folder (results.json, speedup.png)")
    b.add_argument("--temperature", type=_finite, default=0.0,
                   help="0 = greedy (default); > 0 samples (plain greedy is added for reference; no HF rows, "
                        "and not with --llama-cpp)")
    b.add_argument("--top-p", type=_finite, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=_seed, default=0, help="sampling seed")
    b.add_argument("--llama-cpp", metavar="BIN_DIR", default=None,
                   help="folder with llama.cpp's llama-server and llama-bench (scripts/build_llamacpp.sh builds them): "
                        "adds llamacpp rows, and llama-bench's pass times to --cost-curve")
    b.add_argument("--no-llamacpp-ngram", action="store_true", help="with --llama-cpp: skip the llamacpp_ngram row")
    b.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference row (hf_generate)")
    b.add_argument("--hf-lookup", action="store_true", help="add HF generate() with prompt lookup (hf_prompt_lookup)")
    b.add_argument("--cost-curve", action="store_true", help="measure the target's pass time for N = 1..64 and store it")
    b.add_argument("--batch-curve", action="store_true", help="batched regeneration tok/s at batch 1, 8, 32, 64 vs single-stream")
    b.add_argument("--report", action="store_true",
                   help="write OUT/report.md with plots from the JSON files in --out (after the run if --dataset is given)")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_target_args(b)

    dr = sub.add_parser("drafters", help="list the registered drafters, their options and shipped weights")
    dr.add_argument("--markdown", action="store_true", help="print the table in Markdown (as in the README)")

    d = sub.add_parser("data", help="training data: the target's own responses to training prompts")
    dsub = d.add_subparsers(dest="data_command", required=True)
    db = dsub.add_parser("build", help="collect prompts, regenerate the target's greedy responses into shards (resumable)")
    db.add_argument("--out", required=True, help="data folder (re-run with the same folder to resume)")
    db.add_argument("--n-prompts", type=int, default=3000)
    db.add_argument("--max-new-tokens", type=int, default=256)
    db.add_argument("--sources", default="gsm,reasoning,codeio,magpie",
                    help="comma-separated prompt sources, or `mix` for the broad mix (gsm, magpie, topics, writing, "
                         "followup, code, tasks); the default is the shipped drafters' data")
    db.add_argument("--split", default="train", choices=("train", "heldout"),
                    help="the broad mix's part: `heldout` draws from topics, instructions, programs and tasks no "
                         "training build uses (mix sources only)")
    db.add_argument("--seed", type=int, default=None,
                    help="seed of the gsm problems, the mix's sources and the sampled responses (default 1000); "
                         "another seed gives other prompts, e.g. for the next part of a large build")
    db.add_argument("--features-layers", default="",
                    help="comma-separated layers whose hidden states are kept while decoding and written to "
                         "OUT/features, as `data features` would compute them (fast mode; e.g. 2,15,27,-1)")
    db.add_argument("--sampled", type=float, default=0.0,
                    help="share of the prompts whose response is sampled at T=0.7 instead of greedy (default 0)")
    db.add_argument("--batch-size", type=int, default=32)
    db.add_argument("--shard-size", type=int, default=256)
    db.add_argument("--magpie-seed", type=int, default=None,
                    help="sampling seed of the magpie instructions (default: the training seed base, 1000; "
                         "another seed gives other instructions)")
    db.add_argument("--exclude", action="append", default=[], metavar="DATA",
                    help="a data folder whose prompts this build must not repeat (repeatable)")
    db.add_argument("--quiet", action="store_true")
    _add_target_args(db)
    df = dsub.add_parser("features", help="cache the target's hidden states as fp16 shards")
    df.add_argument("--data", required=True, help="data folder from `data build`")
    df.add_argument("--out", required=True)
    df.add_argument("--layers", default="-1", help="comma-separated layer indices (0 = embeddings, -1 = final normed)")
    df.add_argument("--batch-size", type=int, default=8)
    df.add_argument("--quiet", action="store_true")
    _add_target_args(df)
    ds = dsub.add_parser("datastore", help="a datastore of the target's own answers for prompt lookup (`ngram`): "
                         "every response of the data folders, indexed at load")
    ds.add_argument("--data", required=True, action="append", help="data folder from `data build` (repeatable)")
    ds.add_argument("--out", required=True, help="the datastore file (ship it as specdraft/weights/datastore_MODEL.safetensors)")
    _add_target_args(ds)
    t = sub.add_parser("train", help="train a drafter on a data folder (resumable)")
    tsub = t.add_subparsers(dest="train_command", required=True)
    tp = tsub.add_parser("phrase", help="mine a phrase vocabulary and train the phrase head")
    tp.add_argument("--data", required=True, action="append",
                    help="data folder from `specdraft data build` (repeatable: trained on together)")
    tp.add_argument("--features", action="append", default=None,
                    help="feature folder from `specdraft data features --layers -1`, one per --data in order "
                         "(default: DATA/features of each, computed if missing)")
    tp.add_argument("--vocab-size", type=int, default=8000, help="draft vocabulary entries (default 8000)")
    tp.add_argument("--epochs", type=int, default=4)
    tp.add_argument("--batch-size", type=int, default=1024)
    tp.add_argument("--lr", type=_finite, default=2e-3)
    tp.add_argument("--seed", type=_seed, default=0)
    tp.add_argument("--out", required=True, help="checkpoint to write (.safetensors); re-run to resume")
    tp.add_argument("--quiet", action="store_true")
    _add_target_args(tp)
    th = tsub.add_parser("hybrid", help="train a Gumiho hybrid drafter (Medusa: --serial 0, EAGLE-style: --parallel 0)")
    th.add_argument("--serial", type=int, default=2, help="draft positions from the serial decoder layers (default 2)")
    th.add_argument("--parallel", type=int, default=5, help="parallel MLP heads, one per later position (default 5)")
    th.add_argument("--layers", default="-1", help="target features the drafter reads, e.g. 3,15,27 (default -1 = final)")
    th.add_argument("--serial-layers", type=int, default=1, help="decoder layers of the serial part (default 1)")
    th.add_argument("--head-blocks", type=int, default=1, help="residual blocks per MLP head (default 1)")
    th.add_argument("--width", type=int, default=0,
                    help="the drafter's own hidden size, a multiple of the target's head size and of 32 (default 0 = "
                         "the target's): its layers and heads at that width, a cheaper drafting step")
    th.add_argument("--epochs", type=int, default=4)
    th.add_argument("--anchors", type=int, default=64, help="positions sampled per sequence per epoch (0 = all)")
    th.add_argument("--feature-loss", type=_finite, default=0.0,
                    help="weight of feature regression (SmoothL1) for the serial states (default 0: cross-entropy only)")
    th.add_argument("--serial-unroll", type=int, default=0,
                    help="serial steps unrolled in training (>= --serial; default 0 = --serial): steps past --serial "
                         "add a loss that trains the serial part only (the drafter still runs --serial steps)")
    th.add_argument("--head-grad", type=_finite, default=1.0,
                    help="share of the MLP heads' loss gradient reaching the serial states they read, in [0, 1] "
                         "(default 1; 0 = detached: the serial part trains on its own depths only)")
    th.add_argument("--distill", type=_finite, default=0.0,
                    help="share of each depth's cross-entropy taken against the target's own next-token distribution "
                         "instead of the label, in [0, 1] (default 0; needs the final layer in the feature cache)")
    th.add_argument("--init", default="",
                    help="start from this trained hybrid checkpoint (same shape; its draft vocabulary is kept): "
                         "fine-tuning, e.g. on more data")
    _add_trainer_args(th, many=True)
    _add_target_args(th)
    te = tsub.add_parser("eagle3", help="train an EAGLE-3 drafter (EAGLE-3's exact architecture and training-time test; "
                         "`specdraft export` writes it for vLLM, SGLang and llama.cpp)")
    te.add_argument("--steps", type=int, default=7, help="draft depth: serial steps drafted and trained (default 7)")
    te.add_argument("--layers", default="",
                    help="the 3 target layers whose inputs fc fuses (default EAGLE-3's: 2, L//2, L-3)")
    te.add_argument("--epochs", type=int, default=4)
    te.add_argument("--anchors", type=int, default=64, help="positions sampled per sequence per epoch (0 = all)")
    te.add_argument("--distill", type=_finite, default=1.0,
                    help="share of each step's cross-entropy taken against the target's own distribution, in [0, 1] "
                         "(default 1, as EAGLE-3; needs the final layer, -1, in the feature cache)")
    te.add_argument("--init", default="", help="start from this trained eagle3 checkpoint (same shape): fine-tuning")
    _add_trainer_args(te, many=True)
    _add_target_args(te)
    tb = tsub.add_parser("block", help="train a block drafter: DFlash (--modes 1) or Multi-Future Drafting (--modes K)")
    tb.add_argument("--modes", type=int, default=1, help="K mode embeddings, blocks drafted per pass (default 1)")
    tb.add_argument("--layers", default="3,15,27", help="target features fused into the context (default 3,15,27)")
    tb.add_argument("--block-size", type=int, default=8, help="B: the root plus B-1 drafted positions (default 8)")
    tb.add_argument("--draft-layers", type=int, default=1, help="drafter decoder layers (default 1)")
    tb.add_argument("--epochs", type=int, default=1, help="passes over the training sequences (default 1)")
    tb.add_argument("--steps", type=int, default=0,
                    help="optimizer steps in all, overriding --epochs (give K=1 and K>1 runs the same steps)")
    tb.add_argument("--anchors", type=int, default=12, help="blocks per sequence and step (0 = every position; default 12)")
    tb.add_argument("--gamma", type=_finite, default=4.0, help="depth j weighs exp(-(j-1)/gamma) in the loss (default 4)")
    tb.add_argument("--no-gate", action="store_true",
                    help="K > 1: train no mode gate (the mixture tree then weighs the modes equally)")
    tb.add_argument("--dflash", action="store_true",
                    help="DFlash's exact shape (q/k norm, the target's embedding of --mask-token as the mask, one "
                         "mode), so that `specdraft export --format dflash` can write it")
    tb.add_argument("--mask-token", type=int, default=0,
                    help="with --dflash: the target token whose embedding fills the mask rows (default 0)")
    tb.add_argument("--width", type=int, default=0,
                    help="the drafter's own hidden size, a multiple of the target's head size and of 32 (default 0 = "
                         "the target's): its context, block rows and layers at that width, a cheaper drafting pass")
    tb.add_argument("--bf16", type=int, default=-1, choices=(-1, 0, 1),
                    help="bfloat16 autocast for the matmuls: 1 on, 0 off, -1 (default) where the device does bfloat16 "
                         "matmuls natively (elsewhere autocast emulates them, several times slower); runs saved before "
                         "this option autocast everywhere: resume one with --bf16 1")
    _add_trainer_args(tb, many=True)
    _add_target_args(tb)

    tpr = tsub.add_parser("profile", help="measure a trained drafter's tokens per pass and drafting time per node "
                         "budget on its held-out training responses and store them in the checkpoint, so that it "
                         "picks each machine's best budget from the cost curve")
    tpr.add_argument("checkpoint", help="a block / mfd / hybrid checkpoint (.safetensors), rewritten in place")
    tpr.add_argument("--data", required=True, help="the data folder it was trained on (the first --data folder)")
    tpr.add_argument("--max-seqs", type=int, default=32, help="held-out sequences replayed (default 32)")
    tpr.add_argument("--quiet", action="store_true")
    _add_target_args(tpr)

    ex = sub.add_parser("export-target", help="write the target as a Hugging Face folder (config.json, safetensors, "
                        "tokenizer) for other engines' tools")
    ex.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct GGUF), a .gguf file or an HF folder")
    ex.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    ex.add_argument("--force", action="store_true", help="replace --out if it exists")

    ed = sub.add_parser("export", help="write a trained drafter in a serving engine's format (eagle3 or dflash: vLLM, SGLang, "
                        "llama.cpp) with config.json, model.safetensors and a README of serving commands")
    ed.add_argument("drafter", help="a shipped drafter's name (e.g. eagle3) or a checkpoint path")
    ed.add_argument("--format", required=True, choices=("eagle3", "dflash"), help="the drafter format to write")
    ed.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    ed.add_argument("--force", action="store_true", help="replace --out if it exists")
    _add_target_args(ed)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, completions, models, health)")
    _add_target_args(sv)
    sv.add_argument("--drafter", default=AUTO, help=DRAFTER_HELP + AUTO_HELP)
    sv.add_argument("--budget", type=int, default=None, help="drafted nodes per tree (default: the drafter's)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--api-key", default=os.environ.get("SPECDRAFT_API_KEY") or None,
                    help="require 'Authorization: Bearer KEY' on every route but /health "
                         "(default: $SPECDRAFT_API_KEY; none: no authentication)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--model-name", default=None, help="model id clients send (default: the target's name)")
    sv.add_argument("--max-batch", type=int, default=8,
                    help="requests decoded together, sharing every target pass (1 = one at a time; batching needs the "
                         "fast precision mode)")
    sv.add_argument("--max-queue", type=int, default=8, help="requests waiting for a place in the batch; more get 429")
    sv.add_argument("--max-tokens", type=int, default=512, help="max_tokens when a request gives none")
    sv.add_argument("--temperature", type=_finite, default=0.0, help="temperature when a request gives none (0 = greedy)")
    sv.add_argument("--quiet", action="store_true", help="no access log")

    c = sub.add_parser("chat", help="interactive terminal chat (streams replies, live tok/s and tokens per pass)")
    _add_target_args(c)
    c.add_argument("--drafter", default=AUTO, help=DRAFTER_HELP + AUTO_HELP)
    c.add_argument("--budget", type=int, default=None)
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--temperature", type=_finite, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-p", type=_finite, default=1.0)
    c.add_argument("--top-k", type=int, default=0)
    c.add_argument("--seed", type=_seed, default=0)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--quiet", action="store_true", help="no live status or stats lines")
    a = sub.add_parser("analyze", help="offline analyses of drafters (no timing)")
    asub = a.add_subparsers(dest="analyze_command", required=True)
    aa = asub.add_parser("acceptance", help="tokens per pass per drafter and node budget, replaying greedy output")
    aa.add_argument("--drafter", action="append", default=[], help="drafter name, spec or checkpoint (repeatable)")
    aa.add_argument("--dataset", action="append", default=[], help="mtbench, humaneval, gsm, a .jsonl file, or a data folder from `specdraft data build` "
                    "(its greedy responses, not regenerated) (repeatable)")
    aa.add_argument("--budget", action="append", type=int, default=[], help="node budget (repeatable; default 3)")
    aa.add_argument("--n", type=int, default=20)
    aa.add_argument("--max-new-tokens", type=int, default=256)
    aa.add_argument("--out", default="bench_out")
    aa.add_argument("--quiet", action="store_true")
    _add_target_args(aa)
    av = asub.add_parser("coverage", help="share of the greedy output the training responses never hold, and outside "
                         "each drafter's draft vocabulary")
    av.add_argument("--data", action="append", default=[], help="training data folder (repeatable)")
    av.add_argument("--drafter", action="append", default=[], help="drafter name, spec or checkpoint (repeatable)")
    av.add_argument("--dataset", action="append", default=[], help="mtbench, humaneval, gsm or a .jsonl file (repeatable)")
    av.add_argument("--n", type=int, default=20)
    av.add_argument("--max-new-tokens", type=int, default=256)
    av.add_argument("--out", default="bench_out")
    av.add_argument("--quiet", action="store_true")
    _add_target_args(av)
    ac = asub.add_parser("chimeras", help="share of a product-ranked tree stitched from different target futures")
    ac.add_argument("--drafter", required=True, help="a drafter with per-position distributions (block, mfd or a checkpoint)")
    ac.add_argument("--dataset", action="append", default=[], help="mtbench, humaneval, gsm or a .jsonl file (repeatable)")
    ac.add_argument("--n", type=int, default=20, help="prompts per dataset")
    ac.add_argument("--max-new-tokens", type=int, default=256, help="greedy output length the contexts come from")
    ac.add_argument("--budget", type=int, default=64, help="drafted nodes per tree")
    ac.add_argument("--contexts-per-prompt", type=int, default=8)
    ac.add_argument("--samples", type=int, default=16, help="futures sampled at temperature 1 per context (+ the greedy one)")
    ac.add_argument("--top-k", type=int, default=16, help="candidates per draft position")
    ac.add_argument("--seed", type=_seed, default=0)
    ac.add_argument("--out", default="bench_out")
    ac.add_argument("--quiet", action="store_true")
    _add_target_args(ac)
    return parser


def _read_prompt(args) -> str:
    if args.file and args.prompt:
        raise SpecdraftError("give the prompt as an argument or with --file, not both")
    if args.file:
        try:
            return sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        except OSError as e:
            raise SpecdraftError(f"cannot read {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SpecdraftError(f"{'standard input' if args.file == '-' else args.file} is not UTF-8 text") from None
    if args.prompt is None:
        raise SpecdraftError("no prompt: pass it as an argument or with --file")
    return args.prompt


def cmd_generate(args) -> None:
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise SpecdraftError("the prompt is empty")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if any(not s for s in args.stop):
        raise SpecdraftError("--stop strings must be non-empty (as the server's stop sequences)")
    engine = _engine(args, args.drafter, args.budget)
    drafter = engine.drafter
    if args.verbose:
        k = kernel_info(engine.target.model)
        print(f"[target] {engine.target.name}, precision {k['precision']}"
              + (f", kernel {k['isa']}, blocks {k['formats']}" if "isa" in k else ""), file=sys.stderr)
    ids = engine.target.encode_prompt(prompt, raw=args.raw)
    cfg = GenerateConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                         stop=args.stop, budget=args.budget)
    on_text = None if args.json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    r = engine.generate(ids, cfg, on_text=on_text)
    st = r.stats
    if args.json:
        obj = {"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
               "stats": {"new_tokens": st.new_tokens, "passes": st.passes, "tokens_per_pass": st.tokens_per_pass,
                         "wall_s": st.wall_s, "tok_s": st.tok_s, "prompt_tokens": len(ids),
                         "accept_hist": st.accept_hist, "draft_s": st.draft_s, "verify_s": st.verify_s,
                         "prefill_s": st.prefill_s}}
        print(json.dumps(obj))
    else:
        sys.stdout.write("\n")
    if not args.json and not args.quiet:
        print(f"[{drafter.name}] {st.new_tokens} tokens in {st.wall_s:.2f}s ({st.tok_s:.1f} tok/s), "
              f"{st.passes} passes, {st.tokens_per_pass:.2f} tokens/pass, accepted-length histogram "
              f"{st.accept_hist}, draft {st.draft_s:.2f}s, verify {st.verify_s:.2f}s, prefill {st.prefill_s:.2f}s "
              f"({len(ids)} prompt tokens, finish: {r.finish_reason})", file=sys.stderr)


def cmd_bench(args) -> None:
    if args.report and not (args.dataset or args.cost_curve or args.batch_curve):
        print(f"wrote {write_report(args.out)}", file=sys.stderr)
        return
    if args.cost_curve:
        binaries = find_binaries(args.llama_cpp) if args.llama_cpp else None  # a bad folder fails before any work
        gguf = target_gguf(args.target) if binaries is not None else None
        target = _engine(args).target
        curve = measure_cost_curve(target, quiet=args.quiet)
        path = save_cost_curve(target, curve)
        curve["prefill"] = measure_prefill(target, PREFILL_LENGTHS)
        if binaries is not None:
            threads = curve["threads"]
            binaries = with_working_repack(binaries, gguf, threads)
            curve["llamacpp"] = pass_costs(binaries, gguf, PEER_PASSES, threads)
            curve["llamacpp_prefill"] = pass_costs(binaries, gguf, list(PREFILL_LENGTHS), threads)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cost_curve.json").write_text(json.dumps(curve, indent=1))
        plot_cost_curve(curve, out / "cost_curve.png")
        picks = ", ".join(f"N={n}: {r:.2f}x" for n, r in zip(curve["n"], curve["ratio"]) if n in (1, 2, 4, 8, 16, 32, 64))
        print(f"cost curve stored in {path} ({picks} one token's {curve['ms'][0]:.1f} ms)", file=sys.stderr)
        print(format_cost_table(curve))
        if not args.dataset:
            return
    if args.batch_curve:
        target = _engine(args).target
        res = batch_curve(target, quiet=args.quiet)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "batch_curve.json").write_text(json.dumps(res, indent=1))
        print(f"single-stream {res['single_stream']['tok_s']:.1f} tok/s; " + "; ".join(
            f"batch {b}: {v['tok_s']:.1f} tok/s ({v['speedup_vs_single']:.2f}x), {v['rows_equal_single']}/{res['n_prompts']} rows equal"
            for b, v in res["batched"].items()), file=sys.stderr)
        if not args.dataset:
            return
    if not args.dataset:
        raise SpecdraftError("give at least one --dataset (mtbench, humaneval, gsm or a .jsonl file)")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    res = run_bench(args.drafter, args.dataset, n=args.n, max_new_tokens=args.max_new_tokens, out_dir=args.out,
                    target_spec=args.target, device=args.device, budget=args.budget, quiet=args.quiet,
                    precision=args.precision, sampling=sampling, seed=args.seed, llama_cpp=args.llama_cpp,
                    llama_cpp_ngram=not args.no_llamacpp_ngram, hf=not args.no_hf,
                    hf_lookup=args.hf_lookup)
    print(format_table(res))
    dec = format_decomposition(res)
    if dec:
        print("\nspeed-up ~ tokens/pass / (live pass ratio + drafting share); curve: the stored cost curve's ratio "
              "for the same passes\n" + dec)
    live = format_live_passes(res)
    if live:
        print("\nlive passes over the run against the stored cost curve\n" + live)
    print(f"wrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'speedup.png'}", file=sys.stderr)
    if args.report:
        print(f"wrote {write_report(args.out)}", file=sys.stderr)


PREPARE_CURVE_ROWS = 32  # the cost curve `prepare` measures: passes of 1..32 tokens (bench --cost-curve: 1..64)


def cmd_prepare(args) -> None:
    from specdraft.model.quant import kernel_available

    t0 = time.perf_counter()
    ok = kernel_available()
    t1 = time.perf_counter()
    print(f"CPU kernels: {'ready' if ok else 'unavailable (the exact mode still works)'} ({t1 - t0:.1f} s)", file=sys.stderr)
    target = _engine(args).target  # converts and caches the tokenizer, packs the weights into the cache
    t2 = time.perf_counter()
    print(f"{target.name}: {target.precision} mode, tokenizer and packed weights cached ({t2 - t1:.1f} s)", file=sys.stderr)
    if args.cost_curve == "again" or (args.cost_curve == "auto" and load_cost_curve(target) is None):
        curve = measure_cost_curve(target, max_n=PREPARE_CURVE_ROWS, repeats=5, quiet=True)
        path = save_cost_curve(target, curve)
        print(f"cost curve: a pass over 1 / 4 / 8 / 16 tokens costs {curve['ms'][0]:.1f} ms / "
              + " / ".join(f"{curve['ratio'][n - 1]:.2f}x" for n in (4, 8, 16)) + f" ({time.perf_counter() - t2:.1f} s; "
              f"{path}; `specdraft prepare --cost-curve again` on a quiet machine measures it anew)", file=sys.stderr)


def cmd_export_target(args) -> None:
    from specdraft.export import export_target

    out = export_target(args.target, args.out, force=args.force)
    print(f"wrote {out} (config.json, model.safetensors, tokenizer files, README.md)", file=sys.stderr)


def cmd_export(args) -> None:
    from specdraft.export import export_drafter

    out = export_drafter(_engine(args).target, args.drafter, args.format, args.out, force=args.force)
    print(f"wrote {out} (config.json, model.safetensors, README.md with the serving commands)", file=sys.stderr)


def cmd_drafters(args) -> None:
    if args.markdown:
        print(drafters_table())
        return
    for line in drafters_table().splitlines()[2:]:  # the same rows as plain text
        name, summary, options, weights = (c.strip().replace("`", "") for c in line.strip("|").split(" | "))
        print(f"{name:8s} {summary}\n         options: {options}; weights: {weights}")


def cmd_data(args) -> None:
    if args.data_command == "build":
        for name in ("n_prompts", "max_new_tokens", "batch_size", "shard_size"):
            if getattr(args, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1")
        sources = tuple(x.strip() for x in args.sources.split(",") if x.strip())
        if sources == ("mix",):
            sources = MIX if args.split == "train" else MIX_SOURCES
        if not 0.0 <= args.sampled <= 1.0:
            raise SpecdraftError(f"--sampled must be in [0, 1] (got {args.sampled})")
        seed = BuildConfig.magpie_seed if args.magpie_seed is None else args.magpie_seed
        cfg = BuildConfig(n_prompts=args.n_prompts, max_new_tokens=args.max_new_tokens, sources=sources,
                          batch_size=args.batch_size, shard_size=args.shard_size, magpie_seed=seed,
                          exclude=tuple(args.exclude), seed=BuildConfig.seed if args.seed is None else args.seed,
                          split=args.split, sampled=args.sampled,
                          feature_layers=_layers(args.features_layers) if args.features_layers else ())
        target = _engine(args).target
        target.config.check_layers(cfg.feature_layers, "--features-layers: layer")
        m = build_data(target, args.out, cfg, quiet=args.quiet)
        print(f"{m['sequences']} responses, {m['response_tokens']:,} response tokens, {len(m['shards'])} shards "
              f"in {args.out} ({m['wall_s'] / 60:.1f} min of regeneration)", file=sys.stderr)
    elif args.data_command == "datastore":
        for d in args.data:
            read_manifest(Path(d))  # a clear error before the target loads
        m = build_datastore(_engine(args).target, args.data, args.out)
        print(f"{m['tokens']:,} response tokens of {m['answers']:,} answers in {args.out}", file=sys.stderr)
    else:
        layers = _layers(args.layers)
        target = _engine(args).target
        target.config.check_layers(layers, "--layers: layer")
        out = cache_features(target, args.data, args.out, layers, batch_size=args.batch_size, quiet=args.quiet)
        print(f"features in {out}", file=sys.stderr)


def _check_data_and_init(args) -> None:
    """Clear errors, before the target loads, for a --data folder that is not a data build or a missing --init."""
    for d in args.data:
        read_manifest(Path(d))
    if getattr(args, "init", "") and not Path(args.init).is_file():
        raise SpecdraftError(f"--init {args.init}: no such checkpoint")


def cmd_train(args) -> None:
    from specdraft.train.loop import join_ranks

    if args.train_command in ("hybrid", "eagle3"):
        join_ranks(args.device)  # under torchrun / accelerate launch: join the process group (train.loop)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SpecdraftError(f"`train {args.train_command}` runs in one process; training across processes "
                             "(torchrun) is supported by `train hybrid` and `train eagle3`")
    if args.train_command == "phrase":
        for name in ("vocab_size", "epochs", "batch_size"):
            if getattr(args, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1")
        if not str(args.out).endswith(".safetensors"):
            raise SpecdraftError("--out must be a .safetensors file")
        for d in args.data:
            read_manifest(Path(d))  # a clear error for a folder that is not a data build
        feats = [Path(f) for f in args.features] if args.features else [Path(d) / "features" for d in args.data]
        if len(feats) != len(args.data):
            raise SpecdraftError(f"{len(args.data)} --data folders but {len(feats)} --features: give one per --data")
        target = _engine(args).target
        for d, f in zip(args.data, feats):
            cache_features(target, d, f, (FEATURE_LAYER,), quiet=args.quiet)  # skips shards already there
        cfg = PhraseTrainConfig(vocab_size=args.vocab_size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                          seed=args.seed)
        log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        train_phrase(target, args.data, feats, args.out, cfg, quiet=args.quiet, log=log)
    elif args.train_command == "hybrid":
        for name in ("epochs", "batch_tokens"):
            if getattr(args, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("serial", "parallel", "anchors", "draft_vocab", "draft_rows", "shards", "head_blocks", "serial_unroll", "width"):
            if getattr(args, name) < 0:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 0")
        if not str(args.out).endswith(".safetensors"):
            raise SpecdraftError("--out must be a .safetensors file")
        layers = _layers(args.layers)
        cfg = HybridTrainConfig(serial=args.serial, parallel=args.parallel, serial_layers=args.serial_layers,
                                head_blocks=args.head_blocks, feature_layers=layers, draft_vocab=args.draft_vocab, draft_rows=args.draft_rows,
                                epochs=args.epochs, anchors=args.anchors, batch_tokens=args.batch_tokens, lr=args.lr,
                                feature_loss=args.feature_loss, serial_unroll=args.serial_unroll, head_grad=args.head_grad,
                                distill=args.distill, init=args.init, width=args.width,
                                shards=args.shards, seed=args.seed)
        if args.serial + args.parallel < 1 or args.serial_layers < 1:
            raise SpecdraftError("a hybrid drafter needs --serial + --parallel >= 1 and --serial-layers >= 1")
        _check_data_and_init(args)
        target = _engine(args).target
        log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        train_hybrid(target, args.data, args.features, args.out, cfg, quiet=args.quiet, log=log)
    elif args.train_command == "eagle3":
        for name in ("epochs", "batch_tokens", "steps"):
            if getattr(args, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("anchors", "draft_vocab", "draft_rows", "shards"):
            if getattr(args, name) < 0:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 0")
        if not str(args.out).endswith(".safetensors"):
            raise SpecdraftError("--out must be a .safetensors file")
        _check_data_and_init(args)
        target = _engine(args).target
        layers = _layers(args.layers) if args.layers else default_layers(target.config.num_layers)
        cfg = HybridTrainConfig(arch="eagle3", serial=args.steps, parallel=0, feature_layers=layers,
                                draft_vocab=args.draft_vocab, draft_rows=args.draft_rows, epochs=args.epochs, anchors=args.anchors,
                                batch_tokens=args.batch_tokens, lr=args.lr, distill=args.distill, init=args.init,
                                shards=args.shards, seed=args.seed)
        log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        train_hybrid(target, args.data, args.features, args.out, cfg, quiet=args.quiet, log=log)
    elif args.train_command == "profile":
        if args.max_seqs < 1:
            raise SpecdraftError("--max-seqs must be >= 1")
        target = _engine(args).target
        prof = add_budget_profile(target, args.checkpoint, args.data, max_seqs=args.max_seqs, quiet=args.quiet)
        print(json.dumps(prof, indent=1))
    elif args.train_command == "block":
        for name in ("modes", "epochs", "batch_tokens", "draft_layers"):
            if getattr(args, name) < 1:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("steps", "anchors", "draft_vocab", "draft_rows", "shards", "width"):
            if getattr(args, name) < 0:
                raise SpecdraftError(f"--{name.replace('_', '-')} must be >= 0")
        if args.block_size < 2 or args.gamma <= 0:
            raise SpecdraftError("--block-size must be >= 2 and --gamma > 0")
        if not str(args.out).endswith(".safetensors"):
            raise SpecdraftError("--out must be a .safetensors file")
        if args.dflash and args.modes != 1:
            raise SpecdraftError(f"--dflash trains one mode (DFlash has no mode embeddings); got --modes {args.modes}")
        layers = _layers(args.layers)
        cfg = BlockTrainConfig(modes=args.modes, draft_layers=args.draft_layers, block_size=args.block_size,
                               feature_layers=layers, draft_vocab=args.draft_vocab, draft_rows=args.draft_rows, epochs=args.epochs, steps=args.steps,
                               anchors=args.anchors, batch_tokens=args.batch_tokens, lr=args.lr, gamma=args.gamma,
                               shards=args.shards, seed=args.seed, gate=not args.no_gate, qk_norm=args.dflash,
                               mask_token=args.mask_token if args.dflash else -1, width=args.width, bf16=args.bf16)
        if args.dflash and args.width:
            raise SpecdraftError("--dflash trains DFlash's shape, which is the target's width: leave --width out")
        _check_data_and_init(args)
        target = _engine(args).target
        log = (lambda *a, **k: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
        train_block(target, args.data, args.features, args.out, cfg, quiet=args.quiet, log=log)


def cmd_serve(args) -> None:
    try:
        from specdraft.server.app import serve  # the web stack, only for this command
    except ImportError as e:
        raise SpecdraftError(f"the server needs fastapi and uvicorn ({e})") from None

    if not 0 <= args.port <= 65535:
        raise SpecdraftError(f"--port must be in 0..65535 (got {args.port})")
    if args.api_key is not None and not args.api_key.strip():
        raise SpecdraftError("--api-key is empty")
    if args.temperature < 0:
        raise SpecdraftError(f"--temperature must be >= 0 (got {args.temperature})")
    engine = _engine(args, args.drafter, args.budget)
    queue = RequestQueue(engine, model_id=args.model_name, max_queue=args.max_queue,
                         default_max_tokens=args.max_tokens, default_temperature=args.temperature, budget=args.budget,
                         max_batch=args.max_batch)
    if queue.batch_note:
        print(f"warning: {queue.batch_note}", file=sys.stderr)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and args.api_key is None:
        print(f"warning: binding to {args.host}, reachable from other machines, without --api-key: there is no "
              "authentication", file=sys.stderr)
    print(f"serving {queue.model_id} ({engine.drafter.name} drafter) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    serve(queue, host=args.host, port=args.port, quiet=args.quiet, api_key=args.api_key)


def cmd_chat(args) -> None:
    if args.max_new_tokens < 1:
        raise SpecdraftError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    engine = _engine(args, args.drafter, args.budget)
    cfg = GenerateConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, budget=args.budget)
    run_chat(ChatSession(engine, cfg, system=args.system), quiet=args.quiet)


def cmd_analyze(args) -> None:
    if args.analyze_command == "acceptance":
        if not args.dataset:
            raise SpecdraftError("give at least one --dataset")
        if args.n < 1 or args.max_new_tokens < 1:
            raise SpecdraftError("--n and --max-new-tokens must be >= 1")
        target = _engine(args).target
        budgets = args.budget or [3]
        res = acceptance_sweep(target, args.drafter, args.dataset, args.n, args.max_new_tokens, budgets, args.out,
                               quiet=args.quiet)
        print("| dataset | drafter | " + " | ".join(f"budget {b}" for b in budgets) + " |")
        print("|---|---|" + "---|" * len(budgets))
        pred = res.get("predicted_speedup_vs_greedy", {})
        for ds, per in res["datasets"].items():
            for d, tpp in per.items():
                sp = pred.get(ds, {}).get(d, {})
                cells = [f"{tpp[b]:.2f}" + (f" ({sp[b]:.2f}x)" if sp.get(b) is not None else "") for b in budgets]
                print(f"| {ds} | {d} | " + " | ".join(cells) + " |")
        if pred:
            print("tokens per pass (predicted speed-up over greedy from the cost curve + measured drafting time); "
                  "best budget: " + "; ".join(f"{ds}: " + ", ".join(f"{d} {b}" for d, b in v.items())
                                              for ds, v in res["best_budget"].items()))
        for ds, per_budget in res.get("paired", {}).items():
            for b, comps in per_budget.items():
                for c in comps:
                    print(f"{ds}, budget {b}: {format_comparison(c)}")
        print(f"wrote {Path(args.out) / 'acceptance.json'}", file=sys.stderr)
    elif args.analyze_command == "coverage":
        if not args.dataset or not args.data:
            raise SpecdraftError("give at least one --data folder and one --dataset")
        if args.n < 1 or args.max_new_tokens < 1:
            raise SpecdraftError("--n and --max-new-tokens must be >= 1")
        target = _engine(args).target
        res = coverage_report(target, args.data, args.drafter, args.dataset, args.n, args.max_new_tokens, args.out,
                              quiet=args.quiet)
        names = list(dict.fromkeys(args.drafter))
        print("| dataset | output tokens | distinct | unseen in training | " + " | ".join(f"outside {d}'s vocabulary" for d in names) + " |")
        print("|---|---|---|---|" + "---|" * len(names))
        for ds, r in res["datasets"].items():
            cells = ["all scored" if r["outside_draft_vocab"][d] is None else f"{r['outside_draft_vocab'][d]:.1%}" for d in names]
            print(f"| {ds} | {r['tokens']} | {r['distinct_tokens']} | {r['unseen_in_training']:.1%} | " + " | ".join(cells) + " |")
        print(f"training responses: {res['config']['training_response_tokens']:,} tokens, "
              f"{res['config']['training_distinct_tokens']:,} distinct", file=sys.stderr)
        print(f"wrote {Path(args.out) / 'coverage.json'}", file=sys.stderr)
    elif args.analyze_command == "chimeras":
        cfg = ChimeraConfig(budget=args.budget, contexts_per_prompt=args.contexts_per_prompt, samples=args.samples,
                            top_k=args.top_k, seed=args.seed)
        if not args.dataset:
            raise SpecdraftError("give at least one --dataset")
        if args.n < 1 or args.max_new_tokens < 1:
            raise SpecdraftError("--n and --max-new-tokens must be >= 1")
        target = _engine(args).target
        res = chimera_report(target, args.drafter, args.dataset, args.n, args.max_new_tokens, cfg, args.out,
                             quiet=args.quiet)
        print(format_summary(res))
        print(f"wrote {Path(args.out) / 'chimeras.json'}", file=sys.stderr)


def _check_paths(args) -> None:
    """Output and input folders checked before any work (``specdraft.paths``): a train checkpoint is a
    file, every other ``--out`` a folder; training's ``--data`` and ``--features`` are folders."""
    out = getattr(args, "out", None)
    if out is not None:
        (writable_file if args.command == "train" else writable_folder)(out)
    if args.command == "train":
        for flag in ("data", "features"):
            value = getattr(args, flag, None)
            for d in value if isinstance(value, list) else [value]:
                if d is None:
                    continue
                if flag == "features" and args.train_command == "phrase":
                    writable_folder(d, "--features")  # phrase caches its features there itself
                else:
                    existing_folder(d, f"--{flag}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one line each on stderr: ``note: ...`` (SpecdraftNote) or ``warning: ...``."""
    kind = "note" if issubclass(category, SpecdraftNote) else "warning"
    print(f"{kind}: {str(message).removeprefix('specdraft: ')}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    shown, warnings.showwarning = warnings.showwarning, _show_warning
    try:
        return _run(argv)
    finally:
        warnings.showwarning = shown


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already printed)
        return int(e.code or 0)
    commands = {"generate": cmd_generate, "drafters": cmd_drafters, "bench": cmd_bench, "data": cmd_data, "serve": cmd_serve,
                "export-target": cmd_export_target, "export": cmd_export,
                "chat": cmd_chat, "train": cmd_train, "analyze": cmd_analyze, "prepare": cmd_prepare}
    try:
        _check_paths(args)
        commands[args.command](args)
    except SpecdraftError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed by the reader (`| head`): stop quietly, as other tools do
        try:
            sys.stdout = open(os.devnull, "w")  # nothing left to flush into the closed pipe at exit
        except OSError:
            pass
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
