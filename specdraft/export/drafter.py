"""``specdraft export DRAFTER --format eagle3 --out DIR``: a trained drafter written in the format the
serving engines load (vLLM ``eagle3``, SGLang ``EAGLE3``, llama.cpp ``--spec-type draft-eagle3``).

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
        "lm_head.weight": model.head_w,
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


def _readme(name: str, manifest: dict, cfg: dict, steps: int) -> str:
    layers = ", ".join(map(str, cfg["eagle_aux_hidden_state_layer_ids"]))
    return f"""# EAGLE-3 drafter `{name}` for {manifest.get('target_name', '?')}

Exported by `specdraft export {name} --format eagle3`. Trained with specdraft for the target
`{manifest.get('target_name', '?')}` (weights sha256 `{manifest.get('target_hash', '?')}`); it reads the
inputs of target layers {layers} and drafts from its own {cfg['draft_vocab_size']}-token vocabulary
(`d2t`: target id = draft id + d2t[draft id]). Weights: {cfg['torch_dtype']}, EAGLE-3's tensor names;
the token embedding is the target's. Trained for {steps} draft steps.

Write the target as a Hugging Face folder first (the engines below need it):

```bash
specdraft export-target --out target_hf
```

## vLLM

```bash
vllm serve target_hf --speculative-config '{{"method": "eagle3", "model": "THIS_FOLDER", "num_speculative_tokens": {min(steps, 5)}}}'
```

## SGLang

```bash
python -m sglang.launch_server --model-path target_hf --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path THIS_FOLDER --speculative-num-steps {min(steps, 5)} \\
    --speculative-eagle-topk 4 --speculative-num-draft-tokens 8
```

## llama.cpp

```bash
python convert_hf_to_gguf.py THIS_FOLDER --target-model-dir target_hf --outfile eagle3.gguf --outtype f32
llama-server -m TARGET.gguf -md eagle3.gguf --spec-type draft-eagle3 --spec-draft-n-max {min(steps, 5)}
```

(`convert_hf_to_gguf.py` is llama.cpp's own converter; `TARGET.gguf` the target's GGUF.)
"""


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
        path, name = weights_path(spec), spec
        if not path.is_file():
            raise SpecdraftError(f"the {spec} drafter's weights ({path}) are not in this install")
    else:
        path, name = Path(spec), Path(spec).stem
        if not path.is_file():
            raise SpecdraftError(f"drafter {spec!r} is neither a registered drafter nor a checkpoint file")
    kind = checkpoint_kind(path)
    if kind not in BY_KIND:
        raise SpecdraftError(f"{path} holds a drafter of unknown kind {kind!r}")
    if fmt == "dflash":
        raise SpecdraftError(f"{name} ({kind}) cannot be exported as DFlash: the DFlash format is not supported by "
                             "this version (llama.cpp's DFlash drafter is Qwen3-shaped, with q/k norms)")
    if kind != "eagle3":
        raise SpecdraftError(f"{name} is a {kind} drafter, which the EAGLE-3 format cannot hold (EAGLE-3 is fc over "
                             "3 target layers, one decoder layer and its own LM head); train one with "
                             "`specdraft train eagle3` and export that")
    out = check_out(out, force)
    ckpt = load_draft_model(target, path, kind)
    model = ckpt.model
    stored = _stored_dtype(path)  # the values exactly as trained and saved (fp16 for shipped weights)
    tensors = {k: v.to(stored) if v.is_floating_point() else v for k, v in eagle3_tensors(model).items()}
    cfg = eagle3_config(model, target.config, str(stored).removeprefix("torch."))
    with new_folder(out) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "README.md").write_text(_readme(name, ckpt.manifest, cfg, model.cfg.steps))
        (tmp / "specdraft_manifest.json").write_text(json.dumps(ckpt.manifest, indent=1) + "\n")
    return out


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the checkpoint stores its weights in."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("fc.weight").dtype
