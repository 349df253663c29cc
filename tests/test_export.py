"""``specdraft export-target``: the exported HF folder is the same model as the GGUF target (weights
bit for bit, config, tokenizer and chat template), loadable by transformers, and bad outputs are refused."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.cli import main
from specdraft.errors import SpecdraftError
from specdraft.export import export_target
from specdraft.model.config import ModelConfig
from specdraft.model.load import load_hf_folder

from test_model import check_against_hf


@pytest.fixture(scope="module")
def exported(tmp_path_factory, default_weights):
    out = tmp_path_factory.mktemp("export") / "smollm2"
    assert main(["export-target", "--out", str(out)]) == 0
    return out


def test_exported_folder_holds_the_same_weights_config_and_tokenizer(exported, default_weights, default_target):
    from transformers import AutoTokenizer

    w = load_hf_folder(exported)
    assert w.state_dict.keys() == {k for k in default_weights.state_dict if k != "lm_head.weight"}  # tied head
    for k, v in w.state_dict.items():
        assert torch.equal(v, default_weights.state_dict[k]), k
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert ModelConfig.from_hf(cfg) == default_weights.config
    tok = AutoTokenizer.from_pretrained(str(exported))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 23?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok(text, add_special_tokens=False).input_ids == default_target.encode_messages(msgs)


def test_transformers_loads_the_export_and_matches_the_exact_target(exported, exact_target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    check_against_hf(hf, exact_target, exact_target.encode_prompt("The capital of France is"), steps=2)


def test_bad_outputs_are_refused(exported, tmp_path):
    with pytest.raises(SpecdraftError, match="not an empty folder"):
        export_target("default", exported)
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(SpecdraftError, match="is a file, not a folder"):
        export_target("default", f)
    with pytest.raises(SpecdraftError, match="not found"):
        export_target(str(tmp_path / "missing.gguf"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_force_replaces_a_folder(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "junk.txt").write_text("x")
    export_target("default", out, force=True)
    assert not (out / "junk.txt").exists() and (out / "config.json").is_file()
