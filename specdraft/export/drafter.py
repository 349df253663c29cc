"""``specdraft export DRAFTER --format eagle3|dflash --out DIR``: a trained drafter written in the format
the serving engines load (vLLM ``eagle3`` / ``dflash``, SGLang ``EAGLE3`` / ``DFLASH``, llama.cpp
``--spec-type draft-eagle3`` / ``draft-dflash``).  EAGLE-3 first; DFlash at the end of this file.

The folder holds ``config.json`` (a Llama config with ``num_hidden_layers: 1``, ``draft_vocab_size``,
``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids``), ``model.safetensors`` in EAGLE-3's
tensor names and a README with the target it was trained for and the commands that serve it.

Tensor names (EAGLE-3's reference checkpoints, as vLLM, SGLang and llama.cpp's converter read them):

    fc.weight                                   [H, 3H]
    midlayer.input_layernorm.weight             [H]    (on the token embedding)
    midlayer.hidden_norm.weight                 [H]    (on g / the previous step's state)
    midlayer.self_attn.{q,k,v}_proj.weight      [heads * D, 2H]   q/k rows in HF's rotate-half order
    midlayer.self_attn.o_proj.weight            [H, Hq * D]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight                                 [H]
    lm_head.weight                              [V', H]
    d2t                                         int64 [V']: target id = draft id + d2t[draft id]
    t2d                                         bool [V]: whether a target id is in the draft vocabulary

The token embedding is the target's (not written): every engine shares it from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from specdraft.errors import SpecdraftError
from specdraft.export.folder import check_out, new_folder
from specdraft.nn.eagle3 import Eagle3Model

FORMATS = ("eagle3", "dflash")


def hf_rope_rows(w: Tensor, head_dim: int) -> Tensor:
    """q/k output rows of each head from adjacent RoPE pairs (2i, 2i+1), specdraft's layout, back to
    HF's half-split layout (pairs j, j+D/2): the inverse of ``model.llama.interleave_rope_rows``."""
    h = w.shape[0] // head_dim
    return w.reshape(h, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def eagle3_tensors(model: Eagle3Model) -> dict[str, Tensor]:
    """The network's weights under EAGLE-3's names and layout (module docstring), in their stored dtype."""
    c = model.cfg
    layer = model.layers[0]
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = layer.wqkv.weight.detach().split([q_rows, kv_rows, kv_rows])
    gate, up = layer.w_gate_up.weight.detach().chunk(2)
    ids = model.vocab_ids.long().cpu()
    head = model.head_w.detach().cpu()
    if len(ids) == c.vocab_size:  # the full vocabulary, stored ranked: written in id order (d2t all 0), since an engine
        order = torch.argsort(ids)  # may skip the map when the draft vocabulary is the target's
        ids, head = ids[order], head[order]
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out = {
        "fc.weight": model.fc.weight,
        "midlayer.input_layernorm.weight": layer.attn_norm.weight,
        "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
        "midlayer.self_attn.q_proj.weight": hf_rope_rows(q, c.head_dim),
        "midlayer.self_attn.k_proj.weight": hf_rope_rows(k, c.head_dim),
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": layer.wo.weight,
        "midlayer.post_attention_layernorm.weight": layer.mlp_norm.weight,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": layer.w_down.weight,
        "norm.weight": model.norm.weight,
        "lm_head.weight": head,
    }
    out = {k: v.detach().cpu().contiguous() for k, v in out.items()}
    out["d2t"] = ids - torch.arange(len(ids))
    out["t2d"] = t2d
    return out


def eagle3_config(model: Eagle3Model, target_config, dtype: str) -> dict:
    """``config.json`` of the exported drafter: the fields vLLM, SGLang and llama.cpp's converter read."""
    c = model.cfg
    layers = list(c.feature_layers)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": target_config.max_position,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": len(model.vocab_ids),
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers},
        "norm_before_residual": False,
    }


def serving_readme(title: str, about: str, method: str, n: int, sglang: str, sglang_args: str, fmt: str) -> str:
    """The exported folder's README: what it is, then the vLLM, SGLang and llama.cpp commands."""
    return f"""# {title}

{about}

Write the target as a Hugging Face folder first (the engines below need it):

```bash
specdraft export-target --out target_hf
```

## vLLM

```bash
vllm serve target_hf --speculative-config '{{"method": "{method}", "model": "THIS_FOLDER", "num_speculative_tokens": {n}}}'
```

## SGLang

```bash
python -m sglang.launch_server --model-path target_hf --speculative-algorithm {sglang} \\
    --speculative-draft-model-path THIS_FOLDER {sglang_args}
```

## llama.cpp

```bash
python convert_hf_to_gguf.py THIS_FOLDER --target-model-dir target_hf --outfile {fmt}.gguf --outtype f32
llama-server -m TARGET.gguf -md {fmt}.gguf --spec-type draft-{fmt} --spec-draft-n-max {n}
```

(`convert_hf_to_gguf.py` is llama.cpp's own converter; `TARGET.gguf` the target's GGUF.)
"""


def _readme(name: str, manifest: dict, cfg: dict, steps: int) -> str:
    layers = ", ".join(map(str, cfg["eagle_aux_hidden_state_layer_ids"]))
    n = min(steps, 5)
    about = f"""Exported by `specdraft export {name} --format eagle3`. Trained with specdraft for the target
`{manifest.get('target_name', '?')}` (weights sha256 `{manifest.get('target_hash', '?')}`); it reads the
inputs of target layers {layers} and drafts from its own {cfg['draft_vocab_size']}-token vocabulary
(`d2t`: target id = draft id + d2t[draft id]). Weights: {cfg['torch_dtype']}, EAGLE-3's tensor names;
the token embedding is the target's. Trained for {steps} draft steps."""
    sglang_args = f"--speculative-num-steps {n} \\\n    --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
    return serving_readme(f"EAGLE-3 drafter `{name}` for {manifest.get('target_name', '?')}", about, "eagle3", n,
                          "EAGLE3", sglang_args, "eagle3")


def export_drafter(target, spec: str, fmt: str, out: str | Path, force: bool = False) -> Path:
    """Write drafter ``spec`` (a registered name such as ``eagle3`` or a checkpoint path) for ``target``
    in format ``fmt`` at ``out``; a drafter that the format cannot hold faithfully is refused."""
    from specdraft.drafters.registry import BY_KIND, REGISTRY, weights_path
    from specdraft.nn.checkpoint import checkpoint_kind, load_draft_model

    if fmt not in FORMATS:
        raise SpecdraftError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    if spec in REGISTRY:
        if not REGISTRY[spec].kind:
            raise SpecdraftError(f"the {spec} drafter has no trained network to export")
        path, name = weights_path(spec, target), spec
        if not path.is_file():
            raise SpecdraftError(f"the {spec} drafter's weights ({path}) are not in this install")
    else:
        path, name = Path(spec), Path(spec).stem
        if not path.is_file():
            raise SpecdraftError(f"drafter {spec!r} is neither a registered drafter nor a checkpoint file")
    kind = checkpoint_kind(path)
    if kind not in BY_KIND:
        raise SpecdraftError(f"{path} holds a drafter of unknown kind {kind!r}")
    if fmt == "dflash" and kind != "block":
        raise SpecdraftError(f"{name} is a {kind} drafter, which the DFlash format cannot hold (DFlash drafts a "
                             "block of masks in one pass); train one with `specdraft train block --dflash "
                             "--draft-vocab 0` and export that")
    if fmt == "eagle3" and kind != "eagle3":
        raise SpecdraftError(f"{name} is a {kind} drafter, which the EAGLE-3 format cannot hold (EAGLE-3 is fc over "
                             "3 target layers, one decoder layer and its own LM head); train one with "
                             "`specdraft train eagle3` and export that")
    ckpt = load_draft_model(target, path, kind)
    model = ckpt.model
    if fmt == "dflash":
        check_dflash(model, name, target.config.num_layers)
    out = check_out(out, force)
    stored = _stored_dtype(path)  # the values exactly as trained and saved (fp16 for shipped weights)
    dtype = str(stored).removeprefix("torch.")
    if fmt == "dflash":
        tensors, cfg = dflash_tensors(model), dflash_config(model, target.config, dtype)
        readme = _dflash_readme(name, ckpt.manifest, cfg)
    else:
        tensors, cfg = eagle3_tensors(model), eagle3_config(model, target.config, dtype)
        readme = _readme(name, ckpt.manifest, cfg, model.cfg.steps)
    tensors = {k: v.to(stored) if v.is_floating_point() else v for k, v in tensors.items()}
    with new_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "README.md").write_text(readme)
        (tmp / "specdraft_manifest.json").write_text(json.dumps(ckpt.manifest, indent=1) + "\n")
    return out


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the checkpoint stores its weights in."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        name = next(k for k in f.keys() if k.endswith("weight"))
        return f.get_tensor(name).dtype


# ---------------------------------------------------------------------------- DFlash
# A block drafter trained in DFlash's shape (``train block --dflash --draft-vocab 0``) is a DFlash
# drafter (``config.json``: ``DFlashDraftModel``, Qwen3-shaped layers, ``dflash_config``):
#
#     fc.weight                                     [H, n H]   over the target layers' states
#     hidden_norm.weight                            [H]        RMSNorm after fc (the context c)
#     layers.{i}.input_layernorm.weight             [H]
#     layers.{i}.self_attn.{q,k,v,o}_proj.weight    q/k rows in HF's rotate-half order
#     layers.{i}.self_attn.{q,k}_norm.weight        [D]        permuted like the rows
#     layers.{i}.post_attention_layernorm.weight    [H]
#     layers.{i}.mlp.{gate,up,down}_proj.weight
#     norm.weight                                   [H]
#
# The token embedding (the mask row included: ``dflash_config.mask_token_id``) and the LM head are
# the target's, shared by the engines.  ``target_layer_ids`` are HF's: id i reads hidden_states[i+1],
# the output of layer i, which is specdraft's feature layer i+1.


def dflash_tensors(model) -> dict[str, Tensor]:
    """A DFlash-shaped ``BlockModel``'s weights under DFlash's names and layout (comment above)."""
    c = model.cfg
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"fc.weight": model.fuse.weight, "hidden_norm.weight": model.ctx_norm.weight, "norm.weight": model.norm.weight}
    for i, layer in enumerate(model.layers):
        q, k, v = layer.wqkv.weight.detach().split([q_rows, kv_rows, kv_rows])
        gate, up = layer.w_gate_up.weight.detach().chunk(2)
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": layer.attn_norm.weight,
            p + "self_attn.q_proj.weight": hf_rope_rows(q, c.head_dim),
            p + "self_attn.k_proj.weight": hf_rope_rows(k, c.head_dim),
            p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.wo.weight,
            p + "self_attn.q_norm.weight": hf_rope_rows(layer.q_norm.weight.detach(), c.head_dim),
            p + "self_attn.k_norm.weight": hf_rope_rows(layer.k_norm.weight.detach(), c.head_dim),
            p + "post_attention_layernorm.weight": layer.mlp_norm.weight,
            p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.w_down.weight,
        })
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def dflash_config(model, target_config, dtype: str) -> dict:
    """``config.json`` of the exported DFlash drafter: the fields vLLM, SGLang and llama.cpp's converter read."""
    c = model.cfg
    dcfg = {"mask_token_id": c.mask_token, "target_layer_ids": [k - 1 for k in c.feature_layers],
            "block_size": c.block_size}
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": c.layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": target_config.max_position,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "block_size": c.block_size,
        "num_target_layers": target_config.num_layers,
        "dflash_config": dcfg,
    }


def check_dflash(model, name: str, num_layers: int) -> None:
    """Refuse a block drafter that DFlash's format cannot hold, saying what differs."""
    c = model.cfg
    why = []
    if c.modes != 1:
        why.append(f"{c.modes} modes (DFlash drafts one block; an engine without a mixture tree cannot run MFD)")
    if not c.qk_norm:
        why.append("no q/k norm (DFlash's layers are Qwen3's)")
    if c.mask_token < 0:
        why.append("a learned mask and mode embedding (DFlash's mask is the target's embedding of mask_token_id)")
    if len(model.vocab_ids) != c.vocab_size:
        why.append(f"a {len(model.vocab_ids)}-token draft vocabulary (llama.cpp's DFlash reads the full LM head; "
                   "train with --draft-vocab 0)")
    bad = [k for k in c.feature_layers if not 0 <= k < num_layers]
    if bad:
        why.append(f"feature layer {bad[0]} (DFlash reads the outputs of layers 0..L-2 or the embeddings: 0..{num_layers - 1})")
    if why:
        raise SpecdraftError(f"{name} cannot be exported as DFlash: it has " + "; ".join(why) +
                             ". Train one with `specdraft train block --dflash --draft-vocab 0`")


def _dflash_readme(name: str, manifest: dict, cfg: dict) -> str:
    d = cfg["dflash_config"]
    layers = ", ".join(map(str, d["target_layer_ids"]))
    about = f"""Exported by `specdraft export {name} --format dflash`. Trained with specdraft for the target
`{manifest.get('target_name', '?')}` (weights sha256 `{manifest.get('target_hash', '?')}`); it reads the
outputs of target layers {layers} (HF's `target_layer_ids`), drafts a block of {d['block_size']} rows
(the last token, then {d['block_size'] - 1} masks, `mask_token_id` {d['mask_token_id']}) and scores them with the
target's own embedding and LM head. Weights: {cfg['torch_dtype']}, {cfg['num_hidden_layers']} Qwen3-shaped layer(s)."""
    return serving_readme(f"DFlash drafter `{name}` for {manifest.get('target_name', '?')}", about, "dflash",
                          d["block_size"] - 1, "DFLASH", f"--speculative-num-draft-tokens {d['block_size']}", "dflash")
