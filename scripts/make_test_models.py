"""Write random-weight Llama GGUFs of real model sizes (1B, 3B, 8B shapes) in a Q4_K_M-like mix, outside
git, to measure loading, memory and pass costs beside llama.cpp on the same files.

    .venv/bin/python scripts/make_test_models.py --shape 1b --shape 3b --out ~/.cache/specdraft/test_models

The tokenizer and chat template are the default target's (its first 32,000 tokens); weights are random
blocks (``gguf_write.random_blocks``), so the text is noise but every pass costs what a trained model's does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from specdraft.model.config import ModelConfig
from specdraft.model.gguf_write import write_random_llama
from specdraft.model.llama import rope_inv_freq
from specdraft.model.load import default_gguf_path

LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
SHAPES = {  # Llama 3.2 1B / 3B and Llama 3 8B, with a 32k vocabulary
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               tie_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8, head_dim=128,
               tie_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               tie_embeddings=False),
}


def config(shape: str) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=32000, rms_eps=1e-5, rope_theta=500000.0, max_position=8192,
                       bos_token_id=1, eos_token_ids=[2], **SHAPES[shape])


def llama3_factors(cfg: ModelConfig) -> np.ndarray:
    """llama3's rope_freqs as its converter writes them: plain inverse frequencies / scaled ones."""
    plain = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    return (plain / rope_inv_freq(cfg.head_dim, cfg.rope_theta, LLAMA3_SCALING)).numpy()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for shape in args.shape:
        cfg = config(shape)
        path = args.out / f"random-llama-{shape}.Q4_K_M-like.gguf"
        t = time.perf_counter()
        write_random_llama(path, cfg, default_gguf_path(), seed=0, name=f"random-llama-{shape}", progress=True,
                           rope_factors=llama3_factors(cfg) if shape == "8b" else None)
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, {time.perf_counter() - t:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
