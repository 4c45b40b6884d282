"""`specdec train eagle|eagle3` on the embedded model: a few CPU steps through the core's
loop and feature store; the heads are written in the published layouts and draft
losslessly; the unrolled steps learn."""

import json

import pytest
import torch
from safetensors import safe_open

from specdec import LLM, SamplingParams, testing
from specdec.training import TrainOptions, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return testing.prompt_file(tmp_path_factory.mktemp("data"))


def _train(method, data, out, **trainer_options):
    return train(TrainOptions(method=method, data=str(data), out=str(out), max_new_tokens=16, batch_size=8,
                              eval_prompts=1, gen_dtype="float32", device="cpu", max_steps=10, lr=1e-3,
                              warmup_steps=2, trainer_options=trainer_options), progress=False)


def _keys(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


@pytest.fixture(scope="module")
def eagle3_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3")
    return out, _train("eagle3", data, out, draft_vocab_size=256)


def test_eagle3_head_is_saved_in_the_published_layout(eagle3_run):
    out, report = eagle3_run
    config = json.loads((out / "config.json").read_text())
    vocab = config["draft_vocab_size"]  # the answers' most frequent tokens: all of them, in so little data
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and 16 < vocab <= 256
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    keys = _keys(out / "model.safetensors")
    assert keys["fc.weight"] == [576, 3 * 576] and keys["lm_head.weight"] == [vocab, 576]
    assert keys["d2t"] == [vocab] and keys["t2d"] == [49152]
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= set(keys)
    assert keys["midlayer.self_attn.q_proj.weight"] == [576, 2 * 576]
    assert not any(k.startswith(("embed_tokens", "rotary")) for k in keys)  # the target's, not stored
    index = json.loads((out / "features" / "index.json").read_text())
    assert index["done"] == report["samples"] == 5 and index["layers"] == [-1, 1, 14, 26]


def test_unrolled_steps_learn(eagle3_run):
    out, report = eagle3_run  # one batch holds every sample: each step sees the same data
    history = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["history"]
    assert report["steps"] == len(history) == 10
    assert history[-1]["loss"] < history[0]["loss"]
    assert {"acc0", "acc1", "acc2"} <= set(history[-1])  # three unrolled steps, each measured


def test_trained_heads_draft_losslessly(eagle3_run, data, tmp_path):
    eagle_out = tmp_path / "eagle"
    _train("eagle", data, eagle_out, loss_vocab_size=512)
    keys = _keys(eagle_out / "model.safetensors")
    assert keys["fc.weight"] == [576, 1152] and "fc.bias" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert not any(k.startswith(("lm_head", "layers.0.input_layernorm")) for k in keys)
    assert (eagle_out / "draft_vocab.safetensors").exists()  # it drafts over the tokens it learnt
    prompts = [[{"role": "user", "content": "Give me a short list of fruits."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(dtype="float32").chat(prompts, params)[0]
    for name, out in (("eagle3", eagle3_run[0]), ("eagle", eagle_out)):
        spec = LLM(dtype="float32", speculative_config={"decoding_type": name, "speculative_model": str(out),
                                                        "adaptive": False})
        got = spec.chat(prompts, params)[0]
        assert got.token_ids == plain.token_ids and got.metrics.num_draft_tokens > 0
        assert spec.drafter.draft_to_target is not None and len(spec.drafter.draft_to_target) <= 512
