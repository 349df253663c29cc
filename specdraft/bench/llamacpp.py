"""llama.cpp as a benchmark peer: its server for end-to-end generation, llama-bench for pass costs.

What is measured, and how:

* **Generation** (:class:`LlamaServer`): ``llama-server`` runs the same GGUF on the CPU with one
  slot, and each prompt is sent to ``/completion`` as token ids (no chat template, no BOS added:
  the ids are used as given), greedy (temperature 0), prompt caching off, stopping only at the
  model's end-of-generation tokens or after ``n_predict`` tokens.  The time is llama.cpp's own
  ``timings`` (``prompt_ms + predicted_ms``): prefill plus decoding inside the server, with no
  HTTP or JSON overhead, as our ``wall_s`` includes prefill.  With :func:`ngram_args` the server
  speculates with its own n-gram drafter, and ``draft_n`` / ``draft_n_accepted`` count its
  drafted and accepted tokens.
* **Pass costs** (:func:`pass_costs`): ``llama-bench`` prompt-processing tests (``pp N``, no
  generation, empty context) give the time of one forward pass over N tokens, the quantity our
  cost curves hold for tree verification (small N) and prefill (large N).

Only the standard library talks to the server (``urllib``); the binaries come from
``bash scripts/build_llamacpp.sh``.  The parsing of both JSON outputs is in pure functions
(:func:`parse_completion`, :func:`parse_bench`) so it can be tested without llama.cpp.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdraft.errors import SpecdraftError
from specdraft.model.load import default_gguf_path

BUILD_HINT = "bash scripts/build_llamacpp.sh"
SERVER_NAME = "llama-server"
BENCH_NAME = "llama-bench"
VERSION_TIMEOUT_S = 10.0  # `--version` only prints build info; a hang means a broken binary
HEALTH_TIMEOUT_S = 60.0  # model load + warm-up; a 135M model takes about a second
HEALTH_POLL_S = 0.1
STOP_TIMEOUT_S = 5.0  # grace after SIGTERM before SIGKILL
REQUEST_TIMEOUT_S = 600.0  # one /completion (hundreds of tokens on a slow CPU)
BENCH_TIMEOUT_S = 1800.0  # llama-bench over several N with repetitions
LOG_TAIL_LINES = 6  # lines of the server log quoted in a startup error

# ``llama-server --spec-default`` in this version: the ngram-mod drafter with these sizes (see ngram_args)
NGRAM_MOD_MATCH = 24
NGRAM_MOD_MIN = 48
NGRAM_MOD_MAX = 64


@dataclass(frozen=True)
class LlamaCpp:
    """Paths of the two llama.cpp binaries the benchmark uses (checked by :func:`find_binaries`)."""

    server: Path
    bench: Path
    repack: bool = True  # llama.cpp repacks weights for its CPU kernels (AMX, ...); False: --no-repack (see with_working_repack)


def default_bin_dir() -> Path:
    """Where ``scripts/build_llamacpp.sh`` puts the binaries by default (it honours
    ``SPECDRAFT_LLAMACPP`` for its output folder, and so does this)."""
    root = os.environ.get("SPECDRAFT_LLAMACPP") or Path.home() / ".cache" / "specdraft" / "llamacpp"
    return Path(root) / "build" / "bin"


def _last_line(text: str) -> str:
    """The last non-empty line of a program's output ('' if none): usually its error message."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _check_binary(path: Path) -> Path:
    """``path`` if it is an executable that answers ``--version``; else a one-line SpecdraftError."""
    if not path.is_file():
        raise SpecdraftError(f"{path} not found: build llama.cpp with `{BUILD_HINT}`")
    if not os.access(path, os.X_OK):
        raise SpecdraftError(f"{path} is not executable: rebuild llama.cpp with `{BUILD_HINT}`")
    try:
        res = subprocess.run([str(path), "--version"], stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, errors="replace", timeout=VERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SpecdraftError(f"{path} --version did not answer in {VERSION_TIMEOUT_S:.0f} s: "
                             f"rebuild llama.cpp with `{BUILD_HINT}`") from None
    except OSError as e:  # e.g. a script without an interpreter line, or a binary for another machine
        raise SpecdraftError(f"{path} --version could not run ({e.strerror or e}): "
                             f"rebuild llama.cpp with `{BUILD_HINT}`") from None
    if res.returncode != 0:
        why = _last_line(res.stderr) or _last_line(res.stdout)  # e.g. a missing shared library
        detail = f" ({why})" if why else ""
        raise SpecdraftError(f"{path} --version failed with exit code {res.returncode}{detail}: "
                             f"rebuild llama.cpp with `{BUILD_HINT}`")
    return path


def find_binaries(bin_dir: str | Path) -> LlamaCpp:
    """``llama-server`` and ``llama-bench`` in ``bin_dir``, each checked to run ``--version``.

    A missing folder or binary, a binary that is not executable, or one whose ``--version`` fails
    or hangs raises :class:`SpecdraftError` with one line naming the path and the build command.
    """
    folder = Path(bin_dir).expanduser()
    if not folder.is_dir():
        raise SpecdraftError(f"llama.cpp binaries folder {folder} not found: build it with `{BUILD_HINT}`")
    return LlamaCpp(server=_check_binary(folder / SERVER_NAME), bench=_check_binary(folder / BENCH_NAME))


def with_working_repack(binaries: LlamaCpp, gguf_path: str | Path, threads: int) -> LlamaCpp:
    """``binaries``, or the same with ``repack=False`` where llama.cpp's repacked weights crash a pass of
    more than one token on this CPU (seen: SIGSEGV in ``ggml_backend_amx_mul_mat`` on a Xeon with AMX,
    llama-cpp-python 0.3.36's llama.cpp), with one warning: the peer then runs its other kernels."""
    cmd = [str(binaries.bench), "-m", str(gguf_path), "-t", str(threads), "-p", "2", "-n", "0", "-r", "1"]
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=BENCH_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError):
        return binaries  # pass_costs / the server will say what is wrong
    if res.returncode >= 0:
        return binaries
    print(f"warning: llama.cpp crashed (signal {-res.returncode}) on a 2-token pass with its repacked weights on "
          "this CPU; it runs with --no-repack (its results say so)", file=sys.stderr)
    return dataclasses.replace(binaries, repack=False)


def target_gguf(target_spec: str | None) -> str:
    """The GGUF file llama.cpp runs for our ``--target`` ("default" or a .gguf file); anything else
    (an HF folder) is refused with one line."""
    if target_spec in ("default", "", None):
        return str(default_gguf_path())
    if not str(target_spec).endswith(".gguf"):
        raise SpecdraftError("--llama-cpp needs a GGUF target (the default or a .gguf file)")
    return str(target_spec)


def ngram_args() -> list[str]:
    """Server flags for llama.cpp's own default n-gram speculation in this version.

    They spell out what ``llama-server --spec-default`` enables (llama.cpp's "default speculative
    decoding config"): the ``ngram-mod`` drafter, which hashes every 24-token window of the
    context (prompt and output) to the token that followed it, and, when the last 24 tokens hash
    to a known window, drafts by chaining those lookups; a draft needs at least 48 tokens and
    holds at most 64 (shorter chains are dropped).  No draft model is involved, so it is the peer
    of our model-free drafters.  The flags are written out rather than ``--spec-default`` so the
    benchmark records the exact setting.

    The hash pool belongs to the server, not the request: it keeps every earlier prompt and answer
    (llama.cpp lets requests help each other), so a prompt sent twice is drafted from its own
    previous answer.  For per-prompt numbers start a fresh :class:`LlamaServer` for each prompt
    (about 0.3 s for the default model).
    """
    return ["--spec-type", "ngram-mod",
            "--spec-ngram-mod-n-match", str(NGRAM_MOD_MATCH),
            "--spec-ngram-mod-n-min", str(NGRAM_MOD_MIN),
            "--spec-ngram-mod-n-max", str(NGRAM_MOD_MAX)]


def completion_request(prompt_ids: list[int], n_predict: int) -> dict:
    """The ``/completion`` body for one greedy generation from token ids.

    ``top_k: 1`` with ``temperature: 0`` is plain argmax; ``stop: []`` and ``ignore_eos: false``
    leave the end-of-generation tokens as the only stop (besides ``n_predict``); ``cache_prompt:
    false`` makes every request prefill its whole prompt; ``return_tokens`` adds the generated ids.
    """
    return {"prompt": [int(t) for t in prompt_ids], "n_predict": int(n_predict), "temperature": 0.0,
            "top_k": 1, "stop": [], "ignore_eos": False, "cache_prompt": False, "return_tokens": True,
            "stream": False}


def parse_completion(js: dict) -> dict:
    """Our result record from a non-streaming ``/completion`` answer.

    ``tokens`` are the generated ids without the end-of-generation token: llama-server lists
    the EOS token it sampled last (``stop_type == "eos"``), and counts it in ``predicted_n``.
    ``wall_s`` is llama.cpp's prefill plus decoding time; ``tok_s`` counts the returned tokens
    (EOS excluded) per ``wall_s``, as our engine's ``tok_s`` does.  ``draft_n`` and
    ``draft_n_accepted`` are 0 when the server did not speculate (it omits them then).
    """
    try:
        tokens = [int(t) for t in js["tokens"]]
        timings = js["timings"]
        prompt_ms, predicted_ms = float(timings["prompt_ms"]), float(timings["predicted_ms"])
        predicted_n = int(timings["predicted_n"])
    except (KeyError, TypeError, ValueError) as e:
        raise SpecdraftError(f"llama-server /completion answer lacks tokens or timings ({e!r}); "
                             f"is it a llama.cpp server built with `{BUILD_HINT}`?") from None
    if js.get("stop_type") == "eos" and tokens:
        tokens = tokens[:-1]  # the EOS token itself
    wall_s = (prompt_ms + predicted_ms) / 1000.0
    return {"tokens": tokens, "wall_s": wall_s, "tok_s": len(tokens) / wall_s if wall_s > 0 else 0.0,
            "prompt_ms": prompt_ms, "predicted_ms": predicted_ms, "predicted_n": predicted_n,
            "draft_n": int(timings.get("draft_n", 0)), "draft_n_accepted": int(timings.get("draft_n_accepted", 0))}


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Talks to 127.0.0.1 directly: any http_proxy in the environment must not reroute it.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_json(url: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """GET (``body`` None) or POST JSON to ``url``; the decoded JSON answer.  HTTP errors raise
    ``urllib.error.HTTPError`` / ``URLError`` for the caller to word."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def _http_error_message(e: urllib.error.HTTPError) -> str:
    """llama-server's own error message from an error answer (``{"error": {"message": ...}}``)."""
    try:
        return str(json.loads(e.read().decode())["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return f"HTTP {e.code} {e.reason}"


class LlamaServer:
    """A private ``llama-server`` on a free localhost port, for as long as the ``with`` block lasts.

    ``spec`` adds server flags (e.g. :func:`ngram_args`).  Entering starts the server and waits
    until ``/health`` answers OK; its log goes to a temporary file (``log_path``), quoted in the
    error if it fails to start, and removed when the server stops.  Leaving the block sends
    SIGTERM, then SIGKILL if it has not exited within a few seconds.

    Give it as many threads as the machine has idle cores: llama.cpp's worker threads busy-wait
    on each other, and one of them descheduled by another busy process slows a pass by orders of
    magnitude (measured: 3 s instead of 7 ms for a one-token pass with 2 threads on 2 busy cores).
    """

    def __init__(self, binaries: LlamaCpp, gguf_path: str | Path, threads: int, spec: list[str] | None = None,
                 ctx: int = 4096) -> None:
        if threads < 1:
            raise SpecdraftError(f"llama-server threads must be >= 1 (got {threads})")
        self.binaries = binaries
        self.gguf_path = Path(gguf_path)
        self.threads = threads
        self.spec = list(spec or [])
        self.ctx = ctx
        self.port: int | None = None
        self.log_path: Path | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return f"http://127.0.0.1:{self.port}"

    def command(self, port: int) -> list[str]:
        """The server command line: one slot, one fixed context size, no web UI."""
        return [str(self.binaries.server), "-m", str(self.gguf_path),
                "--threads", str(self.threads), "--threads-batch", str(self.threads),
                "--port", str(port), "--host", "127.0.0.1", "-c", str(self.ctx),
                "--parallel", "1", "--no-webui", *([] if self.binaries.repack else ["--no-repack"]), *self.spec]

    def __enter__(self) -> LlamaServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        """Launch the server and wait for ``/health``; SpecdraftError (with its log) if it fails."""
        if not self.gguf_path.is_file():
            raise SpecdraftError(f"GGUF file {self.gguf_path} not found")
        self.port = _free_port()
        fd, name = tempfile.mkstemp(prefix="specdraft-llama-server-", suffix=".log")
        self.log_path = Path(name)
        try:
            with os.fdopen(fd, "wb") as log:  # the child keeps its own copy of the descriptor
                self._proc = subprocess.Popen(self.command(self.port), stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT)
            self._wait_healthy()
        except OSError as e:  # the binary vanished or cannot run since find_binaries checked it
            self.stop()
            raise SpecdraftError(f"{self.binaries.server} could not start ({e.strerror or e})") from None
        except BaseException:  # a startup error, or Ctrl-C while waiting: never leave a server behind
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        """Poll ``/health`` until it answers OK; raise if the process exits or time runs out."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            code = self._proc.poll()
            if code is not None:
                raise SpecdraftError(f"llama-server exited with code {code} while starting; "
                                     f"last log lines: {self.log_tail()}")
            try:
                if _http_json(self.url + "/health", timeout=2.0).get("status") == "ok":
                    return
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise SpecdraftError(f"llama-server did not become healthy within {HEALTH_TIMEOUT_S:.0f} s; "
                                     f"last log lines: {self.log_tail()}")
            time.sleep(HEALTH_POLL_S)

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last ``n`` non-empty lines of the server log, joined by `` | ``."""
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-n:]) or "(empty log)"

    def stop(self) -> None:
        """Terminate the server (SIGKILL after ``STOP_TIMEOUT_S``) and remove its log."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def _post(self, path: str, body: dict) -> dict:
        """POST to the running server; failures become one-line SpecdraftErrors."""
        if self._proc is None:
            raise SpecdraftError("llama-server is not running (use it inside a `with` block)")
        try:
            return _http_json(self.url + path, body)
        except urllib.error.HTTPError as e:
            raise SpecdraftError(f"llama-server {path} failed: {_http_error_message(e)}") from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise SpecdraftError(f"llama-server {path} failed ({e}); last log lines: {self.log_tail()}") from None

    def complete(self, prompt_ids: list[int], n_predict: int) -> dict:
        """Greedy generation of up to ``n_predict`` tokens after ``prompt_ids``; see
        :func:`parse_completion` for the record returned."""
        if n_predict < 1:
            raise SpecdraftError(f"n_predict must be >= 1 (got {n_predict})")
        return parse_completion(self._post("/completion", completion_request(prompt_ids, n_predict)))

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids for ``text`` (special tokens such as ``<|im_start|>`` parsed)."""
        return [int(t) for t in self._post("/tokenize", {"content": text, "parse_special": True})["tokens"]]


def parse_bench(js_text: str, ns: list[int]) -> dict:
    """Pass times from ``llama-bench -o json`` output: ``{"n": ns, "ms": [...]}``.

    Each prompt-processing test (``n_gen == 0``) reports ``avg_ts``, its mean tokens per second
    over the repetitions; one pass over N tokens takes ``1000 * N / avg_ts`` ms.
    """
    try:
        rows = json.loads(js_text)
        tps = {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows
               if int(r.get("n_gen", 0)) == 0 and int(r.get("n_depth", 0)) == 0}
    except (ValueError, KeyError, TypeError) as e:
        raise SpecdraftError(f"llama-bench output is not the expected JSON ({e!r})") from None
    missing = [n for n in ns if n not in tps or tps[n] <= 0]
    if missing:
        raise SpecdraftError(f"llama-bench output has no prompt-processing result for N = {missing}")
    return {"n": list(ns), "ms": [1000.0 * n / tps[n] for n in ns]}


def bench_command(binaries: LlamaCpp, gguf_path: str | Path, ns: list[int], threads: int,
                  repetitions: int) -> list[str]:
    """The ``llama-bench`` command line: prompt-processing tests ``pp N`` only, JSON on stdout."""
    return [str(binaries.bench), "-m", str(gguf_path), "-t", str(threads),
            "-p", ",".join(str(n) for n in dict.fromkeys(ns)), "-n", "0",
            "-r", str(repetitions), "-o", "json", *([] if binaries.repack else ["--repack", "0"])]


def pass_costs(binaries: LlamaCpp, gguf_path: str | Path, ns: list[int], threads: int,
               repetitions: int = 3) -> dict:
    """Time of one llama.cpp forward pass over N tokens, for each N in ``ns``, by ``llama-bench``.

    Returns ``{"n": ns, "ms": [...], "source": "llama-bench", "threads": threads}``.  Small N
    are the cost of verifying N tokens at once; large N (e.g. 128, 512) are prefill times.
    """
    if not ns or any(int(n) < 1 for n in ns):
        raise SpecdraftError(f"pass_costs needs token counts >= 1 (got {ns})")
    if threads < 1 or repetitions < 1:
        raise SpecdraftError(f"pass_costs needs threads and repetitions >= 1 (got {threads}, {repetitions})")
    if not Path(gguf_path).is_file():
        raise SpecdraftError(f"GGUF file {gguf_path} not found")
    ns = [int(n) for n in ns]
    cmd = bench_command(binaries, gguf_path, ns, threads, repetitions)
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                             timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SpecdraftError(f"llama-bench did not finish within {BENCH_TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise SpecdraftError(f"{binaries.bench} could not run ({e.strerror or e})") from None
    if res.returncode != 0:
        why = _last_line(res.stderr) or _last_line(res.stdout) or "no message"
        raise SpecdraftError(f"llama-bench failed with exit code {res.returncode}: {why}")
    return {**parse_bench(res.stdout, ns), "source": "llama-bench", "threads": threads, "repack": binaries.repack}
