"""``specdraft export-target``: a target (the default GGUF, a .gguf file or an HF folder) written as a
Hugging Face folder: ``config.json``, ``model.safetensors`` (fp32, HF tensor names), the tokenizer files
with the chat template, and a README.

Other engines' tools need the target this way: llama.cpp's ``convert_hf_to_gguf.py --target-model-dir``
for a drafter's conversion, vLLM and SGLang for the target itself.  A GGUF's quantized blocks are
written dequantized (the fp32 values specdraft's exact mode computes with), and its Q/K rows in HF's
order (the GGUF permutation undone, as the loader does).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.export.folder import check_out, new_folder
from specdraft.model.load import LoadedWeights, load_tokenizer, load_weights

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def hf_config(w: LoadedWeights) -> dict:
    """``config.json`` for ``w``: its ModelConfig in HF's fields, plus the architecture and dtype."""
    cfg = w.config.to_hf()
    cfg["architectures"] = [ARCHITECTURES[w.config.arch]]
    cfg["torch_dtype"] = "float32"
    cfg["_name_or_path"] = w.name
    return cfg


def export_target(target: str, out: str | Path, force: bool = False) -> Path:
    """Write ``target`` as an HF folder at ``out`` (refused if ``out`` exists and is not empty, unless
    ``force``); written to a temporary folder first, so a failed export leaves nothing half-written."""
    out = check_out(out, force)
    w = load_weights(target)
    with new_folder(out) as tmp:
        sd = {k: v.detach().to(torch.float32).contiguous() for k, v in w.state_dict.items()}
        if w.config.tie_embeddings:
            sd.pop("lm_head.weight", None)  # tied: HF rebuilds it from the embeddings
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(w), indent=2) + "\n")
        tokenizer = load_tokenizer(w)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "README.md").write_text(
            f"# {w.name}\n\nExported by `specdraft export-target` from {target!r} (weights sha256 "
            f"{w.weight_hash}).\n\nWeights: fp32, Hugging Face tensor names"
            + (" (a GGUF's quantized blocks dequantized)" if w.quantized else "") + ". Tokenizer and chat "
            "template as the source's.\n")
    return out
