"""`specdec train mtp` on the embedded model: a few CPU steps through the core's loop and
feature store; the module is written in DeepSeek-V3's layout (the block's tensors under
``model.layers.{N}.``, the target's head and embedding left out), learns, loads back
through the same loader as a model's own MTP layers, and drafts losslessly."""

import json
import shutil

from safetensors import safe_open

from specdec import LLM, SamplingParams, testing


def test_trained_module_is_saved_in_the_deepseek_layout_and_drafts_losslessly(tmp_path):
    out, report, history = testing.train_briefly("mtp", tmp_path, ttt_steps=2, loss_vocab_size=512)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"], config["hidden_size"]) == (30, 1, 576)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert keys["model.layers.30.eh_proj.weight"] == [576, 1152]
    assert keys["model.layers.30.self_attn.q_proj.weight"] == [576, 576]
    assert keys["model.layers.30.mlp.gate_proj.weight"] == [1536, 576]
    assert {"model.layers.30.enorm.weight", "model.layers.30.hnorm.weight", "model.layers.30.shared_head.norm.weight",
            "model.layers.30.input_layernorm.weight"} <= set(keys)
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in keys)
    assert report["steps"] == len(history) == 10 and history[-1]["loss"] < history[0]["loss"]
    assert {"acc0", "acc1"} <= set(history[-1])
    prompts = [[{"role": "user", "content": "Give me a short list of fruits."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = LLM(dtype="float32").chat(prompts, params)[0]
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "mtp", "speculative_model": str(out),
                                                    "adaptive": False})
    got = spec.chat(prompts, params)[0]
    assert got.token_ids == plain.token_ids and got.metrics.num_draft_tokens > 0
    assert len(spec.drafter.draft_to_target) <= 512

    # --init default: the same data (answers and features copied, not made again), starting
    # from the shipped module, whose loss on the first batch is far below a fresh module's
    tuned = tmp_path / "tuned" / "mtp"
    tuned.mkdir(parents=True)
    shutil.copy(out / "samples.jsonl", tuned / "samples.jsonl")
    shutil.copytree(out / "features", tuned / "features")
    _, tuned_report, tuned_history = testing.train_briefly("mtp", tmp_path / "tuned", init="default", ttt_steps=2,
                                                           loss_vocab_size=512)
    print("first-batch loss, fresh and shipped:", history[0]["loss"], tuned_history[0]["loss"])
    assert tuned_report["init"] == "default"
    assert tuned_history[0]["loss"] < 0.5 * history[0]["loss"]
    assert tuned_history[0]["acc0"] > history[0]["acc0"] + 0.2
