"""The MTP module drafts at inference what it learnt in training: built from the target's
own decoder-layer class (a Llama layer; DeepSeek-V3's MLA attention and MoE block; Gemma 3's
layer, whose rotary embedding takes the layer's type), the
draft runner's committed rows, tree levels and siblings give the same states as
training's unrolled steps."""

import pytest
import torch
from specdec_mtp import build_module
from transformers import AutoModelForCausalLM

from specdec import testing
from specdec.model.target import ATTENTION_NAME, target_parts
from specdec.training import UNROLLED_ATTENTION


def _modules(tmp_path, arch):
    model = AutoModelForCausalLM.from_pretrained(testing.tiny_model_dir(tmp_path, arch), dtype=torch.float32)
    parts = target_parts(model)
    torch.manual_seed(0)
    trained = build_module(parts, UNROLLED_ATTENTION)
    with torch.no_grad():
        for p in trained.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    serving = build_module(parts, ATTENTION_NAME)
    serving.load_state_dict(trained.state_dict())
    return parts, trained.eval(), serving.eval()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "gemma3_text"])
def test_runner_rows_and_tree_levels_match_training_steps(tmp_path, arch):
    parts, trained, serving = _modules(tmp_path, arch)

    def train_step(tokens, feature, positions, attend):
        emb = parts.embed_tokens(tokens)[None]
        return trained(emb, feature, parts.rope(emb, positions[None]), positions[None], unrolled=attend)

    def forward(input_ids, positions, meta, feature):
        emb = parts.embed_tokens(input_ids)[None]
        return serving(emb, feature[None], parts.rope(emb, positions[None]), positions[None], specdec=meta)[0]

    testing.check_rows_match_unrolled(train_step, forward, parts.hidden_size)


def test_layout_names_follow_deepseek_v3(tmp_path):
    """The module's block is written under the names the target's own checkpoint gives its
    last layer (experts one by one), and reads back to the same tensors."""
    from safetensors import safe_open

    parts, trained, _ = _modules(tmp_path, "deepseek_v3")
    names = set(trained.layout_state())
    with safe_open(str(testing.tiny_model_dir(tmp_path, "deepseek_v3") / "model.safetensors"), "pt") as f:
        stored = {k.removeprefix("model.layers.1."): f.get_tensor(k) for k in f.keys()
                  if k.startswith("model.layers.1.")}
    last = set(stored)
    assert "mlp.experts.0.gate_proj.weight" in last
    # the checkpoint's experts, stacked as transformers stacks them when it loads the target
    as_loaded = trained.from_layout(stored)
    for key, value in parts.decoder_layers[-1].state_dict().items():
        assert torch.equal(as_loaded["block." + key], value), key
    assert names == last | {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"}
    back = trained.from_layout({**trained.layout_state(), "embed_tokens.weight": torch.zeros(1)})
    assert back.keys() == trained.state_dict().keys()
    for key, value in trained.state_dict().items():
        assert torch.equal(back[key], value), key
