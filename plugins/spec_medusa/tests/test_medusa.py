"""The heads shipped for the embedded model: the default for medusa on it; greedy output
identical to plain greedy in float32 with drafts accepted, as the default tree and as a
chain; sampled output follows the target's distribution; typical acceptance is opt-in
and labelled lossy."""

import json
import subprocess
import sys

import pytest

from specdec import LLM, SamplingParams, testing
from specdec.models import resolve_model_dir
from specdec_medusa import SHIPPED_HEADS

PROMPTS = [[{"role": "user", "content": "Explain why the sky looks blue, in two sentences."}],
           [{"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes? Think step by step."}]]
PARAMS = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32").chat(PROMPTS, PARAMS)


@pytest.mark.parametrize("mode, min_length", [
    ({}, 1.4),  # measured 1.48
    ({"medusa_choices": [[0, 0, 0]]}, 1.25),  # 1.32
])
def test_shipped_heads_are_lossless_and_accepted(plain, mode, min_length):
    # the heads' acceptance at their full tree: the adaptive planner would trim it
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "medusa", "adaptive": False, **mode})
    assert (SHIPPED_HEADS / "config.json").exists() and spec.drafter.heads.shares_lm_head
    got = spec.chat(PROMPTS, PARAMS)
    for a, b in zip(plain, got):
        assert b.token_ids == a.token_ids
    length = sum(len(o.token_ids) for o in got) / sum(o.metrics.num_steps for o in got)
    assert length >= min_length, (mode, length)


@pytest.mark.parametrize("mode", [{"medusa_choices": [[0, 0]]}, {"medusa_choices": [[0, 0], [1], [0, 1]]}])
def test_sampled_output_follows_the_target(mode):
    path = resolve_model_dir(None)
    llm = LLM(dtype="float32")
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name a color."}])
    # adaptive off: three-token requests end before the planner has evidence to draft
    _, accepted = testing.check_sampling_lossless(
        {"decoding_type": "medusa", "speculative_model": str(SHIPPED_HEADS), "max_draft_len": 2, "adaptive": False,
         **mode}, path, prompt=prompt, n=250, params=SamplingParams(temperature=1.0, top_k=4))
    assert accepted > 0


def test_typical_acceptance_is_opt_in_and_labelled_lossy():
    listed = json.loads(subprocess.run([sys.executable, "-m", "specdec.cli", "plugins", "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    medusa = next(m for m in listed["decoding_types"] if m["name"] == "medusa")
    assert medusa["lossy_options"] == ["use_typical_acceptance"]
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=0)
    exact = LLM(dtype="float32", speculative_config={"decoding_type": "medusa"}).chat(PROMPTS[:1], params)[0]
    typical = LLM(dtype="float32", speculative_config={"decoding_type": "medusa", "use_typical_acceptance": True})
    out = typical.chat(PROMPTS[:1], params)[0]
    assert exact.metrics.lossless and not out.metrics.lossless
