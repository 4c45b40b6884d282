"""`specdec train medusa` on the embedded model: a few CPU steps through the core's loop and
feature store; the heads are written in the Medusa-1 layout (sharing the target's LM
head), learn, and draft losslessly."""

import json

from safetensors import safe_open

from specdec import LLM, SamplingParams, testing


def test_trained_heads_are_saved_in_the_medusa1_layout_and_draft_losslessly(tmp_path):
    out, report, history = testing.train_briefly("medusa", tmp_path, num_heads=2, loss_vocab_size=512)
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 2 and config["medusa_num_layers"] == 1 and config["shares_lm_head"]
    with safe_open(str(out / "medusa_lm_head.safetensors"), "pt") as f:
        keys = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert keys == {"0.0.linear.weight": [576, 576], "0.0.linear.bias": [576],
                    "1.0.linear.weight": [576, 576], "1.0.linear.bias": [576]}
    assert (out / "draft_vocab.safetensors").exists()
    assert report["steps"] == len(history) == 10 and history[-1]["loss"] < history[0]["loss"]
    assert {"acc0", "acc1"} <= set(history[-1])
    prompts = [[{"role": "user", "content": "Give me a short list of fruits."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(dtype="float32").chat(prompts, params)[0]
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "medusa", "speculative_model": str(out),
                                                    "max_draft_len": 2, "adaptive": False})
    got = spec.chat(prompts, params)[0]
    assert got.token_ids == plain.token_ids and got.metrics.num_draft_tokens > 0
    assert len(spec.drafter.draft_to_target) <= 512
