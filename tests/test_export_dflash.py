"""`specdraft export DRAFTER --format dflash`: a block drafter trained in DFlash's shape, exported and
read back by a small independent reader written from DFlash's published config fields and tensor
names (Qwen3 layers with q/k norm, HF's rotate-half RoPE, the context injected as keys and values,
the target's embedding of ``mask_token_id`` in the mask rows, the target's LM head), scores every
position of a block as specdraft's drafter does; what DFlash cannot hold is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.export import export_drafter
from specdraft.train import block as TB

PROMPTS = ["What is 17 * 23? Think step by step.", "Tell me about the United States of America."]


class DFlashReader:
    """A DFlash drafter from an exported folder: one block [last token, mask x (B-1)] after a context."""

    def __init__(self, folder: Path, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"]
        self.w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
        d = cfg["dflash_config"]
        self.layer_ids, self.mask, self.block = d["target_layer_ids"], d["mask_token_id"], d["block_size"]
        self.layers, self.hq, self.hkv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg["head_dim"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_theta"]
        self.embed, self.lm_head = embed.float(), lm_head.float()

    def rms(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def rope(self, x, pos):  # x [T, heads, D] at positions pos [T], HF rotate-half
        half = self.d // 2
        ang = pos[:, None].double() / self.theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) / self.d)
        cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def block_logprobs(self, hidden: dict, n: int, root: int) -> torch.Tensor:
        """log p [B-1, V] of the block after positions 0..n-1; ``hidden[i]``: HF's hidden_states[i] [1, T, H]."""
        f = torch.cat([hidden[i + 1][0, :n].float() for i in self.layer_ids], -1)  # [n, len(ids) * H]
        g = self.rms(f @ self.w["fc.weight"].T, self.w["hidden_norm.weight"])  # [n, H]
        x = torch.stack([self.embed[root]] + [self.embed[self.mask]] * (self.block - 1))  # [B, H]
        pos_c, pos_b = torch.arange(n), torch.arange(n, n + self.block)
        rep = self.hq // self.hkv
        for li in range(self.layers):
            w = {k.removeprefix(f"layers.{li}."): v for k, v in self.w.items() if k.startswith(f"layers.{li}.")}

            def kv(h):
                k = (h @ w["self_attn.k_proj.weight"].T).view(len(h), self.hkv, self.d)
                return self.rms(k, w["self_attn.k_norm.weight"]), (h @ w["self_attn.v_proj.weight"].T).view(len(h), self.hkv, self.d)

            kc, vc = kv(g)  # the context enters as keys and values only
            h = self.rms(x, w["input_layernorm.weight"])
            q = self.rms((h @ w["self_attn.q_proj.weight"].T).view(self.block, self.hq, self.d), w["self_attn.q_norm.weight"])
            kb, vb = kv(h)
            keys = torch.cat([self.rope(kc, pos_c), self.rope(kb, pos_b)])  # [n + B, Hkv, D]
            values = torch.cat([vc, vb])
            q = self.rope(q, pos_b).transpose(0, 1)  # [Hq, B, D]
            keys, values = keys.transpose(0, 1).repeat_interleave(rep, 0), values.transpose(0, 1).repeat_interleave(rep, 0)
            att = torch.softmax(q @ keys.transpose(1, 2) / math.sqrt(self.d), -1) @ values  # every row sees all
            x = x + att.transpose(0, 1).reshape(self.block, -1) @ w["self_attn.o_proj.weight"].T
            h = self.rms(x, w["post_attention_layernorm.weight"])
            x = x + (F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
        logits = self.rms(x, self.w["norm.weight"]) @ self.lm_head.T
        return torch.log_softmax(logits[1:], -1)


def _train(target, data, path, **kw):
    base = dict(modes=1, draft_layers=2, block_size=5, feature_layers=(0, 1), draft_vocab=0, epochs=1, anchors=8,
                batch_tokens=256, lr=3e-3, holdout=0.2, qk_norm=True, mask_token=3)
    TB.train_block(target, data / "data", data / "feat", path, TB.BlockTrainConfig(**{**base, **kw}), quiet=True,
                   log=lambda *a: None)
    return path


@pytest.fixture(scope="module")
def tiny_dflash(tiny_chat_target, tiny_train_data, tmp_path_factory):
    """A briefly trained DFlash-shaped drafter, its norm weights then scattered over [0.5, 1.5] (training
    leaves them within 1% of 1, which would hide a norm weight exported in the wrong order)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = _train(tiny_chat_target, tiny_train_data, tmp_path_factory.mktemp("df") / "df.safetensors")
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(0)
    for k, v in tensors.items():
        if "norm" in k:
            tensors[k] = (0.5 + torch.rand(v.shape, generator=g)).to(v.dtype)
    save_file(tensors, str(path), metadata=meta)
    return path


def test_dflash_export_reads_back_to_the_same_block(tiny_chat_target, tiny_dflash, tmp_path):
    t = tiny_chat_target
    out = export_drafter(t, str(tiny_dflash), "dflash", tmp_path / "df_hf")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md", "specdraft_manifest.json"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [-1, 0], "block_size": 5}
    assert "draft-dflash" in (out / "README.md").read_text()
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.float16 and "lm_head.weight" not in tensors
    reader = DFlashReader(out, t.model.embed.weight, t.model.lm_head.weight)
    d = make_drafter(f"{tiny_dflash}@bf16=0,int8=0", t)
    layers = tuple(sorted({i + 1 for i in reader.layer_ids}))
    checked = 0
    for prompt in PROMPTS:
        ids = t.encode_prompt(prompt)
        pre = t.prefill(ids, max_slots=len(ids) + 8, hidden_layers=layers)
        first = int(pre.logits[0, -1].argmax())
        d.reset(ids, first, pre)
        ranked = d.block_logp()[0]  # [B-1, V]: the draft vocabulary is the whole target vocabulary, ranked
        ours = torch.empty_like(ranked).index_copy_(1, d.model.vocab_ids, ranked)  # in target id order
        theirs = reader.block_logprobs(pre.hidden, len(ids), first)
        assert ours.shape == theirs.shape
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), prompt
        assert (ours - theirs).abs().max() < 1e-3, (prompt, float((ours - theirs).abs().max()))
        checked += 1
    assert checked == 2
    # the reader is not blind: q/k rows, or the q/k norm weights, left in specdraft's interleaved
    # layout change the block
    def interleaved(v):
        return v.reshape(-1, 2, reader.d // 2, *v.shape[1:]).transpose(1, 2).reshape(v.shape)

    for suffixes in (("q_proj.weight", "k_proj.weight"), ("q_norm.weight", "k_norm.weight")):
        reader.w = {k: (interleaved(v) if k.endswith(suffixes) else v).float() for k, v in tensors.items()}
        assert (ours - reader.block_logprobs(pre.hidden, len(ids), first)).abs().max() > 1e-2, suffixes


def test_what_dflash_cannot_hold_is_refused(tiny_chat_target, tiny_train_data, tiny_dflash, tmp_path):
    t = tiny_chat_target
    plain = _train(t, tiny_train_data, tmp_path / "plain.safetensors", qk_norm=False, mask_token=-1, draft_vocab=64)
    with pytest.raises(SpecdraftError, match="no q/k norm.*learned mask.*64-token draft vocabulary"):
        export_drafter(t, str(plain), "dflash", tmp_path / "p")
    small = _train(t, tiny_train_data, tmp_path / "small.safetensors", draft_vocab=64)
    with pytest.raises(SpecdraftError, match="cannot be exported as DFlash: it has a 64-token draft vocabulary"):
        export_drafter(t, str(small), "dflash", tmp_path / "s")
    with pytest.raises(SpecdraftError, match="train block --dflash"):
        export_drafter(t, str(small), "dflash", tmp_path / "s")
    with pytest.raises(SpecdraftError, match="EAGLE-3 format cannot hold"):
        export_drafter(t, str(tiny_dflash), "eagle3", tmp_path / "e")
    assert not any((tmp_path / n).exists() for n in ("p", "s", "e"))


@pytest.mark.slow
def test_shipped_dflash_exports(default_target, tmp_path):
    """The shipped ``dflash`` drafter, by name: DFlash's config for the default target (feature layers
    2, 15, 27 are HF's target layer ids 1, 14, 26) and every drafter tensor, without embedding or LM head."""
    out = export_drafter(default_target, "dflash", "dflash", tmp_path / "df")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 14, 26], "block_size": 8}
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
