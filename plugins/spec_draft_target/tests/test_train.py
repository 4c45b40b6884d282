"""`specdec train draft_target` on the embedded model: a few steps on CPU, the checkpoint
loads and drafts losslessly, resume continues without repeating data, bad input is named."""

import json

import pytest
import torch

from specdec import LLM, SamplingParams, testing
from specdec.cli import main
from specdec.errors import ModelLoadError
from specdec.training import TrainOptions, loop, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return testing.prompt_file(tmp_path_factory.mktemp("data"))


def _opts(data, out, **kw):
    base = dict(method="draft_target", data=str(data), out=str(out), max_new_tokens=12, batch_size=2,
                eval_prompts=1, save_every=2, gen_dtype="float32", device="cpu")
    return TrainOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def smol_float32():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    report = train(_opts(data, out, max_steps=12, lr=3e-3, trainer_options={"draft_vocab_size": 512}),
                   progress=False)
    return out, report


def test_cli_trains_five_steps_and_the_draft_is_lossless(data, tmp_path, smol_float32):
    out = tmp_path / "d"
    assert main(["train", "draft_target", "--data", str(data), "--out", str(out), "--max-steps", "5",
                 "--max-new-tokens", "8", "--eval-prompts", "1", "--gen-dtype", "float32"]) == 0
    assert {"config.json", "model.safetensors", "draft_vocab.safetensors", "train_report.json"} <= \
        {p.name for p in out.iterdir()}
    assert json.loads((out / "train_report.json").read_text())["steps"] == 5
    prompts = [[{"role": "user", "content": "Give me a short list of fruits."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "draft_target", "speculative_model": str(out)})
    got = spec.chat(prompts, params)[0]
    assert got.token_ids == smol_float32.chat(prompts, params)[0].token_ids
    assert got.metrics.num_draft_tokens > 0


def test_training_lowers_the_loss_and_the_draft_vocab_is_kept(run):
    out, report = run
    history = torch.load(out / loop.CHECKPOINT, weights_only=False)["state"]["history"]
    losses = [h["loss"] for h in history]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0, losses
    vocab = draft_vocab_of(out)
    assert len(vocab) <= 512 and report["eval"]["prompts"] == 1


def draft_vocab_of(out):
    from safetensors.torch import load_file

    return load_file(str(out / "draft_vocab.safetensors"))["token_ids"].tolist()


def test_resume_continues_from_the_checkpoint_without_repeating_batches(data, tmp_path, monkeypatch):
    seen = []
    real = loop.collate

    def record(samples, *args):
        seen.append([s.token_ids for s in samples])
        return real(samples, *args)

    monkeypatch.setattr(loop, "collate", record)
    train(_opts(data, tmp_path / "whole", max_steps=6, eval_prompts=0), progress=False)
    expected, seen[:] = list(seen), []
    part = tmp_path / "part"
    train(_opts(data, part, max_steps=4, eval_prompts=0), progress=False)  # a run stopped at step 4
    with pytest.raises(loop.TrainError, match="--resume"):
        train(_opts(data, part, max_steps=6, eval_prompts=0), progress=False)
    seen[:] = []
    train(_opts(data, part, max_steps=6, eval_prompts=0, resume=True), progress=False)
    assert seen == expected[4:]  # 3 batches per epoch: the second epoch's 2nd and 3rd
    steps = [h["step"] for h in torch.load(part / loop.CHECKPOINT, weights_only=False)["state"]["history"]]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_draft_for_another_target_is_refused_naming_both(run, tmp_path):
    out, _ = run
    tiny = testing.tiny_model_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="hidden_size 576.*has hidden_size 64"):
        LLM(model=str(tiny), speculative_config={"decoding_type": "draft_target", "speculative_model": str(out)})


def test_a_corrupt_checkpoint_names_the_file(run, tmp_path):
    import shutil

    out, _ = run
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors: cannot read them"):
        LLM(speculative_config={"decoding_type": "draft_target", "speculative_model": str(broken)})


@pytest.mark.parametrize("args, message", [
    (["ngram", "--data", "{data}"], "has no trainer"),
    (["draft_target", "--data", "{missing}"], "no such file"),
    (["draft_target", "--data", "{empty}"], "has no training items"),
    (["draft_target", "--data", "{data}", "--set", "draft_layerz=2"], "unknown trainer option"),
    (["draft_target", "--data", "{data}", "--init", "{missing}"], "--init"),
])
def test_bad_input_exits_nonzero_with_one_line(args, message, data, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    fill = {"data": str(data), "missing": str(tmp_path / "nope.jsonl"), "empty": str(empty)}
    argv = ["train", *[a.format(**fill) for a in args], "--out", str(tmp_path / "o"), "--max-steps", "1",
            "--max-new-tokens", "4", "--eval-prompts", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_train_help_lists_the_methods_that_train(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    assert "methods installed that train: draft_target" in capsys.readouterr().out
