"""Published Medusa layouts load unchanged and draft losslessly on a tiny Llama target; heads
that do not fit, and bad options, are clear errors.

The checkpoints are written key by key in the reference's layouts (Medusa-1's
``medusa_lm_head`` file with its understated ``medusa_num_heads``, Medusa-2's
``medusa_head.*`` tensors inside the model's own file), not with the plugin's writer.
Random heads do not predict the random target, so acceptance is checked with the trained
heads (test_medusa.py)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, testing
from specdec.errors import ConfigError, ModelLoadError

H, VOCAB = 64, 128


def medusa_state(heads=3, layers=1, hidden=H, vocab=VOCAB, prefix=""):
    g = torch.Generator().manual_seed(0)
    state = {}
    for k in range(heads):
        for j in range(layers):
            state[f"{prefix}{k}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
            state[f"{prefix}{k}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.05
        if vocab:
            state[f"{prefix}{k}.{layers}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.2
    return state


def medusa1_checkpoint(directory, torch_file=True, **shape):
    """The reference's MedusaModel.save: config says 2 heads, the file holds 3."""
    directory.mkdir(parents=True)
    state = medusa_state(**shape)
    if torch_file:
        torch.save(state, directory / "medusa_lm_head.pt")
    else:
        save_file(state, str(directory / "medusa_lm_head.safetensors"))
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                       "base_model_name_or_path": "tiny"}))
    return directory


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return testing.tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", vocab_size=VOCAB)


PROMPTS = [[5, 17, 33, 2, 90, 41] * 2, [7, 7, 8, 9, 100], list(range(30, 52))]


def test_conformance():
    testing.check_registration("medusa", distribution="specdec-plugin-medusa")
    testing.check_config_round_trip({"decoding_type": "medusa", "max_draft_len": 2, "medusa_choices": [[0, 0], [1]],
                                     "num_medusa_heads": 2})


@pytest.mark.parametrize("torch_file", [True, False])
def test_published_medusa1_heads_load_with_their_real_head_count(target, tmp_path, torch_file):
    heads = medusa1_checkpoint(tmp_path / "m1", torch_file=torch_file)
    spec = LLM(model=str(target), dtype="float32",
               speculative_config={"decoding_type": "Medusa", "speculative_model": str(heads)})
    assert len(spec.drafter.heads) == 3 and not spec.drafter.heads.shares_lm_head
    for mode in ({}, {"medusa_choices": [[0, 0, 0], [0, 1], [1], [2, 0]]}, {"medusa_choices": [[0, 0]]}):
        outs = testing.check_greedy_lossless({"decoding_type": "medusa", "speculative_model": str(heads),
                                              "adaptive": False, **mode},
                                             model=target, prompts=PROMPTS, min_accepted=0)
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_medusa2_heads_inside_the_model_checkpoint(target, tmp_path):
    model = tmp_path / "medusa2"
    shutil.copytree(target, model)
    weights = load_file(str(model / "model.safetensors"))
    save_file({**weights, **medusa_state(heads=2, layers=2, prefix="medusa_head.")}, str(model / "model.safetensors"))
    spec = LLM(model=str(model), dtype="float32",
               speculative_config={"decoding_type": "medusa", "speculative_model": str(model), "max_draft_len": 2})
    assert len(spec.drafter.heads) == 2 and spec.drafter.heads.num_layers == 2
    outs = testing.check_greedy_lossless({"decoding_type": "medusa", "speculative_model": str(model),
                                          "max_draft_len": 2, "adaptive": False},
                                         model=model, prompts=PROMPTS, min_accepted=0)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_heads_that_do_not_fit_are_named(target, tmp_path):
    def load(heads, **extra):
        return LLM(model=str(target), speculative_config={"decoding_type": "medusa", "speculative_model": str(heads),
                                                          **extra})

    with pytest.raises(ModelLoadError, match="hidden states of size 32.*hidden size 64"):
        load(medusa1_checkpoint(tmp_path / "narrow", hidden=32))
    with pytest.raises(ModelLoadError, match="predict over 256 tokens.*vocabulary of 128"):
        load(medusa1_checkpoint(tmp_path / "wide", vocab=256))
    three = medusa1_checkpoint(tmp_path / "three")
    with pytest.raises(ConfigError, match="num_medusa_heads: 4 heads asked for.*has 3"):
        load(three, num_medusa_heads=4)
    with pytest.raises(ConfigError, match=r"medusa_choices: the tree is 4 deep.*3 usable heads"):
        load(three, max_draft_len=4, medusa_choices=[[0, 0, 0, 0]])
    with pytest.raises(ModelLoadError, match="no Medusa heads there"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text("{}")
        load(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="unexpected tensor 'fc.weight'"):
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "config.json").write_text("{}")
        save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "junk" / "medusa_lm_head.safetensors"))
        load(tmp_path / "junk")
    with pytest.raises(ModelLoadError, match="needs heads trained for"):
        LLM(model=str(target), speculative_config={"decoding_type": "medusa"})


@pytest.mark.parametrize("options, message", [
    ({"medusa_choices": [[0], []]}, "speculative_config.medusa_choices: not a tree"),
    ({"medusa_choices": [[0, 0, 0, 0]], "max_draft_len": 3}, "4 deep, more than max_draft_len 3"),
    ({"posterior_threshold": 1.5}, "speculative_config.posterior_threshold"),
])
def test_bad_options_are_config_errors_with_their_path(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(speculative_config={"decoding_type": "medusa", **options})
