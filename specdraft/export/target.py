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
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.errors import SpecdraftError
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
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise SpecdraftError(f"{out} exists and is not an empty folder (--force replaces it)")
        if not out.is_dir():
            raise SpecdraftError(f"{out} is a file, not a folder")
    w = load_weights(target)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
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
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
