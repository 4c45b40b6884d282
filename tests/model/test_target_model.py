"""The runner over unmodified transformers models of several architectures."""

import pytest
import torch

from conftest import reference_greedy, stock_model
from specdec import LLM, SamplingParams, testing

ARCHS = list(testing.TINY_ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_the_stock_model(tiny_models, arch):
    ref = stock_model(tiny_models[arch])
    llm = LLM(model=str(tiny_models[arch]), dtype="float32")
    prompts = [list(range(3, 15)), [40, 41, 42, 43, 44] * 3, [7, 8, 9]]  # longer than the sliding windows
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 16), f"{arch}: prompt {prompt}"


@pytest.mark.parametrize("arch", ["llama", "gemma2", "deepseek_v3"])
def test_tree_drafts_are_lossless_on_each_architecture(tiny_models, arch):
    """Trees holding the true continuation beside decoys: accepted paths are compacted in the
    KV cache on every architecture (sliding windows, MLA) and later steps read them."""
    prompts = [list(range(3, 15)), [40, 41, 42, 43, 44] * 3, [7, 8, 9]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(tiny_models[arch]), dtype="float32").generate(prompts, params)
    oracle = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    spec = {"decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 3, "adaptive": False,
            "options": {"tree": True, "seed": 2, "oracle": oracle}}  # full trees every step, planner aside
    outs = testing.check_greedy_lossless(spec, model=tiny_models[arch], prompts=prompts, min_accepted=10)
    assert all(o.metrics.acceptance_length > 1.3 for o in outs)


def test_each_request_of_a_batch_gets_the_hidden_states_of_its_own_committed_tokens(tiny_models):
    """Trees verified for several requests in one forward, paths of different lengths
    accepted: the states each result carries are the stock model's at exactly the
    positions it committed, every position once (the engine gathers them for the whole
    step at once and hands each request its slice)."""
    from helpers import OracleDrafter

    from specdec import hookimpl

    seen = []

    class WatchingOracle(OracleDrafter):
        @hookimpl
        def target_hidden_layers(self, target):
            return [0, -1]

        @hookimpl
        def on_draft_verified(self, results):
            seen.extend((r.request.request_id, r.start, {k: v.clone() for k, v in r.hidden_states.items()})
                        for r in results)

    model = tiny_models["llama"]
    prompts = [list(range(3, 15)), [40, 41, 42, 43, 44] * 3, [7, 8, 9]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = LLM(model=str(model), dtype="float32").generate(prompts, params)
    oracle = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    spec = {"decoding_type": "user", "drafter": WatchingOracle, "max_draft_len": 3, "adaptive": False,
            "options": {"tree": True, "seed": 3, "oracle": oracle}}
    outs = LLM(model=str(model), dtype="float32", speculative_config=spec).generate(prompts, params)
    assert sum(o.metrics.num_accepted_tokens for o in outs) >= 10
    ref = stock_model(model)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == oracle[tuple(prompt)]
        covered = {}
        for request_id, start, states in seen:
            if request_id == out.request_id:
                for k in range(states[-1].shape[0]):
                    assert start + k not in covered, f"position {start + k} handed over twice"
                    covered[start + k] = (states[0][k], states[-1][k])
        sequence = prompt + out.token_ids
        assert sorted(covered) == list(range(len(sequence) - 1))  # the last token is never run
        with torch.no_grad():
            want = ref.model(torch.tensor([sequence]), output_hidden_states=True)
        for position, (first_layer, final) in covered.items():
            torch.testing.assert_close(first_layer, want.hidden_states[1][0, position], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(final, want.last_hidden_state[0, position], atol=1e-4, rtol=1e-4)


def test_hidden_states_reach_the_drafter_without_recomputation(tiny_models):
    import sys
    import types

    from helpers import StateWatcher

    seen = StateWatcher.seen
    seen.clear()
    module = types.ModuleType("watcher_mod")
    module.Watcher = StateWatcher
    sys.modules["watcher_mod"] = module
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32",
              speculative_config={"decoding_type": "user", "drafter": "watcher_mod:Watcher"})
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    first_run = list(seen)
    # The same 40-token prompt twice: the second time its first full blocks come from the
    # prefix cache and are not run through the target; a drafter that reads every prompt
    # token still gets all 40 states, the cached ones exactly as first computed.
    long_prompt = list(range(1, 41))
    states = []
    for _ in range(2):
        seen.clear()
        out = llm.generate([long_prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
        prefills = [r for r in seen if r.is_prefill]
        assert len(prefills) == 1 and prefills[0].start == 0
        states.append((out.metrics.num_cached_prompt_tokens, prefills[0].hidden_states))
    (cold, first), (reused, again) = states
    assert cold == 0 and reused == 32
    for layer in (0, -1):
        assert first[layer].shape == again[layer].shape == (40, 64)
        assert torch.equal(again[layer][:reused], first[layer][:reused])
        # recomputed over cached keys: the attention sums in another order (on an H200 in
        # float32 up to 1.2e-5 apart), far less than a wrong position or a missing key moves them
        torch.testing.assert_close(again[layer][reused:], first[layer][reused:], atol=1e-4, rtol=1e-4)
    seen[:] = first_run
    prefill = seen[0]
    assert prefill.is_prefill and set(prefill.hidden_states) == {0, -1}
    assert prefill.hidden_states[-1].shape == (5, 64)
    # the final normalised state of the last prompt token, recomputed by the stock model, agrees
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.model(torch.tensor([[1, 2, 3, 4, 5]])).last_hidden_state[0]
    torch.testing.assert_close(prefill.hidden_states[-1].cpu(), want, atol=1e-4, rtol=1e-4)
    decode = seen[1]
    assert not decode.is_prefill and decode.hidden_states[0].shape == (1, 64)


def test_a_gguf_conversion_is_found_again_after_a_reinstall_and_stale_ones_go(tmp_path, monkeypatch):
    """The cache key is the file's size and the digest of its ends, not its modification
    time: reinstalling the embedded model's package must not convert (and store) it again."""
    import os

    from specdec.model import loading as models

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(os.urandom(3 * 2**20))
    first = models._converted_dir(gguf)
    os.utime(gguf, (1e9, 1e9))
    assert models._converted_dir(gguf) == first
    stale = first.parent / f"m-{3 * 2**20}-1795777160"  # an earlier version's key
    for d in (first, stale):
        d.mkdir(parents=True, exist_ok=True)
    models._remove_stale_conversions(gguf, first)
    assert first.exists() and not stale.exists()
    with gguf.open("r+b") as f:
        f.write(b"\x00" * 16)
    assert models._converted_dir(gguf) != first
