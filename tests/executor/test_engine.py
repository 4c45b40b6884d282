"""The executor on the embedded model: exactness, batching, speculation, stop conditions, errors."""

import pytest
import torch
from helpers import first_divergence, near_tie_at
from specdec_test_support import embedded

from conftest import reference_greedy
from specdec import LLM, DraftProposal, SamplingParams, TreeMask, hookimpl
from specdec.errors import KVCacheFullError, RequestError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog was not amused and left.",
    "List three colors:",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(smol, smol_hf):
    return {p: reference_greedy(smol_hf, smol.encode(p), GREEDY.max_tokens, cached=True) for p in PROMPTS}


def assert_greedy_equal(model, llm, prompt, got, want):
    """Equal, or diverging only at a numerical near-tie, which is reported, not skipped."""
    i = first_divergence(got, want)
    if i is None:
        return
    tie, gap = near_tie_at(model, llm.encode(prompt), want, i)
    assert tie, f"{prompt!r}: diverges at token {i} with top-2 logit gap {gap:.2e} (not a near-tie)"
    print(f"near-tie at token {i} of {prompt!r}: top-2 gap {gap:.2e}")


def test_plain_greedy_equals_transformers_generate(smol, smol_hf):
    prompt = PROMPTS[0]
    ids = smol.encode(prompt)
    want = smol_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    got = smol.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0))[0].token_ids
    assert len(want) >= 8
    assert_greedy_equal(smol_hf, smol, prompt, got, want)


def test_plain_greedy_alone_and_in_a_mixed_length_batch(smol, smol_hf, references):
    for prompt in PROMPTS:
        assert_greedy_equal(smol_hf, smol, prompt, smol.generate(prompt, GREEDY)[0].token_ids, references[prompt])
    batch = smol.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, batch):
        assert_greedy_equal(smol_hf, smol, prompt, out.token_ids, references[prompt])
        assert out.metrics.num_steps == GREEDY.max_tokens - 1
        assert out.metrics.acceptance_length == 1.0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_any_draft_gives_the_plain_greedy_tokens(smol_hf, references, tree):
    llm = LLM(dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 5, "adaptive": False,
        "options": {"tree": tree, "seed": 1}})
    llm.drafter.oracle.update({tuple(llm.encode(p)): references[p] for p in PROMPTS})
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert_greedy_equal(smol_hf, llm, prompt, out.token_ids, references[prompt])
        assert out.metrics.num_accepted_tokens > 0, "the oracle drafts should be accepted sometimes"
        assert out.metrics.num_steps < GREEDY.max_tokens - 1
        emitted = out.metrics.num_steps + out.metrics.num_accepted_tokens
        assert emitted == len(out.token_ids) - 1


def test_near_tie_detector_tells_ties_from_real_divergence(smol, smol_hf, references):
    prompt = PROMPTS[0]
    ids = smol.encode(prompt)
    want = references[prompt]
    tie, gap = near_tie_at(smol_hf, ids, want, 3)
    assert not tie and gap > 1e-4
    with pytest.raises(AssertionError, match="not a near-tie"):
        wrong = list(want)
        wrong[3] = (wrong[3] + 1) % 1000
        assert_greedy_equal(smol_hf, smol, prompt, wrong, want)


def test_stop_conditions(smol, references):
    prompt = PROMPTS[0]
    full = smol.generate(prompt, GREEDY)[0]
    out = smol.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.token_ids == full.token_ids[:5] and out.finish_reason == "length"
    stop_word = full.text.split()[2]
    out = smol.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, stop=[stop_word]))[0]
    assert out.finish_reason == "stop" and stop_word not in out.text
    assert full.text.startswith(out.text)
    stop_id = full.token_ids[5]
    out = smol.generate(prompt, SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"
    chat = smol.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=200, temperature=0.0))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in smol.target.eos_token_ids


def test_sampling_seed_reproduces_output(smol):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    a = smol.generate(PROMPTS[1], params)[0].token_ids
    b = smol.generate(PROMPTS[1], params)[0].token_ids
    c = smol.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=8))[0].token_ids
    assert a == b and a != c


def test_bad_requests_fail_alone(smol):
    long_prompt = list(range(10, 10 + smol.engine.max_model_len + 5))
    with pytest.raises(RequestError, match="context holds"):
        smol.generate([long_prompt], GREEDY)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        smol.generate([[10**9]], GREEDY)
    assert smol.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0))[0].token_ids  # still serving


def test_kv_pool_too_small_for_a_request_is_a_clear_error(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"kv_cache_blocks": 2, "block_size": 4})
    with pytest.raises(KVCacheFullError, match="kv_cache_blocks"):
        llm.generate([list(range(20))], SamplingParams(max_tokens=10, temperature=0))
    out = llm.generate([[1, 2]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_preemption_under_kv_pressure_keeps_outputs_exact(tiny_models):
    prompts = [[i, i + 1, i + 2, i + 3, i + 5] * 3 for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLM(model=str(tiny_models["llama"]), dtype="float32").generate(prompts, params)
    tight = LLM(model=str(tiny_models["llama"]), dtype="float32",
                engine={"kv_cache_blocks": 24, "block_size": 4, "max_batch_size": 6})
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.engine.kv.pool.num_free == 24


def test_prefix_cache_reuses_blocks_and_output_is_unchanged(smol):
    shared = "You are a helpful assistant. Answer briefly and precisely. " * 4
    first = smol.generate(shared + "What is 2+2?", GREEDY)[0]
    second = smol.generate(shared + "What is 2+2?", GREEDY)[0]
    assert second.metrics.num_cached_prompt_tokens >= 32
    assert second.token_ids == first.token_ids


def test_abort_frees_blocks(smol):
    engine = smol.engine
    free_before = engine.kv.pool.num_free
    req = engine.add_request(smol.encode(PROMPTS[2]), SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free < free_before
    engine.abort(req.request_id)
    assert req.finish_reason == "abort"
    assert engine.kv.pool.num_free == free_before
    assert not engine.has_unfinished()


def test_chunked_prefill_matches_unchunked(tiny_models):
    prompt = list(range(3, 90))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    whole = LLM(model=str(tiny_models["qwen2"]), dtype="float32").generate([prompt], params)[0]
    chunked = LLM(model=str(tiny_models["qwen2"]), dtype="float32", engine={"max_num_tokens": 16})
    assert chunked.generate([prompt], params)[0].token_ids == whole.token_ids


def test_prompt_chunks_come_before_draft_nodes_in_the_token_budget(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"max_num_tokens": 32},
              speculative_config={"decoding_type": "ngram", "max_draft_len": 8})
    engine, params = llm.engine, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i, 6, 7, 8], params)
    engine.step()  # the three short prompts prefilled: they decode from now on
    engine.add_request(list(range(3, 100)), params)  # a long prompt arrives
    plan = engine.scheduler.schedule(draft_budget=8)
    assert len(plan.decodes) == 3 and plan.prefills[0][1] == 32 - 3  # the chunk takes all but the roots
    assert plan.draft_allowance == [0, 0, 0]
    decoding = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"max_num_tokens": 32},
                   speculative_config={"decoding_type": "ngram", "max_draft_len": 8}).engine
    for i in range(4):
        decoding.add_request([5 + i, 6, 7, 8], params)
    decoding.step()
    plan = decoding.scheduler.schedule(draft_budget=8)  # nothing to prefill: drafts get what is left
    assert plan.draft_allowance == [8, 8, 8, 32 - 4 - 24]


def test_draft_len_schedule_turns_speculation_off_for_large_batches(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32",
              speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "draft_len_schedule": {1: 4, 3: 0}})
    prompts = [[5, 6, 7, 8] * 5 for _ in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batch = llm.generate(prompts, params)
    assert all(o.metrics.num_draft_tokens == 0 for o in batch)
    alone = llm.generate(prompts[:1], params)[0]
    assert alone.metrics.num_draft_tokens > 0


def test_acceptance_switch_pauses_a_request_that_is_never_accepted(tiny_models):
    cfg = {"decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 3,
           "min_acceptance_rate": 0.5, "acceptance_window": 2, "retry_after": 5}
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", speculative_config=cfg)  # no oracle: random drafts
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    spec_steps = out.metrics.drafted_at[0]
    assert out.metrics.num_steps == 29
    assert spec_steps < 29 - 5, "speculation should pause after two rejected steps"
    assert spec_steps >= 3, "and try again after retry_after steps"


def test_metrics_names(smol):
    llm = LLM(dtype="float32", speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False})
    text = "one two three four five six seven eight nine ten. " * 3
    out = llm.generate("Repeat exactly: " + text, SamplingParams(max_tokens=40, temperature=0))[0]
    m = out.metrics
    assert m.num_steps > 0 and m.num_draft_tokens >= m.num_accepted_tokens > 0
    assert m.acceptance_length == pytest.approx(m.num_decode_tokens / m.num_steps)
    assert m.acceptance_length > 1.0
    assert len(m.per_position_acceptance) == 4 and all(0 <= x <= 1 for x in m.per_position_acceptance)
    assert m.time_to_first_token is not None and m.time_to_first_token > 0


def test_engine_applies_an_opt_in_lossy_rule(tiny_models):
    from specdec.sampler.lossy import RelaxedAcceptance

    spec = {"decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 3, "adaptive": False,
            "options": {"seed": 4}}
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompt = [[3, 4, 5, 6, 7]]
    exact = LLM(model=str(tiny_models["llama"]), dtype="float32", speculative_config=spec)
    relaxed = LLM(model=str(tiny_models["llama"]), dtype="float32", speculative_config=spec)
    relaxed.engine.verifier.acceptance_rule = RelaxedAcceptance(topk=128, delta=1.0)  # admits any token
    a = exact.generate(prompt, params)[0]
    b = relaxed.generate(prompt, params)[0]
    assert b.metrics.num_accepted_tokens == b.metrics.num_draft_tokens  # every draft accepted
    assert a.metrics.num_accepted_tokens < a.metrics.num_draft_tokens
    assert a.token_ids != b.token_ids
    assert a.metrics.lossless and not b.metrics.lossless  # the lossy run is labelled so


def test_kv_pool_sized_by_memory_fraction(tiny_models):
    from specdec.executor.kv_budget import free_memory_bytes

    small = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"kv_cache_memory_fraction": 0.001})
    per_block = small.engine.config.block_size * 2 * 2 * 2 * 16 * 4  # layers * (k+v) * kv_heads * dim * bytes
    expected = int(free_memory_bytes(small.device) * 0.001 // per_block)
    assert abs(small.engine.kv.pool.num_blocks - expected) <= max(2, expected // 20)


def test_stream_yields_pieces_as_tokens_are_accepted(smol):
    pieces = list(smol.stream(PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.0)))
    assert len(pieces) > 3
    assert "".join(pieces) == smol.last_output.text


def test_model_without_tokenizer_takes_token_ids_only(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32")
    with pytest.raises(RequestError, match="no tokenizer: give prompts as lists of token ids"):
        llm.generate("hello", GREEDY)


def test_repetition_penalty_changes_greedy_output(smol):
    prompt = "Repeat forever: la la la la la la"
    plain = smol.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
    penalised = smol.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5))[0]
    assert penalised.token_ids != plain
    assert len(set(penalised.token_ids)) > len(set(plain))


class _WideTreeDrafter:
    """Proposes trees far larger than allowed (a wide first level), to test the node budget."""

    proposals: list = []

    def __init__(self, config, target):
        self.vocab = target.vocab_size

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        out = []
        for req, k, n in zip(requests, draft_lens, max_nodes):
            assert n >= k
            tokens = [(req.token_ids[-1] + i) % self.vocab for i in range(3 * n + 5)]
            parents = [-1] * len(tokens)
            out.append(DraftProposal(token_ids=tokens, parents=parents))
        return out


def test_node_budget_is_respected_under_load(tiny_models):
    import sys
    import types

    module = types.ModuleType("wide_tree_mod")
    module.Drafter = _WideTreeDrafter
    sys.modules["wide_tree_mod"] = module
    model = str(tiny_models["llama"])
    prompts = [[i + 1, i + 2, i + 3] * 4 for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(model=model, dtype="float32").generate(prompts, params)
    llm = LLM(model=model, dtype="float32", engine={"max_num_tokens": 24, "max_batch_size": 6},
              speculative_config={"decoding_type": "user", "drafter": "wide_tree_mod:Drafter", "max_draft_len": 3,
                                  "max_total_draft_tokens": 5})
    sizes, nodes = [], []
    forward = llm.engine.forward

    def watch(items):
        sizes.append(sum(len(it.tokens) for it in items))
        nodes.extend(len(it.proposal.token_ids) for it in items if it.proposal is not None)
        return forward(items)

    llm.engine.forward = watch
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert max(sizes) <= 24, sizes
    assert nodes and max(nodes) <= 5 and 5 in nodes


def test_a_preempted_request_whose_context_is_all_cached_still_finishes(w4a8):
    """Issue 10's hang: preemption exactly at a block boundary with prefix caching on (the
    default target eager: the engine's scheduling is the subject, not float32 numerics)."""
    llm = LLM(engine={"compile": False, "kv_cache_blocks": 33, "block_size": 4, "max_batch_size": 6})
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] * 4 for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [llm.engine.add_request(p, params) for p in prompts]
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    assert llm.engine.scheduler.num_preemptions > 0, "the cache had room: nothing was preempted"
    roomy = w4a8.generate(prompts, params)  # a cache with room to spare
    assert [r.output_token_ids for r in reqs] == [o.token_ids for o in roomy]


STOP_PROMPTS = [[{"role": "user", "content": "List the days of the week, one per line."}],
                [{"role": "user", "content": "List the numbers from 1 to 12 separated by commas."}]]


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft_target", "eagle", "eagle3"])
def test_stop_strings_end_speculative_output_at_the_same_token_as_plain_output(method, caplog):
    """Accepted drafts past the token completing a stop string are dropped (issue 10). On
    the compiled default target the draft modules compile too (no eager fallback)."""
    params = SamplingParams(max_tokens=64, temperature=0.0, stop=["Thursday", "7,"])
    plain = embedded.embedded_llm().chat(STOP_PROMPTS, params)
    assert [o.finish_reason for o in plain] == ["stop", "stop"]
    llm = LLM(speculative_config={"decoding_type": method, "adaptive": False})
    assert "did not compile" not in caplog.text
    got = llm.chat(STOP_PROMPTS, params)
    assert llm.engine.planner.min_rows == llm.target.lone_token_rows == 2  # the planner prices the graph's rows
    for a, b in zip(plain, got):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, "stop")
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0 or method in ("ngram", "lookahead")


def test_a_bad_prompt_among_good_ones_queues_none_of_them(smol):
    """Issue 10: the good prompts before a bad one used to stay queued and run in the next call."""
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        smol.generate([[1, 2, 3], [4, 5, 6], [10**9]], params)
    assert not smol.engine.has_unfinished() and not smol.engine.requests
    outs = smol.generate([[7, 8, 9]], params)
    assert len(outs) == 1 and len(outs[0].token_ids) == 4


def test_each_prompt_may_have_its_own_sampling_params(smol, smol_hf):
    """vLLM's form: ``generate(prompts, [params, ...])``, one per prompt, each request served
    as it would be alone; a list of the wrong length or of other things is a clear error."""
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.0, stop=["\n"])]
    together = smol.generate(PROMPTS[:3], params)
    alone = [smol.generate(p, sp)[0] for p, sp in zip(PROMPTS[:3], params)]
    assert [len(o.token_ids) for o in together][:2] == [5, 12]
    for i in (0, 2):
        assert_greedy_equal(smol_hf, smol, PROMPTS[i], together[i].token_ids, alone[i].token_ids)
    assert together[1].token_ids == alone[1].token_ids  # its own seed, whatever shares the batch
    assert together[2].finish_reason == alone[2].finish_reason
    with pytest.raises(RequestError, match="2 given for 3 prompts"):
        smol.generate(PROMPTS[:3], params[:2])
    with pytest.raises(RequestError, match="a list of other things"):
        smol.generate(PROMPTS[:2], [params[0], {"max_tokens": 3}])
    assert not smol.engine.has_unfinished() and not smol.engine.requests


def test_code_written_for_vllm_runs_unchanged(smol, capsys):
    """vLLM's forms: prompts as ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``,
    ``use_tqdm``, ``out.outputs[0]``, ``get_tokenizer()``; an unknown form is a clear error."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    plain = smol.generate(PROMPTS[:3], params)
    vllm_prompts = [{"prompt": PROMPTS[0]}, {"prompt_token_ids": smol.encode(PROMPTS[1])}, PROMPTS[2]]
    outs = smol.generate(vllm_prompts, params, use_tqdm=True)
    assert "3/3" in capsys.readouterr().err  # the progress bar, on stderr
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.prompt for o in outs] == [PROMPTS[0], None, PROMPTS[2]]
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in outs[1].outputs] == [
        (0, outs[1].text, outs[1].token_ids, outs[1].finish_reason)]
    assert smol.get_tokenizer() is smol.tokenizer
    with pytest.raises(RequestError, match="a prompt is a string, a list of token ids"):
        smol.generate([{"text": "x"}], params)


class _FaultyOracle:
    """Drafts each prompt's true greedy continuation, except where ``fault`` breaks it."""

    def __init__(self, fault: str, oracle: dict, victim: int):
        self.fault, self.oracle, self.victim = fault, oracle, victim  # victim: prompt length to break

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        if self.fault == "raise":
            raise RuntimeError("drafter bug")
        out = []
        for req, k in zip(requests, draft_lens):
            done = req.num_output_tokens
            tokens = self.oracle[tuple(req.token_ids[:req.prompt_len])][done:done + k]
            if not tokens:
                out.append(None)
            elif self.fault == "bad_ids" and req.prompt_len == self.victim:
                out.append(DraftProposal(token_ids=[10**6, *tokens[1:]]))
            elif self.fault == "bad_probs" and req.prompt_len == self.victim:
                out.append(DraftProposal(token_ids=tokens, draft_probs=torch.ones(len(tokens), 3)))
            else:
                out.append(DraftProposal(token_ids=tokens))
        return out

    @hookimpl
    def build_tree_mask(self, request, proposal):
        if self.fault == "mask_raises" and request.prompt_len == self.victim:
            raise ValueError("mask bug")
        if self.fault == "bad_mask" and request.prompt_len == self.victim:
            return TreeMask(mask=torch.ones(1, 1, dtype=torch.bool), position_offsets=torch.arange(1))
        return None

    @hookimpl
    def on_draft_verified(self, results):
        if self.fault == "verified_raises":
            raise RuntimeError("observer bug")


@pytest.mark.parametrize("fault", ["raise", "bad_ids", "bad_probs", "mask_raises", "bad_mask", "verified_raises"])
def test_drafter_faults_cost_drafts_never_output_and_are_counted(tiny_models, fault, caplog):
    """Issue 10: every proposal is validated and every drafter hook guarded; a fault drops
    that request's drafts for the step only, is counted per request and logged once."""
    model = str(tiny_models["llama"])
    prompts = [[i + 1, i + 2, i + 3] * 4 for i in range(2)] + [[9, 8, 7, 6, 5]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(model=model, dtype="float32").generate(prompts, params)
    oracle = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    llm = LLM(model=model, dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": _FaultyOracle(fault, oracle, victim=5), "max_draft_len": 3,
        "adaptive": False})  # every step asks the drafter
    with caplog.at_level("ERROR", logger="specdec.executor.engine"):
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    faults = [o.metrics.num_drafter_faults for o in outs]
    logged = [r for r in caplog.records if "decode without drafts" in r.getMessage()]
    assert len(logged) == 1 and sum(llm.engine.drafter_faults.values()) == sum(faults)
    # every step that drafts (all but the last, which has no room left for drafts)
    if fault in ("raise", "verified_raises"):  # every request
        assert all(f >= o.metrics.num_steps - 1 > 0 for f, o in zip(faults, outs))
    else:  # only the victim; the others keep their accepted drafts
        assert faults[2] >= outs[2].metrics.num_steps - 1 > 0 and outs[2].metrics.num_accepted_tokens == 0
        assert faults[:2] == [0, 0] and all(o.metrics.num_accepted_tokens > 0 for o in outs[:2])
    if fault == "verified_raises":
        assert all(o.metrics.num_accepted_tokens > 0 for o in outs)  # drafts still verified and kept


def test_drafter_faults_show_in_stats_metrics_and_bench(tiny_models, capsys):
    from specdec.bench.runner import CategoryResult
    from specdec.cli import _print_stats
    from specdec.serving.async_engine import engine_stats
    from specdec.serving.metrics import ServerMetrics

    model = str(tiny_models["llama"])
    llm = LLM(model=model, dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": _FaultyOracle("raise", {}, victim=0), "max_draft_len": 3,
        "adaptive": False})  # every step asks the drafter
    outs = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    steps = outs[0].metrics.num_drafter_faults
    assert steps >= outs[0].metrics.num_steps - 1 > 0
    _print_stats(outs, 1.0)
    assert f"drafter faults {steps}" in capsys.readouterr().err
    exposed = ServerMetrics().render(engine_stats(llm.engine), 0).decode()
    assert f'specdec_drafter_faults_total{{decoding_type="user"}} {float(steps)}' in exposed
    result = CategoryResult(metrics=outs[0].metrics)
    assert result.summary()["drafter_faults"] == steps


@pytest.mark.parametrize("method", ["draft_target", "eagle3"])  # model drafters: the penalty defeats copying
def test_repetition_penalty_with_speculation_equals_plain(method):
    """The penalty is applied to every draft row with that row's own history (the drafts
    before it): speculative greedy output with a penalty is the plain one."""
    prompt = "Repeat this list twice: apple, pear, plum, fig, apple, pear, plum, fig."
    params = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.2)
    plain = embedded.embedded_llm().generate(prompt, params)[0]
    got = LLM(speculative_config={"decoding_type": method, "adaptive": False}).generate(prompt, params)[0]
    assert got.token_ids == plain.token_ids
    assert got.metrics.num_accepted_tokens > 0


def test_randomized_kv_pressure_every_request_finishes_with_roomy_outputs(tiny_models):
    """Issue 10: many workloads, pool and block sizes, prefix caching on and off, with and
    without drafts; the engine never stalls and every output equals a roomy cache's."""
    import random

    model = str(tiny_models["llama"])
    rng = random.Random(0)
    roomy = LLM(model=model, dtype="float32")
    roomy_outputs: dict = {}
    preempted = 0
    for trial in range(12):
        shared = [rng.randrange(1, 120) for _ in range(rng.choice([0, 4, 9]))]
        prompts = [shared + [rng.randrange(1, 120) for _ in range(rng.randrange(1, 10))]
                   for _ in range(rng.randrange(2, 7))]
        params = SamplingParams(max_tokens=rng.randrange(8, 30), temperature=0.0, ignore_eos=True)
        block = rng.choice([2, 4, 8])
        longest = max(len(p) for p in prompts) + params.max_tokens
        blocks = -(-longest // block) + rng.randrange(0, 12)  # from "one request fits" upwards
        spec = {"decoding_type": "ngram", "max_draft_len": rng.choice([2, 5])} if trial % 2 else None
        llm = LLM(model=model, dtype="float32", speculative_config=spec,
                  engine={"kv_cache_blocks": blocks, "block_size": block, "max_batch_size": rng.choice([2, 4, 6]),
                          "enable_prefix_caching": bool(rng.randrange(2))})
        reqs = [llm.engine.add_request(p, params) for p in prompts]
        steps = 0
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
            assert steps < 20 * len(prompts) * params.max_tokens, f"trial {trial}: the engine stopped making progress"
        preempted += llm.engine.scheduler.num_preemptions
        for p, r in zip(prompts, reqs):
            key = (tuple(p), params.max_tokens)
            if key not in roomy_outputs:
                roomy_outputs[key] = roomy.generate([p], params)[0].token_ids
            assert r.output_token_ids == roomy_outputs[key], f"trial {trial}"
        assert llm.engine.kv.pool.num_free == blocks  # every block back in the pool
    assert preempted > 0  # the pools were small enough to preempt


@pytest.mark.parametrize("method", ["ngram", "medusa"])  # chains, and trees whose paths leave first children
def test_logprobs_are_the_targets_own_at_every_generated_token(smol_hf, method):
    """``SamplingParams.logprobs``: each generated token's log-probability and the top ones
    at its position equal the stock model's log-softmax there, for tokens that came from
    verified drafts as for the others, greedy or sampled, a stop string cutting the step."""
    spec = LLM(dtype="float32", speculative_config={"decoding_type": method, "adaptive": False})
    copy = "Repeat exactly: 1. Apple 2. Banana 3. Cherry 4. Date 5. Elderberry 6. Fig\nRepeat: 1. Apple"
    params = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=3),
              SamplingParams(max_tokens=24, temperature=0.8, seed=1, logprobs=0, stop=["5."]),
              SamplingParams(max_tokens=8, temperature=0.0)]
    outs = spec.generate([copy, copy, PROMPTS[0]], params)
    assert outs[0].metrics.num_accepted_tokens > 0 and outs[1].metrics.num_accepted_tokens > 0
    assert outs[1].finish_reason == "stop" and outs[2].logprobs is None
    for out, sp in zip(outs[:2], params):
        with torch.no_grad():
            logits = smol_hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(out.prompt_token_ids) - 1:-1], dim=-1)
        assert len(out.logprobs) == len(out.token_ids)
        for row, token, entry in zip(reference, out.token_ids, out.logprobs):
            assert next(iter(entry)) == token
            assert entry[token] == pytest.approx(float(row[token]), abs=1e-4)
            top = row.topk(sp.logprobs + 1)
            if sp.logprobs and top.values[-2] - top.values[-1] > 1e-4:  # not a tie at the k-th place
                assert set(entry) == {token, *top.indices[:-1].tolist()}
            for t, value in entry.items():
                assert value == pytest.approx(float(row[t]), abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token_across_chunks_and_the_prefix_cache(smol_hf):
    """``SamplingParams.prompt_logprobs``: each prompt token after the first scored as the stock
    model scores it, the prompt run in several chunks; a request asking it runs its whole
    prompt even where the prefix cache holds it (cached tokens are not run)."""
    llm = LLM(dtype="float32", engine={"max_num_tokens": 16, "enable_prefix_caching": True})
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    warm = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))[0]
    scored = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    assert again.metrics.num_cached_prompt_tokens > 0 and scored.metrics.num_cached_prompt_tokens == 0
    assert scored.token_ids == warm.token_ids and scored.logprobs is None
    ids = scored.prompt_token_ids
    assert len(ids) > 32 and scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids)
    with torch.no_grad():
        reference = torch.log_softmax(smol_hf(torch.tensor([ids])).logits[0], dim=-1)
    for row, token, entry in zip(reference, ids[1:], scored.prompt_logprobs[1:]):
        assert next(iter(entry)) == token and len(entry) in (2, 3)
        for t, value in entry.items():
            assert value == pytest.approx(float(row[t]), abs=1e-4)


PENALIZED = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, frequency_penalty=2.0,
                           presence_penalty=2.0, repetition_penalty=1.3, logit_bias={7: 3.0, 11: -100.0})


def penalized_reference(model, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """Greedy continuation of the stock model with OpenAI's penalties written out step by step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            seen = torch.tensor(sorted(set(seq)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / params.repetition_penalty,
                                       logits[seen] * params.repetition_penalty)
            for token in set(seq[len(prompt):]):
                logits[token] -= params.frequency_penalty * seq[len(prompt):].count(token) + params.presence_penalty
            for token, bias in params.logit_bias.items():
                logits[token] += bias
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_penalties_and_biases_are_lossless_under_speculation(tiny_models, tree):
    """Frequency, presence and repetition penalties and logit_bias depend on the tokens before
    each verified position: with drafts accepted, the output equals plain decoding's, which
    equals the stock model's greedy continuation with the penalties written out."""
    from conftest import stock_model

    prompts = [[3, 4, 5, 6, 7, 3, 4, 5, 6, 7], [20, 21, 22, 20, 21, 22, 20], [9, 8, 9, 8, 9], [40, 41, 42]]
    plain = LLM(model=str(tiny_models["llama"]), dtype="float32").generate(prompts, PENALIZED)
    reference = stock_model(tiny_models["llama"])
    for prompt, out in zip(prompts, plain):
        assert out.token_ids == penalized_reference(reference, prompt, PENALIZED, PENALIZED.max_tokens)
        assert 11 not in out.token_ids
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 6, "adaptive": False,
        "options": {"tree": tree, "seed": 3}})
    llm.drafter.oracle.update({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    outs = llm.generate(prompts, PENALIZED)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 5


def test_min_tokens_holds_back_eos_and_stop_ids(tiny_models):
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32")
    prompt = [[3, 4, 5]]
    first = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids[0]
    short = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,)))[0]
    assert short.token_ids == [first] and short.finish_reason == "stop"
    held = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,),
                                               min_tokens=5))[0]
    assert first not in held.token_ids[:5] and len(held.token_ids) >= 5
    with pytest.raises(RequestError, match="logit_bias"):
        llm.generate(prompt, SamplingParams(logit_bias={10**6: 1.0}))


def test_sampled_output_with_penalties_follows_the_penalized_target(tiny_models):
    from specdec import testing

    prompt = list(range(3, 11)) * 2
    params = SamplingParams(temperature=1.0, top_k=5, frequency_penalty=1.5, presence_penalty=0.5,
                            logit_bias={12: 2.0})
    # position 2: the first token sampled from a draft node's row, whose history holds a drafted token
    _, accepted = testing.check_sampling_lossless({"decoding_type": "ngram", "max_draft_len": 4},
                                                  tiny_models["llama"], prompt, n=800, params=params, position=2,
                                                  device="cpu")
    assert accepted > 0
