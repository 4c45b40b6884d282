"""Checkpoints in the reference's layout (``Drafter.save_pretrained``: ``config.json`` with
``recurrent_drafting_drafter`` and ``model.safetensors`` / ``pytorch_model.bin``) load and
draft losslessly on a tiny Llama target; drafters that do not fit, and bad options, are
clear errors.

The checkpoints are written key by key in the reference's names (``input_proj``,
``lm_head.{i}.linear``, ``lm_head.{N}.weight``, ``rnn_u``, ``rnn_w``), not with the
plugin's writer. A random drafter does not predict a random target, so the tests that
need drafts accepted use a target whose next token is fixed (a drafter trained on it is
checked in test_redrafter_train.py, the shipped one in test_redrafter.py)."""

import json

import pytest
import torch
from safetensors.torch import save_file
from specdec_redrafter import ReDrafterConfig, load_drafter
from specdec_redrafter.checkpoint import drafter_shape
from specdec_redrafter.model import top_k_scores

from specdec import LLM, SamplingParams, testing
from specdec.drafting.interface import first_child_path
from specdec.errors import ConfigError, ModelLoadError
from specdec.plugin_api import TREE_KIND

H, VOCAB = 64, 128


def reference_state(hidden=H, exit_dim=None, layers=2, vocab=VOCAB, rnn=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    exit_dim = exit_dim or 2 * hidden
    state = {}
    if exit_dim != 2 * hidden:
        state["input_proj.weight"] = torch.randn(exit_dim, 2 * hidden, generator=g) * 0.05
        state["input_proj.bias"] = torch.zeros(exit_dim)
    for i in range(layers):
        state[f"lm_head.{i}.linear.weight"] = torch.randn(exit_dim, exit_dim, generator=g) * 0.05
        state[f"lm_head.{i}.linear.bias"] = torch.randn(exit_dim, generator=g) * 0.05
    if vocab:
        state[f"lm_head.{layers}.weight"] = torch.randn(vocab, exit_dim, generator=g) * 0.3
    if rnn:
        state["rnn_u.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
        state["rnn_u.bias"] = torch.zeros(hidden)
        state["rnn_w.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
    return state


def reference_checkpoint(directory, torch_file=False, **shape):
    """What the reference's Drafter.save_pretrained writes."""
    directory.mkdir(parents=True)
    state = reference_state(**shape)
    if torch_file:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    hidden = shape.get("hidden", H)
    config = {"model_type": "recurrent_drafting_drafter", "architectures": ["Drafter"], "hidden_size": hidden,
              "vocab_size": shape.get("vocab", VOCAB), "exit_dim": shape.get("exit_dim", 2 * hidden),
              "num_draft_layers": shape.get("layers", 2), "num_lookback_tokens": -1, "rnn": shape.get("rnn", True)}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return testing.tiny_model_dir(tmp_path_factory.mktemp("target"), "llama", vocab_size=VOCAB)


def test_conformance():
    testing.check_registration("redrafter", distribution="specdec-plugin-redrafter")
    testing.check_config_round_trip({"decoding_type": "redrafter", "beam_width": 3, "beam_length": 4})
    testing.check_config_round_trip({"decoding_type": "ReDrafter", "max_draft_len": 2,
                                     "max_total_draft_tokens": 5})


@pytest.mark.parametrize("shape, torch_file", [
    ({}, False),  # exit_dim = 2H: no input_proj, as the reference's published drafters
    ({"exit_dim": 96, "layers": 1}, True),
    ({"rnn": False, "layers": 0}, False),
])
def test_reference_layout_loads_and_drafts_losslessly(target, tmp_path, shape, torch_file):
    directory = reference_checkpoint(tmp_path / "drafter", torch_file=torch_file, **shape)
    spec = LLM(model=str(target), dtype="float32",
               speculative_config={"decoding_type": "ReDrafter", "speculative_model": str(directory)})
    model = spec.drafter.model
    assert model.shape.exit_dim == shape.get("exit_dim", 2 * H) and model.shape.rnn == shape.get("rnn", True)
    assert hasattr(model, "input_proj") == ("exit_dim" in shape)
    for options in ({}, {"beam_width": 1}, {"beam_width": 3, "beam_length": 3, "max_total_draft_tokens": 4}):
        testing.check_greedy_lossless({"decoding_type": "redrafter", "speculative_model": str(directory),
                                       "adaptive": False, **options}, model=target, min_accepted=0)


@torch.no_grad()
def test_beam_search_matches_an_exhaustive_search(target, tmp_path):
    """Beams are the best ``width`` continuations by summed log-probabilities, each step's
    distribution the reference's (logits outside the top 50 masked, then a log-softmax):
    checked against scoring every path of a tiny drafter (vocabulary 128, depth 2) one by
    one with the reference's masked log-softmax over the whole vocabulary."""
    directory = reference_checkpoint(tmp_path / "drafter", layers=1)
    spec = LLM(model=str(target), dtype="float32",
               speculative_config={"decoding_type": "redrafter", "speculative_model": str(directory),
                                   "beam_width": 3})
    drafter = spec.drafter
    device = spec.target.device
    context = torch.randn(2, H, generator=torch.Generator().manual_seed(1)).to(device)
    roots = torch.tensor([5, 9], device=device)
    beams, score = drafter.beam_search(context, roots, depth=2)
    for row in range(2):
        s1 = drafter.model.next_state(drafter.embed(roots[row]), torch.zeros(H, device=device))
        logits1 = drafter._logits(context[row], s1)
        lp1, ids1 = top_k_scores(logits1)
        # the reference's masked log-softmax over the whole vocabulary gives the same scores
        masked = logits1.masked_fill(logits1 < logits1.topk(50).values[-1], float("-inf")).log_softmax(-1)
        assert torch.allclose(masked[ids1], lp1, atol=1e-5) and int(torch.isfinite(masked).sum()) == 50
        scored = []
        for v1, a in zip(lp1.tolist(), ids1.tolist()):
            s2 = drafter.model.next_state(drafter.embed(torch.tensor(a, device=device)), s1)
            logits2 = drafter._logits(context[row], s2)
            lp2 = logits2.masked_fill(logits2 < logits2.topk(50).values[-1], float("-inf")).log_softmax(-1)
            scored += [(v1 + float(lp2[b]), [a, b]) for b in range(VOCAB) if torch.isfinite(lp2[b])]
        scored.sort(key=lambda x: -x[0])
        assert beams[row].tolist() == [p for _, p in scored[:3]]
        assert torch.allclose(score[row].cpu(), torch.tensor([s for s, _ in scored[:3]]), atol=1e-4)


@torch.no_grad()
def test_the_best_beam_is_the_chain_of_the_beams_tree(target, tmp_path):
    """Beams merged into a tree are marked as one, so that the planner estimates trees and
    chains apart; asked for no more nodes than levels, the drafter proposes the best beam
    alone, which is the tree's path of first children (what verifying the tree tells the
    planner of the chain). One beam is a chain: the planner has nothing to choose."""
    directory = reference_checkpoint(tmp_path / "drafter", layers=1)
    spec = LLM(model=str(target), dtype="float32",
               speculative_config={"decoding_type": "redrafter", "speculative_model": str(directory),
                                   "beam_width": 4, "max_draft_len": 3})
    assert spec.engine.planner.chain_or_tree
    drafter, device = spec.drafter, spec.target.device
    context = torch.randn(1, H, generator=torch.Generator().manual_seed(2)).to(device)
    roots = torch.tensor([7], device=device)
    tree, chain = (drafter._beam_proposals([None], context, roots, [3], [nodes])[0] for nodes in (12, 3))
    assert tree.kind == TREE_KIND and len(tree.token_ids) > 3
    assert chain.kind is None and chain.is_chain
    assert chain.token_ids == [tree.token_ids[n] for n in first_child_path(tree.parents)]
    assert chain.token_ids == drafter.beam_search(context, roots, 3)[0][0, 0].tolist()
    assert not ReDrafterConfig(decoding_type="redrafter", beam_width=1).chain_or_tree


def test_sampled_output_follows_the_target(target, tmp_path):
    directory = reference_checkpoint(tmp_path / "drafter")
    _, accepted = testing.check_sampling_lossless(
        {"decoding_type": "redrafter", "speculative_model": str(directory), "beam_width": 3, "max_draft_len": 2},
        target, prompt=[5, 17, 33], n=300, params=SamplingParams(temperature=1.0))
    assert accepted > 0


def test_shapes_come_from_the_tensors(tmp_path):
    shape = drafter_shape(reference_state(exit_dim=96, layers=3, vocab=None), tmp_path)
    assert (shape.hidden_size, shape.exit_dim, shape.num_draft_layers, shape.vocab_size) == (H, 96, 3, None)


def test_drafters_that_do_not_fit_are_named(target, tmp_path):
    def load(directory, **extra):
        return LLM(model=str(target), speculative_config={"decoding_type": "redrafter",
                                                          "speculative_model": str(directory), **extra})

    with pytest.raises(ModelLoadError, match="hidden states of size 32.*hidden size 64"):
        load(reference_checkpoint(tmp_path / "narrow", hidden=32))
    with pytest.raises(ModelLoadError, match="predicts over 256 tokens.*vocabulary of 128"):
        load(reference_checkpoint(tmp_path / "wide", vocab=256))
    with pytest.raises(ModelLoadError, match="needs exit_dim 64, not 128"):
        load(reference_checkpoint(tmp_path / "headless", vocab=None))
    bad = reference_checkpoint(tmp_path / "lying")
    (bad / "config.json").write_text(json.dumps({"model_type": "recurrent_drafting_drafter", "num_draft_layers": 4}))
    with pytest.raises(ModelLoadError, match="says num_draft_layers 4.*num_draft_layers 2"):
        load(bad)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no drafter weights there"):
        load(tmp_path / "empty")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "config.json").write_text("{}")
    save_file({**reference_state(), "fc.weight": torch.zeros(2, 2)}, str(junk / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"unexpected tensors \['fc.weight'\]"):
        load(junk)
    with pytest.raises(ModelLoadError, match="needs a drafter trained for"):
        LLM(model=str(target), speculative_config={"decoding_type": "redrafter"})


@pytest.mark.parametrize("options, message", [
    ({"beam_width": 0}, "speculative_config.beam_width"),
    ({"beam_length": 1}, "speculative_config.beam_length"),
    ({"beam_length": 3, "max_draft_len": 4}, "beam_length: 3 tokens per beam means max_draft_len 2"),
    ({"beam_widht": 2}, "beam_widht"),
])
def test_bad_options_are_config_errors_with_their_path(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(speculative_config={"decoding_type": "redrafter", **options})


def test_loaded_drafter_equals_the_file(target, tmp_path):
    directory = reference_checkpoint(tmp_path / "drafter", exit_dim=96)
    llm = LLM(model=str(target), dtype="float32")
    model = load_drafter(directory, llm.engine.target)
    for key, value in reference_state(exit_dim=96).items():
        assert torch.equal(model.state_dict()[key], value), key
