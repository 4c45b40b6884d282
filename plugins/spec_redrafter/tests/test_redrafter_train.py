"""`specdec train redrafter` on the embedded model: a few CPU steps through the core's loop
and feature store; the drafter is written in the reference's layout (sharing the target's
LM head), learns, loads back through the published-layout loader, and drafts losslessly."""

import json

from safetensors import safe_open

from specdec import LLM, SamplingParams, testing


def test_trained_drafter_is_saved_in_the_reference_layout_and_drafts_losslessly(tmp_path):
    out, report, history = testing.train_briefly("redrafter", tmp_path, num_draft_layers=1, depth=3,
                                                 loss_vocab_size=512)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "recurrent_drafting_drafter" and config["rnn"] and config["shares_lm_head"]
    assert (config["hidden_size"], config["exit_dim"], config["num_draft_layers"]) == (576, 576, 1)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert keys == {"input_proj.weight": [576, 1152], "input_proj.bias": [576],
                    "lm_head.0.linear.weight": [576, 576], "lm_head.0.linear.bias": [576],
                    "rnn_u.weight": [576, 576], "rnn_u.bias": [576], "rnn_w.weight": [576, 576]}
    assert report["steps"] == len(history) == 10 and history[-1]["loss"] < history[0]["loss"]
    assert {"acc1", "acc2", "acc3"} <= set(history[-1])
    prompts = [[{"role": "user", "content": "Give me a short list of fruits."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(dtype="float32").chat(prompts, params)[0]
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "redrafter", "speculative_model": str(out),
                                                    "beam_width": 2, "adaptive": False})
    got = spec.chat(prompts, params)[0]
    assert got.token_ids == plain.token_ids and got.metrics.num_accepted_tokens > 0
    assert spec.config.speculative_config.max_draft_len == 4 and len(spec.drafter.draft_to_target) <= 512
