"""Hugging Face transformers reference: the same weights in ``*ForCausalLM``, run with ``generate()``."""

from __future__ import annotations

import time

import torch


def build_hf_model(weights, device: str = "cpu"):
    """An HF model holding exactly the weights our target loaded (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig  # heavy: only for the HF reference

    cfg = AutoConfig.for_model(**weights.config.to_hf())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = weights.state_dict
    if weights.config.arch == "gemma3":  # held as Gemma's 1 + w (as a GGUF stores it); HF adds the 1 itself
        sd = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}
    missing, _ = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (weights.config.tie_embeddings and k == "lm_head.weight")]
    if missing:
        raise RuntimeError(f"HF reference model: weights missing {missing[:3]}")
    if weights.config.tie_embeddings:
        model.tie_weights()
    model = model.to(device).eval()
    model.generation_config = GenerationConfig()
    return model


@torch.inference_mode()
def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int], lookup: int = 0):
    """Greedy ``generate()`` (with prompt lookup when ``lookup`` > 0); returns (new ids without EOS, wall s)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    eos = sorted(eos_ids)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                  attention_mask=torch.ones_like(ids))
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    t = time.perf_counter()
    out = model.generate(ids, **kwargs)
    wall = time.perf_counter() - t
    new = out[0, len(prompt_ids):].tolist()
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[:i], wall
    return new, wall
