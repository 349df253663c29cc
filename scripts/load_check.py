"""Bounded load check of ``specdraft serve`` on loopback: C concurrent clients x R requests each.

Every answer is compared with offline greedy decoding (``specdraft.generate.generate``, no
drafter) of the same prompt ids; the script reports p50/p95 latency, time to first token of the
streamed requests, total throughput and, for a server it started, the server's resident memory
before, at its peak during and 3 s after the requests (``rss_idle_mb``, ``rss_peak_mb``,
``rss_after_mb``), and exits non-zero on any error or mismatch.

    .venv/bin/python scripts/load_check.py                        # starts `specdraft serve`: default target, ngram
    .venv/bin/python scripts/load_check.py --clients 8 --requests 5 --max-tokens 128 --compare --json
    .venv/bin/python scripts/load_check.py --clients 8 --requests 5 --max-tokens 32 --json-out load.json
    .venv/bin/python scripts/load_check.py --url http://127.0.0.1:8000   # a running `specdraft serve`

``--compare`` runs the one-at-a-time server (``--max-batch 1``) and the batched one
(``--max-batch``, default: one place per client) back to back on the same requests and prints
``{"sequential": {...}, "batched": {...}}``, each with ``total_tok_s``, ``p50_s``, ``p95_s``,
``requests``, ``equal`` (answers equal to offline greedy) and ``errors``.

Half of the clients stream (``stream: true``), the others do not.  Only loopback addresses are
accepted.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from urllib.parse import urlparse

TOPICS = ["the moon", "rivers", "prime numbers", "bread", "volcanoes", "chess", "the piano", "bees", "glaciers",
          "the alphabet", "bicycles", "tea", "lighthouses", "owls", "fractions", "deserts", "maps", "clocks",
          "rainbows", "sailing", "gardens", "batteries", "comets", "bridges", "whales", "paper", "salt", "wind",
          "libraries", "coffee", "snow", "trains", "mushrooms", "magnets", "kites", "coral reefs", "honey",
          "thunder", "castles", "penguins"]
ASKS = ["Explain {} to a child in two sentences.", "Give three facts about {}.", "Write a haiku about {}.",
        "Why do people like {}?", "Describe {} in one short paragraph."]


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        sys.exit(f"error: {url} is not a loopback address; this check only sends traffic to this machine")


def run_clients(base: str, model: str, work: list[str], refs: dict, args) -> tuple[list[dict], float]:
    """C client threads x R requests each against ``base``; half of the clients stream."""
    import openai

    results: list[dict] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=args.timeout)
        stream = c % 2 == 1
        for r in range(args.requests):
            p = work[c * args.requests + r]
            msgs = [{"role": "user", "content": p}]
            rec = {"client": c, "prompt": p, "stream": stream}
            t = time.perf_counter()
            try:
                if stream:
                    parts, first, usage = [], None, None
                    for ch in api.chat.completions.create(model=model, messages=msgs, max_tokens=args.max_tokens,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}):
                        if ch.choices and ch.choices[0].delta.content:
                            first = first or time.perf_counter() - t
                            parts.append(ch.choices[0].delta.content)
                        usage = ch.usage or usage
                    text, rec["ttft_s"] = "".join(parts), first
                else:
                    resp = api.chat.completions.create(model=model, messages=msgs, max_tokens=args.max_tokens, temperature=0)
                    text, usage = resp.choices[0].message.content, resp.usage
                rec.update(latency_s=time.perf_counter() - t, ok=text == refs[p],
                           tokens=usage.completion_tokens if usage else 0,
                           tokens_per_pass=getattr(usage, "tokens_per_pass", None))
                if text != refs[p]:
                    rec["got"], rec["want"] = text, refs[p]
            except Exception as e:  # recorded, reported, and the exit code says so
                rec.update(latency_s=time.perf_counter() - t, ok=False, error=f"{type(e).__name__}: {e}")
            with lock:
                results.append(rec)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, time.perf_counter() - t0


def start_server(args, max_batch: int) -> tuple[subprocess.Popen, str]:
    """``specdraft serve`` on a free loopback port, in a process of its own (as users run it); returns once
    /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specdraft.cli", "serve", "--target", args.target, "--drafter", args.drafter,
           "--port", str(port), "--max-batch", str(max_batch), "--max-queue", str(args.clients), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                health = json.load(r)
            print(f"server --max-batch {max_batch}: {json.dumps(health['batch'])}", file=sys.stderr)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    sys.exit("error: the server did not answer /health within 300 s")


def rss_mb(pid: int) -> float | None:
    """The process's resident memory (VmRSS) in MB; None where /proc has no such process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class RssWatch:
    """The server's RSS before the clients start, its peak while they run (sampled every 50 ms), and after:
    once the last answer is in and the server has had ``settle_s`` idle (it gives memory back when idle)."""

    def __init__(self, pid: int, settle_s: float = 3.0) -> None:
        self.pid, self.settle_s, self.peak = pid, settle_s, 0.0
        self.idle = rss_mb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb(self.pid) or 0.0)

    def __enter__(self) -> "RssWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        time.sleep(self.settle_s)
        self.after = rss_mb(self.pid)

    def summary(self) -> dict:
        return {"rss_idle_mb": self.idle, "rss_peak_mb": self.peak, "rss_after_mb": self.after}


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summarize(results: list[dict], wall: float, max_batch: int | None) -> dict:
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results if r.get("ttft_s") is not None]
    tokens = sum(r.get("tokens", 0) for r in results)
    tpp = [r["tokens_per_pass"] for r in results if r.get("tokens_per_pass")]
    return {"max_batch": max_batch, "requests": len(results), "equal": sum(r["ok"] for r in results),
            "errors": sum("error" in r for r in results), "total_tok_s": tokens / wall, "p50_s": pct(lat, 0.5),
            "p95_s": pct(lat, 0.95), "max_s": max(lat), "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
            "wall_s": wall, "completion_tokens": tokens, "requests_per_s": len(results) / wall,
            "mean_tokens_per_pass": statistics.fmean(tpp) if tpp else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=5, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the started server's --max-batch (default: one place per client)")
    ap.add_argument("--compare", action="store_true",
                    help="run --max-batch 1 and the batched server back to back on the same requests")
    ap.add_argument("--url", default=None, help="a running server on loopback (default: start `specdraft serve`)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds one request may take")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary on stdout")
    ap.add_argument("--json-out", default=None, help="also write the summary and every request's record here")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.requests < 1 or args.max_tokens < 1:
        sys.exit("error: --clients, --requests and --max-tokens must be >= 1")
    if args.compare and args.url:
        sys.exit("error: --compare starts its own servers; it cannot take --url")
    max_batch = args.max_batch or args.clients
    if max_batch < 1:
        sys.exit("error: --max-batch must be >= 1")

    import openai

    from specdraft.engine import Engine
    from specdraft.generate import GenerateConfig

    offline = Engine.load(args.target)
    target = offline.target
    work = prompts(args.clients * args.requests)
    t0 = time.perf_counter()
    refs = {}
    for p in work:
        ids = target.encode_messages([{"role": "user", "content": p}])
        refs[p] = offline.generate(ids, GenerateConfig(max_new_tokens=args.max_tokens)).text
    print(f"offline greedy references: {len(refs)} prompts in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    def served(batch: int) -> tuple[dict, list[dict]]:
        proc, url = start_server(args, batch)
        try:
            model = openai.OpenAI(base_url=url + "/v1", api_key="none").models.list().data[0].id
            with RssWatch(proc.pid) as rss:
                results, wall = run_clients(url, model, work, refs, args)
        finally:
            stop_server(proc)
        print(f"--max-batch {batch}: {len(results)} requests in {wall:.1f}s", file=sys.stderr)
        return {**summarize(results, wall, batch), **rss.summary()}, results

    head = {"target": target.name, "drafter": args.drafter, "clients": args.clients,
            "requests_per_client": args.requests, "max_tokens": args.max_tokens}
    if args.compare:
        seq, seq_results = served(1)
        bat, bat_results = served(max_batch)
        bat["tok_s_vs_sequential"] = bat["total_tok_s"] / seq["total_tok_s"]
        bat["p50_vs_sequential"] = bat["p50_s"] / seq["p50_s"]
        summary = {"sequential": {**head, **seq}, "batched": {**head, **bat}}
        results = seq_results + bat_results
    elif args.url:
        check_loopback(args.url)
        base = args.url.rstrip("/")
        model = openai.OpenAI(base_url=base + "/v1", api_key="none").models.list().data[0].id
        results, wall = run_clients(base, model, work, refs, args)
        summary = {**head, **summarize(results, wall, None)}
    else:
        one, results = served(max_batch)
        summary = {**head, **one}
    print(json.dumps(summary, indent=None if args.json else 1))
    bad = [r for r in results if not r["ok"]]
    for r in bad[:5]:
        print(f"FAILED client {r['client']} {r['prompt']!r}: {r.get('error') or 'output differs from offline greedy'}",
              file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"summary": summary, "requests": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
