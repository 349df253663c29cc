"""Device check: the engine on another device (``--device cuda``) with tiny random models.

Runs anywhere (``--device cpu`` too) and needs no model files: tiny random Hugging Face models
(Llama, Qwen2, Qwen3) are built and saved on the fly.  Checks, each printed as one JSON line:

1. our logits equal HF transformers' on the device (fp32; prefill and cached decoding);
2. speculative greedy equals plain greedy token for token on the device, for ``ngram`` and for
   randomly initialised hybrid (Gumiho / Medusa / EAGLE shapes) and block drafters (K = 1 with
   linear and DDTree trees, K = 3 with the MFD mixture tree), budgets 1 to 64, fp32 and bf16;
3. sampling runs on the device and repeats with the same seed;
4. each emitted token's log-probability (``GenerateConfig.logprobs``) equals a plain causal pass's;
5. the pass time of a SmolLM2-135M-shaped random model for N = 1..64 tree tokens (bf16), i.e.
   the cost curve a drafter would size its trees by on that device.

Usage: ``python scripts/device_check.py --device cuda [--out DIR]``; exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdraft.drafters.base import NoDrafter  # noqa: E402
from specdraft.drafters.block import BlockDrafter, BlockOptions  # noqa: E402
from specdraft.drafters.hybrid import HybridDrafter, HybridOptions  # noqa: E402
from specdraft.drafters.ngram import NgramDrafter  # noqa: E402
from specdraft.generate import GenerateConfig, generate  # noqa: E402
from specdraft.model.llama import FINAL, causal_mask  # noqa: E402
from specdraft.model.load import build_model, load_hf_folder  # noqa: E402
from specdraft.nn.block import BlockConfig, BlockModel  # noqa: E402
from specdraft.nn.hybrid import HybridConfig, HybridModel  # noqa: E402
from specdraft.target import Target  # noqa: E402
from specdraft.tree import Tree  # noqa: E402
from specdraft.verify import Sampling  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, eos_token_id=1, bos_token_id=0)
ARCHS = {"llama": dict(tie_word_embeddings=False), "qwen2": dict(tie_word_embeddings=True),
         "qwen3": dict(tie_word_embeddings=False, head_dim=32)}
RESULTS: list[dict] = []


def report(check: str, ok: bool, **info) -> None:
    row = {"check": check, "ok": bool(ok), **info}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def tiny_hf(arch: str, path: Path, device: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type=arch, **TINY, **ARCHS[arch]),
                                             dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.to(device)


def our_target(path: Path, device: str, dtype=torch.float32) -> Target:
    w = load_hf_folder(path)
    return Target(build_model(w, device=device, dtype=dtype), tokenizer=None, name=w.name, weight_hash=w.weight_hash)


@torch.no_grad()
def check_logits(device: str, root: Path) -> None:
    for arch in ARCHS:
        hf = tiny_hf(arch, root / arch, device)
        t = our_target(root / arch, device)
        ids = [0, 5, 17, 33, 2, 91, 40, 8]
        n = len(ids)
        cache = t.model.new_cache(1, n + 8)
        x = torch.tensor([ids], device=device)
        out = t.model(x, torch.arange(n, device=device)[None], causal_mask(n, 0, device), cache, 0)
        worst = (out.logits - hf(x).logits).abs().max().item()
        seq = list(ids)
        for _ in range(4):
            tok = int(out.logits[0, -1].argmax())
            seq.append(tok)
            pos = len(seq) - 1
            out = t.model(torch.tensor([[tok]], device=device), torch.tensor([[pos]], device=device), None, cache, pos)
            full = hf(torch.tensor([seq], device=device)).logits[0, -1]
            worst = max(worst, (out.logits[0, -1] - full).abs().max().item())
        report("logits_equal_hf", worst < 1e-4, arch=arch, device=device, max_abs_diff=worst)


def random_params(module: torch.nn.Module, std: float, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)


def drafters(t: Target) -> dict:
    tm, tc = t.model, t.config
    ids = torch.arange(tc.vocab_size, device=tm.embed.weight.device)
    made = {"ngram": lambda: NgramDrafter()}
    for name, (s, m) in {"gumiho": (2, 2), "medusa": (0, 3), "eagle": (3, 0)}.items():
        cfg = HybridConfig.for_target(tc, serial=s, parallel=m, head_blocks=1, feature_layers=(1, FINAL), draft_vocab=0)
        hm = HybridModel(cfg, tm.embed.weight, tm.lm_head.weight, ids)
        random_params(hm, 0.3, 1)
        hm = hm.to(device=ids.device, dtype=tm.embed.weight.dtype).eval()
        made[name] = lambda hm=hm: HybridDrafter(hm, HybridOptions(topk=4, beams=3))
    for name, k, tree in (("block_linear", 1, "linear"), ("block_ddtree", 1, "ddtree"), ("mfd_mixture", 3, "mixture")):
        cfg = BlockConfig.for_target(tc, layers=1, block_size=6, feature_layers=(1, FINAL), modes=k, draft_vocab=0)
        bm = BlockModel(cfg, tm.embed.weight, tm.lm_head.weight, ids)
        random_params(bm, 0.3, 2)
        bm = bm.to(device=ids.device, dtype=tm.embed.weight.dtype).eval()
        made[name] = lambda bm=bm, tree=tree: BlockDrafter(bm, BlockOptions(tree=tree, topk=4))
    return made


def check_lossless(device: str, root: Path) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        t = our_target(root / "llama", device, dtype)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (5, 12, 30)]
        # repetitive prompts give the lookup drafter matches
        prompts.append([7, 8, 9, 10, 11] * 6)
        cfg = GenerateConfig(max_new_tokens=40)
        refs = [generate(t, p, NoDrafter(), cfg).token_ids for p in prompts]
        for name, make in drafters(t).items():
            bad, tpp = [], []
            for budget in (1, 4, 16, 64):
                for p, ref in zip(prompts, refs):
                    r = generate(t, p, make(), GenerateConfig(max_new_tokens=cfg.max_new_tokens, budget=budget))
                    tpp.append(r.stats.tokens_per_pass)
                    if r.token_ids != ref:
                        bad.append(budget)
            report("speculative_equals_greedy", not bad, drafter=name, dtype=str(dtype), device=device,
                   failing_budgets=sorted(set(bad)), mean_tokens_per_pass=round(statistics.mean(tpp), 3))


def check_sampling(device: str, root: Path) -> None:
    t = our_target(root / "llama", device)
    cfg = GenerateConfig(max_new_tokens=30, sampling=Sampling(temperature=0.8, top_p=0.9), seed=3)
    p = [7, 8, 9, 10, 11] * 4
    cfg.budget = 8
    a = generate(t, p, NgramDrafter(), cfg).token_ids
    b = generate(t, p, NgramDrafter(), cfg).token_ids
    report("sampling_runs_and_repeats", a == b and len(a) > 0 and all(0 <= x < 96 for x in a), device=device,
           tokens=len(a))


def check_logprobs(device: str, root: Path) -> None:
    """``GenerateConfig.logprobs`` on the device: each token's entry equals log_softmax of one plain causal pass
    over prompt + answer (within 1e-4, fp32), with no drafter and with ngram."""
    t = our_target(root / "llama", device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (6, 19)] + [[7, 8, 9, 10, 11] * 5]
    worst, bad = 0.0, []
    for name, make in (("none", NoDrafter), ("ngram", NgramDrafter)):
        for p in prompts:
            r = generate(t, p, make(), GenerateConfig(max_new_tokens=24, logprobs=3, budget=8))
            ids = p + r.token_ids
            n = len(ids)
            with torch.inference_mode():
                out = t.model(torch.tensor([ids], device=t.device), torch.arange(n, device=t.device)[None],
                              causal_mask(n, 0, t.device), t.model.new_cache(1, n), 0, logits="all")
            ref = torch.log_softmax(out.logits[0, len(p) - 1:n - 1].float(), -1).cpu()
            for i, (e, tok) in enumerate(zip(r.logprobs, r.token_ids)):
                worst = max(worst, abs(e.logprob - float(ref[i, tok])))
                if e.token != tok or len(e.top) != 3 or [a for a, _ in e.top] != ref[i].topk(3).indices.tolist():
                    bad.append((name, i))
    report("logprobs_equal_a_plain_pass", not bad and worst < 1e-4, device=device, max_abs_diff=worst,
           mismatched=bad[:5])


@torch.no_grad()
def cost_curve(device: str, root: Path, repeats: int = 10) -> dict:
    """Pass time over N tree tokens after 256 context tokens, SmolLM2-135M shape, random bf16 weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                 tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type="llama", **shape), dtype=torch.float32)
    m.save_pretrained(root / "smol_shape", safe_serialization=True)
    del m
    t = our_target(root / "smol_shape", device, torch.bfloat16)
    ctx = 256
    prompt = torch.randint(100, 49152, (ctx,)).tolist()
    t.prefill(prompt, max_slots=ctx + 65)
    ms = []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for n in range(1, 65):
        tree = Tree(tokens=prompt[:n], parents=[-1] + list(range(n - 1)))
        t.forward_tree(tree)
        times = []
        for _ in range(repeats):
            sync()
            s = time.perf_counter()
            t.forward_tree(tree)
            sync()
            times.append(time.perf_counter() - s)
        ms.append(1000 * statistics.median(times))
    curve = {"device": device, "dtype": "bfloat16", "n": list(range(1, 65)), "ms": ms, "ratio": [x / ms[0] for x in ms],
             "name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    report("cost_curve", True, device=device, one_token_ms=round(ms[0], 3),
           ratio={n: round(curve["ratio"][n - 1], 3) for n in (2, 4, 8, 16, 32, 64)})
    return curve


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="folder for device_check.json and the cost curve")
    ap.add_argument("--skip-curve", action="store_true")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: no CUDA device", file=sys.stderr)
        return 2
    info = {"torch": torch.__version__, "device": args.device,
            "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(json.dumps(info), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        check_logits(args.device, root)
        check_lossless(args.device, root)
        check_sampling(args.device, root)
        check_logprobs(args.device, root)
        curve = None if args.skip_curve else cost_curve(args.device, root)
    ok = all(r["ok"] for r in RESULTS)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "device_check.json").write_text(json.dumps({"info": info, "results": RESULTS, "cost_curve": curve},
                                                          indent=1))
    print(json.dumps({"all_ok": ok, "checks": len(RESULTS), "failed": [r for r in RESULTS if not r["ok"]]}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
