"""`specdraft export DRAFTER --format eagle3`: the exported folder read back by a small independent
reader, written from EAGLE-3's published config fields and tensor names (HF's rotate-half RoPE, d2t
offsets), drafts the same tokens with the same log-probabilities as specdraft's drafter; bad exports
are refused with one clear error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.cli import main
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.export import export_drafter
from specdraft.train import hybrid as H

PROMPT = "What is 17 * 23? Think step by step."


class Eagle3Reader:
    """An EAGLE-3 drafter from an exported folder, with its own K/V cache; drafts a greedy chain."""

    def __init__(self, folder: Path, embed: torch.Tensor) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        self.w = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(folder / "model.safetensors")).items()}
        assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        self.layer_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert self.layer_ids == cfg["eagle_aux_hidden_state_layer_ids"]
        self.hq, self.hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.hq
        self.eps, self.theta, self.vocab = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["vocab_size"]
        assert self.w["lm_head.weight"].shape[0] == cfg["draft_vocab_size"] == self.w["d2t"].shape[0]
        assert self.w["fc.weight"].shape[1] == 3 * cfg["target_hidden_size"]
        self.embed = embed.float()
        self.keys: list[torch.Tensor] = []  # per cached position: [Hkv, D] (RoPE applied)
        self.values: list[torch.Tensor] = []

    def rms(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def rope(self, x, pos):  # x [heads, D], HF rotate-half
        half = self.d // 2
        ang = pos / self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        cos, sin = torch.cat([ang.cos()] * 2).float(), torch.cat([ang.sin()] * 2).float()
        return x * cos + torch.cat([-x[:, half:], x[:, :half]], -1) * sin

    def step(self, token: int, g: torch.Tensor, pos: int) -> torch.Tensor:
        """One position: input (token, g), attends to every cached position and itself; returns h."""
        m = "midlayer."
        u = torch.cat([self.rms(self.embed[token], m + "input_layernorm.weight"), self.rms(g, m + "hidden_norm.weight")])
        q = (self.w[m + "self_attn.q_proj.weight"] @ u).view(self.hq, self.d)
        k = (self.w[m + "self_attn.k_proj.weight"] @ u).view(self.hkv, self.d)
        v = (self.w[m + "self_attn.v_proj.weight"] @ u).view(self.hkv, self.d)
        self.keys.append(self.rope(k, pos))
        self.values.append(v)
        keys, values = torch.stack(self.keys, 1), torch.stack(self.values, 1)  # [Hkv, T, D]
        rep = self.hq // self.hkv
        att = torch.softmax((self.rope(q, pos)[:, None] @ keys.repeat_interleave(rep, 0).transpose(1, 2))
                            / math.sqrt(self.d), -1) @ values.repeat_interleave(rep, 0)  # [Hq, 1, D]
        r = g + self.w[m + "self_attn.o_proj.weight"] @ att.flatten()
        x = self.rms(r, m + "post_attention_layernorm.weight")
        return r + self.w[m + "mlp.down_proj.weight"] @ (F.silu(self.w[m + "mlp.gate_proj.weight"] @ x)
                                                         * (self.w[m + "mlp.up_proj.weight"] @ x))

    def target_logprobs(self, h: torch.Tensor) -> torch.Tensor:
        """log p over the *target* vocabulary: draft logits placed at draft id + d2t[draft id], -inf elsewhere."""
        draft = self.w["lm_head.weight"] @ self.rms(h, "norm.weight")
        full = torch.full((self.vocab,), -math.inf)
        full[torch.arange(len(draft)) + self.w["d2t"]] = draft
        return torch.log_softmax(full, -1)

    def chain(self, prompt: list[int], first: int, hidden: dict, n: int) -> list[tuple[int, float]]:
        """Greedy chain of ``n`` drafts after prompt + first token, from the target's prefill features."""
        f = torch.cat([hidden[k][0].float() for k in self.layer_ids], -1)  # [P, 3H]
        nxt = prompt[1:] + [first]
        for i in range(len(prompt)):  # position i reads (x_{i+1}, fc(f_i))
            h = self.step(nxt[i], self.w["fc.weight"] @ f[i], i)
        out = []
        for s in range(n):
            lp = self.target_logprobs(h)
            tok = int(lp.argmax())
            out.append((tok, float(lp[tok])))
            h = self.step(tok, h, len(prompt) + s)
        return out


@pytest.fixture(scope="module")
def tiny_eagle3(tiny_chat_target, tiny_train_data, tmp_path_factory):
    path = tmp_path_factory.mktemp("e3") / "e3.safetensors"
    cfg = H.HybridTrainConfig(arch="eagle3", serial=4, parallel=0, feature_layers=(0, 1, 2), draft_vocab=256,
                              epochs=2, anchors=0, batch_tokens=256, lr=3e-3, warmup_steps=2, holdout=0.2)
    H.train_hybrid(tiny_chat_target, tiny_train_data / "data", tiny_train_data / "feat", path, cfg, quiet=True,
                   log=lambda *a: None)
    return path


def test_export_reads_back_to_the_same_drafts(tiny_chat_target, tiny_eagle3, tmp_path):
    t = tiny_chat_target
    out = export_drafter(t, str(tiny_eagle3), "eagle3", tmp_path / "e3_hf")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", "specdraft_manifest.json"}
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.float16 and tensors["d2t"].dtype == torch.int64
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 256
    assert "llama-server" in (out / "README.md").read_text() and "vllm serve" in (out / "README.md").read_text()
    reader = Eagle3Reader(out, t.model.embed.weight)
    for prompt in (PROMPT, "Tell me about the United States of America."):
        ids = t.encode_prompt(prompt)
        pre = t.prefill(ids, max_slots=len(ids) + 8, hidden_layers=tuple(reader.layer_ids))
        first = int(pre.logits[0, -1].argmax())
        d = make_drafter(f"{tiny_eagle3}@topk=1,beams=1,bf16=0,int8=0", t, budget=4)
        d.reset(ids, first, pre)
        ours = [(lv.tokens[0], lv.logps[0]) for lv in d.levels(4)]
        theirs = Eagle3Reader(out, t.model.embed.weight).chain(ids, first, pre.hidden, 4)
        assert [tok for tok, _ in ours] == [tok for tok, _ in theirs], prompt
        for (_, a), (_, b) in zip(ours, theirs):
            assert abs(a - b) < 1e-3, (prompt, a, b)


def test_bad_exports_are_refused(tiny_chat_target, tiny_eagle3, tmp_path, default_target):
    t = tiny_chat_target
    with pytest.raises(SpecdraftError, match="EAGLE-3 format cannot hold"):
        export_drafter(default_target, "gumiho", "eagle3", tmp_path / "g")
    with pytest.raises(SpecdraftError, match="no trained network"):
        export_drafter(t, "ngram", "eagle3", tmp_path / "n")
    with pytest.raises(SpecdraftError, match="neither a registered drafter nor a checkpoint"):
        export_drafter(t, "nothing_here", "eagle3", tmp_path / "x")
    with pytest.raises(SpecdraftError, match="unknown export format"):
        export_drafter(t, str(tiny_eagle3), "medusa", tmp_path / "x")
    with pytest.raises(SpecdraftError, match="DFlash"):
        export_drafter(t, str(tiny_eagle3), "dflash", tmp_path / "x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(SpecdraftError, match="not an empty folder"):
        export_drafter(t, str(tiny_eagle3), "eagle3", busy)
    assert (busy / "keep.txt").read_text() == "mine" and not list(tmp_path.glob("*.tmp*"))
    export_drafter(t, str(tiny_eagle3), "eagle3", busy, force=True)
    assert (busy / "config.json").is_file() and not (busy / "keep.txt").exists()
    # a checkpoint of another target is refused before anything is written
    with pytest.raises(SpecdraftError, match="trained for target"):
        export_drafter(default_target, str(tiny_eagle3), "eagle3", tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_cli_export_errors_in_one_line(capsys, tmp_path):
    assert main(["export", "gumiho", "--format", "eagle3", "--out", str(tmp_path / "g")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "EAGLE-3" in err[0]
