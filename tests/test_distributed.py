"""Training across processes: `torchrun --nproc-per-node 2 -m specdraft.cli train eagle3 ...` (gloo on
the CPU) gives the losses and weights of the same command in one process, within float rounding."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from specdraft.nn.checkpoint import load_checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_folder_with_tokenizer(tiny_chat_folder, default_weights, tmp_path_factory):
    """The tiny chat model's HF folder plus the real tokenizer files, loadable by `--target`."""
    from specdraft.model.load import load_tokenizer

    path = tmp_path_factory.mktemp("tiny_tok")
    shutil.copytree(tiny_chat_folder, path, dirs_exist_ok=True)
    load_tokenizer(default_weights).save_pretrained(str(path))
    return path


def train(cmd_prefix: list[str], folder, data, out, env) -> subprocess.CompletedProcess:
    args = ["train", "eagle3", "--target", str(folder), "--precision", "exact", "--data", str(data / "data"),
            "--features", str(data / "feat"), "--steps", "3", "--layers", "0,1,2", "--draft-vocab", "256",
            "--epochs", "2", "--anchors", "0", "--batch-tokens", "256", "--lr", "3e-3", "--out", str(out)]
    res = subprocess.run(cmd_prefix + args, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_two_processes_train_the_same_drafter_as_one(tiny_folder_with_tokenizer, tiny_train_data, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    one = tmp_path / "one.safetensors"
    two = tmp_path / "two.safetensors"
    train([sys.executable, "-m", "specdraft.cli"], tiny_folder_with_tokenizer, tiny_train_data, one, env)
    res = train([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                 "--master-port", str(free_port()), "-m", "specdraft.cli"],
                tiny_folder_with_tokenizer, tiny_train_data, two, env)
    assert "training on 2 processes" in res.stderr
    assert not (tmp_path / "two.safetensors.resume.safetensors").exists()
    t1, m1 = load_checkpoint(one)
    t2, m2 = load_checkpoint(two)
    h1, h2 = m1["history"], m2["history"]
    assert len(h1) == len(h2) == 2
    for a, b in zip(h1, h2):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["train_top1"] == b["train_top1"]  # summed over both ranks: the same counts
        assert a["val_ce"] == pytest.approx(b["val_ce"], rel=1e-4)
    assert t1.keys() == t2.keys()
    for k in t1:
        if t1[k].is_floating_point():  # fp16 as saved: equal up to a rounding step
            assert torch.allclose(t1[k].float(), t2[k].float(), rtol=2e-3, atol=1e-4), k
        else:
            assert torch.equal(t1[k], t2[k]), k
    assert json.dumps(m1["config"]) == json.dumps(m2["config"])


def test_other_trainers_refuse_several_processes(monkeypatch, capsys, tmp_path):
    from specdraft.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "block", "--data", str(tmp_path), "--features", str(tmp_path), "--out", "x.safetensors"]) == 2
    assert "runs in one process" in capsys.readouterr().err
