"""Published EAGLE layouts load unchanged and draft losslessly on a tiny Llama target; heads
that do not fit the target, and bad options, are clear errors.

The checkpoints are written here key by key in the layouts of SafeAILab's EAGLE-1 release
and of EAGLE-3 (its authors' and SpecForge's ``LlamaForCausalLMEagle3``), not with the
plugin's own writer, so a drift in the loader's names fails these tests. Random heads do not
predict the random target, so acceptance is checked with the trained heads (test_eagle.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec import LLM, testing
from specdec.errors import ConfigError, ModelLoadError

H, HEADS, KV, HD, INTER, VOCAB = 64, 4, 2, 16, 128, 128


def _config(**extra):
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512, "rope_theta": 10000.0, **extra}


def _rand(g, *shape):
    return torch.randn(*shape, generator=g) * 0.1


def _layer(prefix, g, attn_in):
    return {f"{prefix}.self_attn.q_proj.weight": _rand(g, HEADS * HD, attn_in),
            f"{prefix}.self_attn.k_proj.weight": _rand(g, KV * HD, attn_in),
            f"{prefix}.self_attn.v_proj.weight": _rand(g, KV * HD, attn_in),
            f"{prefix}.self_attn.o_proj.weight": _rand(g, H, HEADS * HD),
            f"{prefix}.mlp.gate_proj.weight": _rand(g, INTER, H), f"{prefix}.mlp.up_proj.weight": _rand(g, INTER, H),
            f"{prefix}.mlp.down_proj.weight": _rand(g, H, INTER),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(H)}


def eagle1_checkpoint(directory, hidden=H, embed=False):
    """SafeAILab EAGLE-1: pytorch_model.bin with fc (bias) and layers.0 without input_layernorm."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    state = {"fc.weight": _rand(g, hidden, 2 * hidden), "fc.bias": _rand(g, hidden), **_layer("layers.0", g, hidden)}
    if embed:
        state["embed_tokens.weight"] = _rand(g, VOCAB, hidden)
    torch.save(state, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(_config(architectures=["LlamaForCausalLM"],
                                                              hidden_size=hidden)))
    return directory


def eagle3_checkpoint(directory, draft_vocab=32, d2t=True, layers=(0, 1, 1)):
    """EAGLE-3 / SpecForge: model.safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d."""
    directory.mkdir(parents=True)
    g = torch.Generator().manual_seed(1)
    state = {"fc.weight": _rand(g, H, 3 * H), **_layer("midlayer", g, 2 * H),
             "midlayer.input_layernorm.weight": torch.ones(H), "midlayer.hidden_norm.weight": torch.ones(H),
             "norm.weight": torch.ones(H), "lm_head.weight": _rand(g, draft_vocab, H)}
    if d2t:
        ids = torch.arange(0, VOCAB, VOCAB // draft_vocab)[:draft_vocab]
        state["d2t"] = ids - torch.arange(draft_vocab)
        state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
        state["t2d"][ids] = True
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(_config(
        architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(layers)})))
    return directory


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return testing.tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", vocab_size=VOCAB)


PROMPTS = [[5, 17, 33, 2, 90, 41] * 2, [7, 7, 8, 9, 100], list(range(30, 52))]


def test_conformance():
    for name in ("eagle", "eagle3"):
        testing.check_registration(name, distribution="specdec-plugin-eagle")
    testing.check_config_round_trip({"decoding_type": "eagle3", "max_draft_len": 3, "eagle_choices": [[0, 0], [1]],
                                     "eagle3_layers_to_capture": [0, 1, 1], "draft_kv_cache_blocks": 32})
    testing.check_config_round_trip({"decoding_type": "eagle", "use_dynamic_tree": True, "dynamic_tree_max_topK": 3,
                                     "max_total_draft_tokens": 10})


@pytest.mark.parametrize("embed", [False, True])
def test_published_eagle1_head_loads_and_drafts_losslessly(target, tmp_path, embed):
    head = eagle1_checkpoint(tmp_path / "e1", embed=embed)
    for mode in ({}, {"eagle_choices": [[0, 0], [0, 1], [1]]}, {"use_dynamic_tree": True, "dynamic_tree_max_topK": 2}):
        outs = testing.check_greedy_lossless({"decoding_type": "Eagle", "speculative_model": str(head), **mode},
                                             model=target, prompts=PROMPTS, min_accepted=0)
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_published_eagle3_head_loads_with_its_draft_vocabulary(target, tmp_path):
    head = eagle3_checkpoint(tmp_path / "e3")
    spec = LLM(model=str(target), dtype="float32",
               speculative_config={"decoding_type": "eagle3", "speculative_model": str(head)})
    assert spec.drafter.layers == [0, 1, 1]  # from eagle_config
    assert spec.drafter.draft_to_target.tolist() == list(range(0, VOCAB, 4))
    for mode in ({}, {"eagle_choices": [[0, 0, 0], [0, 1], [1], [2]]},
                 {"use_dynamic_tree": True, "max_total_draft_tokens": 8}):
        outs = testing.check_greedy_lossless({"decoding_type": "eagle3", "speculative_model": str(head), **mode},
                                             model=target, prompts=PROMPTS, min_accepted=0)
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_eagle3_head_over_the_whole_vocabulary_needs_no_mapping(target, tmp_path):
    head = eagle3_checkpoint(tmp_path / "e3", draft_vocab=VOCAB, d2t=False)
    outs = testing.check_greedy_lossless({"decoding_type": "eagle3", "speculative_model": str(head)},
                                         model=target, prompts=PROMPTS[:1], min_accepted=0)
    assert outs[0].metrics.num_draft_tokens > 0


def test_heads_that_do_not_fit_are_named(target, tmp_path):
    def load(name, head, **extra):
        return LLM(model=str(target), speculative_config={"decoding_type": name, "speculative_model": str(head),
                                                          **extra})

    with pytest.raises(ModelLoadError, match="hidden size 32.*has 64"):
        load("eagle", eagle1_checkpoint(tmp_path / "narrow", hidden=32))
    with pytest.raises(ModelLoadError, match="no d2t mapping"):
        load("eagle3", eagle3_checkpoint(tmp_path / "nod2t", d2t=False))
    three = eagle3_checkpoint(tmp_path / "e3")
    with pytest.raises(ModelLoadError, match="is an EAGLE-3 head; use decoding_type 'eagle3'"):
        load("eagle", three)
    with pytest.raises(ModelLoadError, match="fc.weight reads 192 features, but 2 target layers"):
        load("eagle3", three, eagle3_layers_to_capture=[0, 1])
    with pytest.raises(ConfigError, match=r"eagle3_layers_to_capture.*layer 5 is not among the target's layers 0..1"):
        load("eagle3", three, eagle3_layers_to_capture=[0, 1, 5])
    other = testing.tiny_model_dir(tmp_path / "wide", "llama", vocab_size=256)
    with pytest.raises(ModelLoadError, match="vocabulary of 128 tokens.*has 256"):
        LLM(model=str(other), speculative_config={"decoding_type": "eagle3", "speculative_model": str(three)})
    with pytest.raises(ModelLoadError, match="needs a head trained for"):
        LLM(model=str(target), speculative_config={"decoding_type": "eagle3"})
    with pytest.raises(ModelLoadError, match="not an EAGLE head"):
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "config.json").write_text(json.dumps(_config()))
        save_file({"w": torch.zeros(2)}, str(tmp_path / "junk" / "model.safetensors"))
        load("eagle", tmp_path / "junk")


@pytest.mark.parametrize("options, message", [
    ({"eagle_choices": [[0], []]}, "speculative_config.eagle_choices: not a tree"),
    ({"eagle_choices": [[0], [0, "x"]]}, r"speculative_config.eagle_choices.1.1: expected an integer"),
    ({"eagle_choices": [[0, 0, 0, 0]], "max_draft_len": 3}, "4 deep, more than max_draft_len 3"),
    ({"eagle_choices": [[0]], "use_dynamic_tree": True}, "exclude each other"),
    ({"max_total_draft_tokens": 2, "max_draft_len": 3}, "max_total_draft_tokens"),
])
def test_bad_options_are_config_errors_with_their_path(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(speculative_config={"decoding_type": "eagle3", **options})
