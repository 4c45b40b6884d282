"""Core pieces of `specdec train` that need no training run: data items, splits, batches,
the learning-rate schedule, prompts of models with and without a chat template, starting
every installed method's trainer from its shipped drafter (``--init``)."""

import importlib
import json

import pytest
import torch
from helpers import tiny_chat_model

from specdec import LLM, SamplingParams, testing
from specdec.training.data import Sample, TrainingDataError, encode_prompt, read_items, split_eval
from specdec.training.loop import lr_factor, make_batches


def test_read_items_checks_each_line(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n{"text": "c"}\n')
    assert len(read_items(good)) == 3
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(TrainingDataError, match="bad.jsonl:2: expected"):
        read_items(bad)


def test_public_instruction_sets_are_read_as_published(tmp_path):
    """Alpaca's instruction (+ input) and ShareGPT's first user turn become prompts; the
    datasets' own answers are never kept."""
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "Sum these.", "input": "1, 2", "output": "3"},
                                  {"instruction": "Name a colour.", "input": "", "output": "red"}]))
    assert read_items(alpaca) == [{"prompt": "Sum these.\n\n1, 2"}, {"prompt": "Name a colour."}]
    share = tmp_path / "sharegpt.jsonl"
    share.write_text(json.dumps({"conversations": [{"from": "system", "value": "be brief"},
                                                   {"from": "human", "value": "Hi?"},
                                                   {"from": "gpt", "value": "Hello."}]}) + "\n")
    assert read_items(share) == [{"prompt": "Hi?"}]
    for text, message in (('{"instruction": "a"}', "must hold a list"),
                          ('[{"instruction": "a"}, {"conversations": [{"from": "gpt", "value": "x"}]}]',
                           "alpaca.json record 2: expected")):
        alpaca.write_text(text)
        with pytest.raises(TrainingDataError, match=message):
            read_items(alpaca)


def test_held_out_prompts_are_the_last_and_at_most_a_quarter():
    items = [{"prompt": str(i)} for i in range(10)] + [{"text": "t"}]
    train, held = split_eval(items, 16)
    assert [h["prompt"] for h in held] == ["8", "9"] and len(train) == 9


def test_batches_are_fixed_by_seed_and_epoch_and_cover_every_sample():
    a, b = make_batches(list(range(10)), 3, seed=0, epoch=0), make_batches(list(range(10)), 3, seed=0, epoch=0)
    assert a == b and sorted(i for batch in a for i in batch) == list(range(10))
    assert make_batches(list(range(10)), 3, seed=0, epoch=1) != a


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1) and lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100) == pytest.approx(0.1) and lr_factor(55, 10, 100) < 1.0


def test_prompts_use_the_chat_template_where_there_is_one_and_plain_text_elsewhere(smol, tmp_path):
    item = {"prompt": "Hello there"}
    assert encode_prompt(smol, item) == smol.apply_chat_template([{"role": "user", "content": "Hello there"}])
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = testing.tiny_model_dir(tmp_path, vocab_size=32)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(32)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(directory)
    base = LLM(model=str(directory))
    assert encode_prompt(base, {"prompt": "w3 w4 w5"}) == [3, 4, 5]
    # a conversation with a base model: its messages' text as one plain prompt
    turns = [{"role": "user", "content": "w3 w4"}, {"role": "assistant", "content": "w5"},
             {"role": "user", "content": [{"type": "text", "text": "w6"}]}]
    assert base.apply_chat_template(turns) == [3, 4, 5, 6]


def test_feature_store_matches_the_target_resumes_grows_and_serves_fewer_layers(tiny_models, tmp_path):

    import torch

    from specdec.model.loading import load_causal_lm, load_tokenizer
    from specdec.training.data import Sample
    from specdec.training.features import INDEX, FeatureStore
    from specdec.training.method import TrainTarget

    path = tiny_models["llama"]
    target = TrainTarget(load_causal_lm(path, torch.float32, torch.device("cpu")), load_tokenizer(path), "tiny", path)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, 128, (n,), generator=g).tolist(), 1) for n in (5, 12, 7, 30, 9)]
    calls = []
    whole = FeatureStore.build(tmp_path / "a", target, samples, [0, -1], max_len=20, dtype="float32",
                               batch_tokens=24, progress=lambda done, total: calls.append(done))
    assert calls[-1] == 5 and len(calls) > 1  # built in chunks
    batch = whole.batch([3, 1], 20, torch.device("cpu"))
    _, ref = target.run(torch.tensor([samples[3].token_ids[:20]]), torch.ones(1, 20, dtype=torch.long), [0, -1])
    for layer in (0, -1):
        torch.testing.assert_close(batch[layer][0], ref[layer][0])
        assert batch[layer].shape == (2, 20, 64) and not batch[layer][1, 12:].any()  # zero past the end
    # an interrupted build (2 samples done) continues where it stopped
    part = tmp_path / "b"
    FeatureStore.build(part, target, samples[:2], [0, -1], max_len=20, dtype="float32")
    index = json.loads((part / INDEX).read_text())
    (part / INDEX).write_text(json.dumps({**index, "lengths": whole.lengths}))
    calls.clear()
    resumed = FeatureStore.build(part, target, samples, [0, -1], max_len=20, dtype="float32",
                                 progress=lambda done, total: calls.append(done))
    assert calls == [5]  # samples 2..4 only, in one chunk
    for layer in (0, -1):  # other batch shapes: equal up to float32 rounding
        torch.testing.assert_close(resumed.rows(layer), whole.rows(layer), atol=1e-4, rtol=1e-3)
    # a method asking for fewer layers reuses the store without recomputing
    calls.clear()
    fewer = FeatureStore.build(part, target, samples, [-1], max_len=20, dtype="float32",
                               progress=lambda done, total: calls.append(done))
    assert calls == [] and list(fewer.batch([0], 5, torch.device("cpu"))) == [-1]
    # samples appended to the data: only the new ones are computed; other samples: all of them
    grown = tmp_path / "c"
    FeatureStore.build(grown, target, samples[:3], [-1], max_len=20, dtype="float32")
    calls.clear()
    appended = FeatureStore.build(grown, target, samples, [-1], max_len=20, dtype="float32", batch_tokens=24,
                                  progress=lambda done, total: calls.append(done))
    assert calls == [4, 5]  # from sample 3 on
    torch.testing.assert_close(appended.rows(-1), whole.rows(-1), atol=1e-4, rtol=1e-3)
    calls.clear()
    FeatureStore.build(grown, target, samples[1:], [-1], max_len=20, dtype="float32", batch_tokens=24,
                       progress=lambda done, total: calls.append(done))
    assert calls == [2, 3, 4]  # from the first sample on
    # a run on the first 3 samples (--max-samples) reads the rows of the store built for all 5
    calls.clear()
    first = FeatureStore.build(tmp_path / "a", target, samples[:3], [0, -1], max_len=20, dtype="float32",
                               progress=lambda done, total: calls.append(done))
    assert calls == [] and json.loads((tmp_path / "a" / INDEX).read_text())["done"] == 5
    for layer in (0, -1):
        assert torch.equal(first.rows(layer), whole.rows(layer)[:sum(whole.lengths[:3])])


def test_a_target_served_quantized_answers_gives_features_and_is_evaluated_quantized(tmp_path):
    """``--quantization w4a8``: the drafter learns what it will be served beside. The answers
    are the quantized target's greedy ones, the stored features its hidden states (not the
    unquantized target's), the held-out evaluation runs it; the store is computed again
    for a run without quantization."""
    from specdec.model.loading import load_weights
    from specdec.training import TrainOptions, train
    from specdec.training.features import INDEX
    from specdec.training.method import TrainTarget

    directory = tiny_chat_model(tmp_path / "model")
    model = str(directory)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one two", "three four five", "six", "seven")))
    options = dict(method="medusa", data=str(data), model=model, device="cpu", max_new_tokens=8, batch_size=2,
                   max_steps=1, eval_prompts=1, trainer_options={"num_heads": 1})
    report = train(TrainOptions(out=str(tmp_path / "q"), quantization="w4a8", **options), progress=False)
    assert report["quantization"] == "w4a8" and report["eval"]["prompts"] == 1
    assert report["eval"]["steps_speculation_off"] == 0  # evaluated planner off: the drafter's own figure
    samples = [json.loads(line) for line in (tmp_path / "q" / "samples.jsonl").read_text().splitlines()]
    served = LLM(model, dtype="bfloat16", engine={"quantization": "w4a8"})
    plain = LLM(model, dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = [s["token_ids"][:s["loss_start"] + 1] for s in samples]
    answers = [o.token_ids for o in served.generate(ids, params)]
    assert [s["token_ids"][s["loss_start"] + 1:] for s in samples] == answers
    assert answers != [o.token_ids for o in plain.generate(ids, params)]
    features = tmp_path / "q" / "features"
    assert json.loads((features / INDEX).read_text())["quantization"] == "w4a8"
    quantized = TrainTarget(load_weights(model, "w4a8", torch.bfloat16, torch.device("cpu"))[0], served.tokenizer,
                            "tiny", directory)
    first = torch.tensor([samples[0]["token_ids"]])
    _, states = quantized.run(first, torch.ones_like(first), [-1])
    stored = torch.from_file(str(features / "layer_-1.bin"), size=first.shape[1] * quantized.hidden_size,
                             dtype=torch.bfloat16).view(-1, quantized.hidden_size)
    assert torch.equal(stored, states[-1][0].to(torch.bfloat16))
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "samples.jsonl").write_text((tmp_path / "q" / "samples.jsonl").read_text())
    (tmp_path / "u" / "features").symlink_to(features)
    assert train(TrainOptions(out=str(tmp_path / "u"), **options), progress=False)["quantization"] is None
    assert "quantization" not in json.loads((features / INDEX).read_text())  # computed again, unquantized


@pytest.fixture(scope="module")
def train_target():
    from specdec.training.loop import TrainOptions, load_target

    return load_target(TrainOptions(method="mtp", data="", out=""), torch.device("cpu"))


SHIPPED = {"draft_target": ("specdec_draft_target.checkpoint", "SHIPPED_DRAFT"),
           "eagle": ("specdec_eagle.checkpoint", "SHIPPED_HEADS", 1),
           "eagle3": ("specdec_eagle.checkpoint", "SHIPPED_HEADS", 3),
           "medusa": ("specdec_medusa.checkpoint", "SHIPPED_HEADS"),
           "mtp": ("specdec_mtp.checkpoint", "SHIPPED_MODULE"),
           "redrafter": ("specdec_redrafter.checkpoint", "SHIPPED_DRAFTER")}


@pytest.mark.parametrize("method", sorted(SHIPPED))
def test_init_starts_from_the_shipped_drafter_and_saves_it_back(train_target, method, tmp_path):
    """``specdec train --init default`` on the embedded model: the trainer's module holds the
    shipped drafter, so saving before any step writes the shipped tensors back (within
    the shipped files' int8/bfloat16 storage)."""
    from specdec.drafting.checkpoint import DRAFT_VOCAB_FILE, load_tensors
    from specdec.plugins import get_registry

    trainer_class = get_registry().resolve(method).trainer_class
    samples = [Sample(list(range(40, 140)), 10)]
    fresh = trainer_class(train_target, samples, {})
    trainer = trainer_class(train_target, samples, {})
    trainer.start_from(None)
    module, name, *key = SHIPPED[method]
    shipped_dir = getattr(importlib.import_module(module), name)
    shipped_dir = shipped_dir[key[0]] if key else shipped_dir
    trainer.save(tmp_path)
    files = [f for f in shipped_dir.glob("*.safetensors") if f.name != DRAFT_VOCAB_FILE]
    assert files
    for shipped_file in files:
        shipped, saved = load_tensors(shipped_file), load_tensors(tmp_path / shipped_file.name)
        assert set(shipped) <= set(saved), shipped_file
        for key, value in shipped.items():
            torch.testing.assert_close(saved[key].float(), value.float(), rtol=1e-2, atol=1e-3, msg=key)
    fresh_state, state = fresh.module().state_dict(), trainer.module().state_dict()
    assert any(not torch.equal(fresh_state[k], state[k]) for k in state if k in fresh_state)


def test_init_is_refused_before_any_work_by_a_trainer_that_cannot_start_from_a_drafter(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from specdec.training import MethodTrainer, TrainError, TrainOptions, loop, train

    class ScratchOnly(MethodTrainer):
        pass

    monkeypatch.setattr(loop, "trainer_class_for", lambda name: SimpleNamespace(name=name, trainer_class=ScratchOnly))
    with pytest.raises(TrainError, match="specdec train scratchy cannot start from a saved drafter"):
        train(TrainOptions(method="scratchy", data=str(tmp_path / "never-read.jsonl"), out=str(tmp_path / "o"),
                           init="default"), progress=False)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_gpu_recipe_runs_end_to_end_at_tiny_scale(tmp_path, monkeypatch):
    """scripts/train_recipe.py, whose `--scale gpu` is meant for a device call, at toy size on
    the CPU (run as its own ``__main__`` in this process): requests the target writes and a
    public set's, its answers once (draft_target's run), EAGLE-3 and Medusa trained on them
    (Medusa on EAGLE-3's features), each drafter lossless on the held-out prompts beside the
    shipped one, the weights loadable from OUT."""
    import runpy
    import sys
    from pathlib import Path

    public = tmp_path / "alpaca.json"
    public.write_text(json.dumps([{"instruction": "Name three rivers.", "input": "", "output": "..."},
                                  {"instruction": "Add the numbers.", "input": "2, 3", "output": "5"},
                                  {"instruction": "Name three rivers.", "input": "", "output": "again"}]))
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    monkeypatch.syspath_prepend(str(scripts))  # as `python scripts/train_recipe.py` has it
    monkeypatch.setattr(sys, "argv", ["train_recipe.py", "--scale", "tiny", "--out", str(tmp_path), "--methods",
                                      "eagle3", "medusa", "--device", "cpu", "--public", str(public)])
    runpy.run_path(str(scripts / "train_recipe.py"), run_name="__main__")
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "run" / "prompts.jsonl").read_text().splitlines()]
    assert sorted(p for p in prompts if p in ("Name three rivers.", "Add the numbers.\n\n2, 3")) == [
        "Add the numbers.\n\n2, 3", "Name three rivers."]  # once each, the answers never kept
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["methods"]) == ["eagle3", "medusa"]  # draft_target ran for the answers only
    for method, row in report["methods"].items():
        assert row["steps"] == 2 and row["samples"] == report["prompts"] > 0, method
        for which in ("new", "shipped"):
            assert row[which]["same_as_plain"] == row[which]["prompts"] > 0, (method, which)
            assert row[which]["acceptance_length"] >= 1.0, (method, which)
    assert (tmp_path / "run" / "medusa" / "features").resolve() == (tmp_path / "run" / "eagle3" / "features")
    assert not {"checkpoint.pt", "samples.jsonl", "features"} & {p.name for p in (tmp_path / "weights").rglob("*")}
    llm = LLM(engine={"compile": False},  # the weights load; compiling is another test's subject
              speculative_config={"decoding_type": "eagle3", "speculative_model": str(tmp_path / "weights/eagle3")})
    assert llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
