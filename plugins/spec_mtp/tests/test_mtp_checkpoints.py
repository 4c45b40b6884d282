"""Loading MTP modules: from a DeepSeek-V3 checkpoint that ships its MTP layer (tensors
``model.layers.{N}.*`` that transformers drops, read here from the safetensors file), from
a separate directory in the same layout, and clear errors for what does not fit."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from specdec_mtp import build_module
from transformers import AutoModelForCausalLM

from specdec import LLM, testing
from specdec.errors import ConfigError, ModelLoadError
from specdec.model.target import target_parts

PROMPTS = [[3, 17, 42, 9, 5, 77, 3, 17, 42, 9, 5, 77], [8, 1, 99, 23, 64, 8, 1, 99]]


def _with_mtp_layer(tmp_path, arch="deepseek_v3", declare=True, write=True, seed=0):
    """A tiny target of ``arch`` whose checkpoint holds an MTP module in DeepSeek-V3's layout
    (with the embedding and head copies the released checkpoints carry)."""
    directory = testing.tiny_model_dir(tmp_path, arch, seed=seed)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    parts = target_parts(model)
    torch.manual_seed(seed)
    module = build_module(parts, "eager")
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    n = parts.num_layers
    tensors = load_file(str(directory / "model.safetensors"))
    if write:
        tensors.update({f"model.layers.{n}.{k}": v.contiguous() for k, v in module.layout_state().items()})
        tensors[f"model.layers.{n}.embed_tokens.weight"] = parts.embed_tokens.weight.detach().clone()
        tensors[f"model.layers.{n}.shared_head.head.weight"] = parts.lm_head.weight.detach().clone()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1 if declare else 0
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_deepseek_v3_checkpoint_with_its_mtp_layer_loads_and_drafts_losslessly(tmp_path):
    model = _with_mtp_layer(tmp_path)
    spec = testing.check_greedy_lossless({"decoding_type": "mtp", "max_draft_len": 3, "use_dynamic_tree": False},
                                         model=model, prompts=PROMPTS, min_accepted=0)
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0
    llm = LLM(model=str(model), dtype="float32", speculative_config={"decoding_type": "MTP"})
    drafter = llm.drafter
    assert drafter.directory == model and drafter.module.shared_head.head is not None
    state = load_file(str(model / "model.safetensors"))
    torch.testing.assert_close(drafter.module.eh_proj.weight.cpu(), state["model.layers.2.eh_proj.weight"])
    torch.testing.assert_close(drafter.module.block.self_attn.kv_a_proj_with_mqa.weight.cpu(),
                               state["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"])


def test_deepseek_v3_mtp_layer_drafts_dynamic_trees_losslessly(tmp_path):
    """The module's MLA attention under a draft tree mask (its top-2 children per level),
    verified by the MLA target as a tree."""
    model = _with_mtp_layer(tmp_path)
    tree = {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2, "max_total_draft_tokens": 5}
    spec = testing.check_greedy_lossless({"decoding_type": "mtp", "max_draft_len": 3, **tree}, model=model,
                                         prompts=PROMPTS, min_accepted=0)
    metrics = [o.metrics for o in spec]
    steps = sum(m.drafted_at[0] for m in metrics)
    assert sum(m.num_draft_tokens for m in metrics) > 3 * steps > 0  # a chain verifies at most 3 nodes a step


def test_separate_module_directory_for_a_model_without_mtp(tmp_path):
    from specdec_mtp.checkpoint import save_module

    source = _with_mtp_layer(tmp_path, arch="llama")
    llm = LLM(model=str(source), dtype="float32", speculative_config={"decoding_type": "mtp"})
    out = tmp_path / "module"
    save_module(llm.drafter.module, out, llm.target, {"method": "mtp"})
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    assert "model.layers.2.eh_proj.weight" in load_file(str(out / "model.safetensors"))
    plain = _with_mtp_layer(tmp_path / "plain", arch="llama", declare=False, write=False)
    spec = testing.check_greedy_lossless({"decoding_type": "mtp", "speculative_model": str(out)}, model=plain,
                                         prompts=PROMPTS, min_accepted=0)
    assert sum(o.metrics.num_draft_tokens for o in spec) > 0


def test_checkpoint_declaring_mtp_without_its_tensors_is_a_clear_error(tmp_path):
    model = _with_mtp_layer(tmp_path, write=False)
    with pytest.raises(ModelLoadError, match=r"model.safetensors has no MTP module tensors \(model.layers.2.eh_proj"):
        LLM(model=str(model), dtype="float32", speculative_config={"decoding_type": "mtp"})


def test_model_without_mtp_needs_a_module(tmp_path):
    model = testing.tiny_model_dir(tmp_path, "llama")
    with pytest.raises(ModelLoadError, match="speculative_model: mtp needs an MTP module .*specdec train mtp"):
        LLM(model=str(model), dtype="float32", speculative_config={"decoding_type": "mtp"})


def _edit_tensor(key, value):
    def edit(out):
        state = load_file(str(out / "model.safetensors"))
        state[key] = value
        save_file(state, str(out / "model.safetensors"))
    return edit


def _edit_config(key, value):
    def edit(out):
        config = json.loads((out / "config.json").read_text())
        config[key] = value
        (out / "config.json").write_text(json.dumps(config))
    return edit


@pytest.mark.parametrize("edit, message", [
    (_edit_tensor("model.layers.2.eh_proj.weight", torch.zeros(32, 64)),
     r"eh_proj.weight is \(32, 64\), the target \(hidden size 64\) needs \(64, 128\)"),
    (_edit_tensor("model.layers.2.shared_head.head.weight", torch.zeros(100, 64)),
     "shared_head.head.weight covers 100 tokens, the target's vocabulary has 128"),
    (_edit_config("num_hidden_layers", 30),
     "num_hidden_layers 30 puts the module at model.layers.30, but the target has 2 layers"),
])
def test_module_that_does_not_fit_the_target_is_named(tmp_path, edit, message):
    from specdec_mtp.checkpoint import save_module

    source = _with_mtp_layer(tmp_path, arch="llama")
    llm = LLM(model=str(source), dtype="float32", speculative_config={"decoding_type": "mtp"})
    out = tmp_path / "module"
    save_module(llm.drafter.module, out, llm.target, {"method": "mtp"})
    edit(out)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(source), dtype="float32",
            speculative_config={"decoding_type": "mtp", "speculative_model": str(out)})


@pytest.mark.parametrize("option, value, message", [
    ("relaxed_topk", 0, "speculative_config.relaxed_topk: must be between 1 and 64, got 0"),
    ("relaxed_delta", -0.1, "speculative_config.relaxed_delta: must be between 0.0 and 1.0, got -0.1"),
    ("num_nextn_predict_layers", 2, "speculative_config.num_nextn_predict_layers: got 2; specdec drafts with one"),
    ("dynamic_tree_max_topK", 0, "speculative_config.dynamic_tree_max_topK: must be between 1 and 64, got 0"),
])
def test_bad_options_name_their_path(option, value, message):
    from specdec.config_loading import config_from_dict

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config_from_dict({"speculative_config": {"decoding_type": "mtp", option: value}})


def test_tree_options_survive_a_round_trip_and_size_the_node_budget():
    config = testing.check_config_round_trip({"decoding_type": "mtp", "use_dynamic_tree": True,
                                              "dynamic_tree_max_topK": 3})
    assert config.node_budget() == 10  # mtp's dynamic tree default (EAGLE's: 16)
    default = testing.check_config_round_trip({"decoding_type": "mtp"})
    assert default.use_dynamic_tree and default.dynamic_tree_max_topK == 3 and default.chain_or_tree
    assert testing.check_config_round_trip({"decoding_type": "mtp", "use_dynamic_tree": False}).node_budget() == 3
