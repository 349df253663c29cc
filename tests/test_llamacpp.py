"""llama.cpp as a benchmark peer (specdraft.bench.llamacpp).

Everything but the last test runs without llama.cpp: binary checks use tiny fake executables,
and the JSON parsers run on answers recorded from the real llama-server / llama-bench (build
0.5.0-dev from the llama-cpp-python 0.3.36 sources, SmolLM2-135M-Instruct Q4_1, trimmed).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from specdraft.bench import llamacpp
from specdraft.bench.llamacpp import (
    LlamaCpp,
    LlamaServer,
    bench_command,
    completion_request,
    find_binaries,
    ngram_args,
    parse_bench,
    parse_completion,
    pass_costs,
    with_working_repack,
)
from specdraft.errors import SpecdraftError

# POST /completion {"prompt": [ids of "<|im_start|>user\nList the numbers from 1 to 20, comma
# separated.<|im_end|>\n<|im_start|>assistant\n"], "n_predict": 256, ...} to a server started with
# ngram_args(), second request (the shared n-gram pool already held the answer); generation_settings
# dropped.  The last token, 2, is <|im_end|>: the EOS is listed and counted in predicted_n.
COMPLETION_EOS_SPEC = {
    "index": 0, "content": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    "tokens": [33, 28, 216, 34, 28, 216, 35, 28, 216, 36, 28, 216, 37, 28, 216, 38, 28, 216, 39, 28, 216,
               40, 28, 216, 41, 28, 216, 33, 32, 28, 216, 33, 33, 28, 216, 33, 34, 28, 216, 33, 35, 28, 216,
               33, 36, 28, 216, 33, 37, 28, 216, 33, 38, 28, 216, 33, 39, 28, 216, 33, 40, 28, 216, 33, 41,
               28, 216, 34, 32, 2],
    "id_slot": 0, "stop": True, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 70,
    "tokens_evaluated": 23, "has_new_line": False, "truncated": False, "stop_type": "eos",
    "stopping_word": "", "tokens_cached": 92,
    "timings": {"cache_n": 0, "prompt_n": 23, "prompt_ms": 118.739, "prompt_per_token_ms": 5.162565217391305,
                "prompt_per_second": 193.70215346263655, "predicted_n": 70, "predicted_ms": 439.259,
                "predicted_per_token_ms": 6.366072463768116, "predicted_per_second": 157.08272340464282,
                "draft_n": 62, "draft_n_accepted": 62},
}

# The same server, "Say hello." with n_predict 5: stopped by the limit; no speculation happened,
# so the timings carry no draft_n / draft_n_accepted at all.
COMPLETION_LIMIT = {
    "index": 0, "content": "I'm so glad you", "tokens": [57, 5248, 588, 18948, 346], "id_slot": 0,
    "stop": True, "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "tokens_predicted": 5, "tokens_evaluated": 12,
    "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "", "tokens_cached": 16,
    "timings": {"cache_n": 0, "prompt_n": 12, "prompt_ms": 60.746, "prompt_per_token_ms": 5.062166666666667,
                "prompt_per_second": 197.54387120139597, "predicted_n": 5, "predicted_ms": 29.947,
                "predicted_per_token_ms": 7.48675, "predicted_per_second": 133.56930577353324},
}

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 1,2,4,8 -n 0 -r 3 -o json` (rows trimmed
# to the fields that matter; the real rows also list batch sizes, cache types, devices, ...).
BENCH_JSON = """[
  {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
   "n_prompt": 1, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-02T06:26:04Z",
   "avg_ns": 6691469, "stddev_ns": 57401, "avg_ts": 149.451316, "stddev_ts": 1.276575,
   "samples_ns": [ 6648862, 6756743, 6668802 ], "samples_ts": [ 150.402, 148, 149.952 ]},
  {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
   "n_prompt": 2, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-02T06:26:04Z",
   "avg_ns": 11807089, "stddev_ns": 418060, "avg_ts": 169.533772, "stddev_ts": 6.101676,
   "samples_ns": [ 12135199, 11949662, 11336407 ], "samples_ts": [ 164.81, 167.369, 176.423 ]},
  {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
   "n_prompt": 4, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-02T06:26:04Z",
   "avg_ns": 17948200, "stddev_ns": 4834837, "avg_ts": 232.632357, "stddev_ts": 54.426502,
   "samples_ns": [ 15455073, 14868808, 23520719 ], "samples_ts": [ 258.815, 269.02, 170.063 ]},
  {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
   "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama 256M Q4_1", "n_threads": 2,
   "n_prompt": 8, "n_gen": 0, "n_depth": 0, "test_time": "2026-12-02T06:26:04Z",
   "avg_ns": 26160735, "stddev_ns": 2822813, "avg_ts": 308.069943, "stddev_ts": 31.545232,
   "samples_ns": [ 25005104, 24099112, 29377990 ], "samples_ts": [ 319.935, 331.962, 272.313 ]}
]
"""


def write_exe(path: Path, body: str) -> Path:
    """A small executable shell script at ``path``."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


# answers --version like the real binaries; anything else runs ``rest``
VERSION_OK = 'if [ "$1" = "--version" ]; then echo "version: 0.5.0-dev (fake)" >&2; exit 0; fi\n'


def fake_bin_dir(tmp_path: Path, server: str = "exit 0\n", bench: str = "exit 0\n") -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    write_exe(d / "llama-server", VERSION_OK + server)
    write_exe(d / "llama-bench", VERSION_OK + bench)
    return d


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- find_binaries


def test_find_binaries_ok(tmp_path):
    d = fake_bin_dir(tmp_path)
    b = find_binaries(str(d))
    assert b == LlamaCpp(server=d / "llama-server", bench=d / "llama-bench")


def test_missing_folder(tmp_path):
    with pytest.raises(SpecdraftError) as e:
        find_binaries(tmp_path / "nowhere")
    msg = one_line(e)
    assert str(tmp_path / "nowhere") in msg and "not found" in msg and "bash scripts/build_llamacpp.sh" in msg


def test_missing_binary(tmp_path):
    d = fake_bin_dir(tmp_path)
    (d / "llama-bench").unlink()
    with pytest.raises(SpecdraftError) as e:
        find_binaries(d)
    msg = one_line(e)
    assert str(d / "llama-bench") in msg and "not found" in msg and "bash scripts/build_llamacpp.sh" in msg


def test_not_executable(tmp_path):
    d = fake_bin_dir(tmp_path)
    (d / "llama-server").chmod(0o644)
    if os.access(d / "llama-server", os.X_OK):
        pytest.skip("running as a user that may execute any file")
    with pytest.raises(SpecdraftError) as e:
        find_binaries(d)
    msg = one_line(e)
    assert str(d / "llama-server") in msg and "not executable" in msg and "bash scripts/build_llamacpp.sh" in msg


def test_version_fails(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    # the way a moved build fails: the loader cannot find the shared libraries (several lines)
    write_exe(d / "llama-server", "echo 'llama-server: error while loading shared libraries:' >&2\n"
                                  "echo 'libllama.so: cannot open shared object file' >&2\nexit 127\n")
    write_exe(d / "llama-bench", VERSION_OK)
    with pytest.raises(SpecdraftError) as e:
        find_binaries(d)
    msg = one_line(e)
    assert str(d / "llama-server") in msg and "--version failed with exit code 127" in msg
    assert "libllama.so" in msg and "bash scripts/build_llamacpp.sh" in msg


def test_version_hangs(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "VERSION_TIMEOUT_S", 0.3)
    d = fake_bin_dir(tmp_path)
    write_exe(d / "llama-bench", "exec sleep 30\n")
    with pytest.raises(SpecdraftError) as e:
        find_binaries(d)
    msg = one_line(e)
    assert str(d / "llama-bench") in msg and "did not answer" in msg and "bash scripts/build_llamacpp.sh" in msg


def test_default_bin_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDRAFT_LLAMACPP", raising=False)
    assert llamacpp.default_bin_dir() == Path.home() / ".cache" / "specdraft" / "llamacpp" / "build" / "bin"
    monkeypatch.setenv("SPECDRAFT_LLAMACPP", str(tmp_path))
    assert llamacpp.default_bin_dir() == tmp_path / "build" / "bin"


# ---------------------------------------------------------------- /completion


def test_completion_request():
    body = completion_request([1, 4093, 198], 8)
    assert body["prompt"] == [1, 4093, 198] and body["n_predict"] == 8
    assert body["temperature"] == 0 and body["top_k"] == 1  # greedy
    assert body["cache_prompt"] is False and body["return_tokens"] is True and body["stream"] is False
    assert body["stop"] == [] and body["ignore_eos"] is False  # only EOS (and n_predict) stop it
    json.dumps(body)  # plain JSON types only


def test_parse_completion_eos_and_drafts():
    r = parse_completion(COMPLETION_EOS_SPEC)
    assert r["tokens"] == COMPLETION_EOS_SPEC["tokens"][:-1]  # EOS (<|im_end|> = 2) dropped
    assert len(r["tokens"]) == 69 and r["predicted_n"] == 70  # llama.cpp counts the EOS
    assert r["prompt_ms"] == 118.739 and r["predicted_ms"] == 439.259
    assert r["wall_s"] == pytest.approx((118.739 + 439.259) / 1000)
    assert r["tok_s"] == pytest.approx(69 / r["wall_s"])
    assert (r["draft_n"], r["draft_n_accepted"]) == (62, 62)


def test_parse_completion_limit_without_drafts():
    r = parse_completion(COMPLETION_LIMIT)
    assert r["tokens"] == [57, 5248, 588, 18948, 346]  # stopped by n_predict: nothing dropped
    assert r["predicted_n"] == 5 and r["wall_s"] == pytest.approx(0.090693)
    assert r["tok_s"] == pytest.approx(5 / 0.090693)
    assert (r["draft_n"], r["draft_n_accepted"]) == (0, 0)


def test_parse_completion_without_tokens():
    js = {k: v for k, v in COMPLETION_LIMIT.items() if k != "tokens"}  # e.g. a server ignoring return_tokens
    with pytest.raises(SpecdraftError) as e:
        parse_completion(js)
    assert "lacks tokens or timings" in one_line(e)


def test_server_command_and_ngram_args():
    b = LlamaCpp(server=Path("/opt/llama/llama-server"), bench=Path("/opt/llama/llama-bench"))
    srv = LlamaServer(b, "model.gguf", threads=2, spec=ngram_args(), ctx=2048)
    cmd = srv.command(8123)
    assert cmd[:3] == ["/opt/llama/llama-server", "-m", "model.gguf"]
    for flag, value in [("--threads", "2"), ("--threads-batch", "2"), ("--port", "8123"), ("--host", "127.0.0.1"),
                        ("-c", "2048"), ("--parallel", "1"), ("--spec-type", "ngram-mod")]:
        assert cmd[cmd.index(flag) + 1] == value
    assert "--no-webui" in cmd
    assert ngram_args() == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                            "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64"]


def test_server_exits_at_start(tmp_path):
    d = fake_bin_dir(tmp_path, server="echo 'loading model' >&2\n"
                                      "echo 'error: unknown argument: --bogus' >&2\nexit 1\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    srv = LlamaServer(find_binaries(d), gguf, threads=1, spec=["--bogus"])
    with pytest.raises(SpecdraftError) as e:
        with srv:
            pass
    msg = one_line(e)
    assert "exited with code 1" in msg and "unknown argument: --bogus" in msg
    assert srv.log_path is None  # the log was removed


def test_server_never_healthy(tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "HEALTH_TIMEOUT_S", 0.5)
    d = fake_bin_dir(tmp_path, server="echo 'still loading' >&2\nexec sleep 30\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    srv = LlamaServer(find_binaries(d), gguf, threads=1)
    with pytest.raises(SpecdraftError) as e:
        srv.start()
    msg = one_line(e)
    assert "did not become healthy" in msg and "still loading" in msg
    assert srv._proc is None  # terminated


def test_server_missing_gguf(tmp_path):
    srv = LlamaServer(find_binaries(fake_bin_dir(tmp_path)), tmp_path / "none.gguf", threads=1)
    with pytest.raises(SpecdraftError) as e:
        srv.start()
    assert "none.gguf not found" in one_line(e)


# ---------------------------------------------------------------- llama-bench


def test_parse_bench():
    r = parse_bench(BENCH_JSON, [1, 2, 4, 8])
    assert r["n"] == [1, 2, 4, 8]
    assert r["ms"] == pytest.approx([1000 / 149.451316, 2000 / 169.533772, 4000 / 232.632357, 8000 / 308.069943])
    assert parse_bench(BENCH_JSON, [8, 1])["ms"] == pytest.approx([8000 / 308.069943, 1000 / 149.451316])


def test_parse_bench_missing_n():
    with pytest.raises(SpecdraftError) as e:
        parse_bench(BENCH_JSON, [1, 16])
    assert "no prompt-processing result for N = [16]" in one_line(e)
    with pytest.raises(SpecdraftError) as e:
        parse_bench("[\n", [1])  # what llama-bench prints to stdout before failing to load a model
    assert "not the expected JSON" in one_line(e)


def test_bench_command():
    b = LlamaCpp(server=Path("/b/llama-server"), bench=Path("/b/llama-bench"))
    assert bench_command(b, "m.gguf", [128, 512, 128], 4, 3) == [
        "/b/llama-bench", "-m", "m.gguf", "-t", "4", "-p", "128,512", "-n", "0", "-r", "3", "-o", "json"]


def test_pass_costs_with_fake_bench(tmp_path):
    (tmp_path / "bench.json").write_text(BENCH_JSON)
    d = fake_bin_dir(tmp_path, bench=f"cat '{tmp_path / 'bench.json'}'\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    r = pass_costs(find_binaries(d), gguf, [1, 2, 4, 8], threads=2)
    assert r["n"] == [1, 2, 4, 8] and r["source"] == "llama-bench" and r["threads"] == 2
    assert r["ms"][0] == pytest.approx(1000 / 149.451316)


def test_pass_costs_error(tmp_path):
    d = fake_bin_dir(tmp_path, bench="echo '['\necho \"llama_bench: error: failed to load model 'm.gguf'\" >&2\nexit 1\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SpecdraftError) as e:
        pass_costs(find_binaries(d), gguf, [1], threads=1)
    msg = one_line(e)
    assert "llama-bench failed with exit code 1" in msg and "failed to load model" in msg
    with pytest.raises(SpecdraftError):
        pass_costs(find_binaries(d), gguf, [], threads=1)


# ---------------------------------------------------------------- the real binaries


@pytest.mark.slow
def test_real_server_short_completion():
    """The real llama-server on the default GGUF: 8 tokens or fewer, positive tok/s, and the same
    greedy tokens with llama.cpp's n-gram speculation (which also checks its flags exist)."""
    bin_dir = llamacpp.default_bin_dir()
    if not (bin_dir / "llama-server").exists():
        pytest.skip(f"llama.cpp not built ({bin_dir / 'llama-server'} missing): run `bash scripts/build_llamacpp.sh`")
    from specdraft.model.load import default_gguf_path

    threads = 1  # a correctness check: one thread cannot be slowed by other tests' busy threads (see LlamaServer)
    gguf = default_gguf_path()
    binaries = with_working_repack(find_binaries(bin_dir), gguf, threads)  # as the benchmarks run it
    results = []
    for spec in (None, ngram_args()):
        with LlamaServer(binaries, gguf, threads=threads, spec=spec) as srv:
            ids = srv.tokenize("<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")
            r = srv.complete(ids, n_predict=8)
        assert 0 < len(r["tokens"]) <= 8 and r["predicted_n"] <= 8
        assert r["tok_s"] > 0 and r["wall_s"] > 0 and r["prompt_ms"] > 0
        results.append(r["tokens"])
    assert results[0] == results[1]


# ---------------------------------------------------------------- a peer whose repacked weights crash


def test_a_crashing_repack_is_detected_and_the_peer_runs_without_it(tmp_path, capsys):
    # llama-bench dies of SIGSEGV on a multi-token pass unless `--repack 0` is given (as llama.cpp's AMX path did)
    crash = 'case "$*" in *"--repack 0"*) exit 0;; *) kill -SEGV $$;; esac\n'
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    b = with_working_repack(find_binaries(fake_bin_dir(tmp_path, bench=crash)), gguf, 2)
    assert b.repack is False
    assert "signal 11" in capsys.readouterr().err and "--no-repack" in " ".join(LlamaServer(b, gguf, 2).command(1))
    assert bench_command(b, gguf, [1, 8], 2, 3)[-2:] == ["--repack", "0"]
    (tmp_path / "ok").mkdir()
    ok = with_working_repack(find_binaries(fake_bin_dir(tmp_path / "ok")), gguf, 2)
    assert ok.repack is True and "--repack" not in bench_command(ok, gguf, [1], 2, 3)
    assert "--no-repack" not in LlamaServer(ok, gguf, 2).command(1)
