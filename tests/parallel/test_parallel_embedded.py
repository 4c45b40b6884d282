"""The embedded model at three ranks (9 query heads and 3 KV heads: three and one a rank),
float32: a method of each kind of draft answers as one rank's plain decoding, with its
logprobs and stop strings, drafts accepted."""

from __future__ import annotations

from specdec import LLM, SamplingParams

ONE_THREAD = {"num_threads": 1}


def test_the_embedded_model_at_three_ranks_with_a_method_of_each_kind():
    """The embedded model has 9 query and 3 KV heads: three ranks of three and one. A
    method of each kind of draft answers as one rank's plain decoding, with the same
    logprobs, drafting: a model of its own (draft_target), the final state (MTP; EAGLE,
    Medusa and ReDrafter read the same one), three layers' states (EAGLE-3); a stop string
    ends the answer where it does at one rank. A drafter that reads none of the target's
    states (ngram) verifies as these do: it adds a group's start and nothing the others do
    not check. Plain decoding at several ranks: test_parallel.py's tiny models."""
    chat = [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."}]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
    stop = SamplingParams(max_tokens=32, temperature=0.0, stop=[" fox"])
    one = LLM(dtype="float32", engine={"num_threads": 2})
    reference, stopped = one.chat(chat, params)[0], one.chat(chat, stop)[0]
    for method in ("draft_target", "eagle3", "mtp"):
        with LLM(dtype="float32", tensor_parallel_size=3, engine=ONE_THREAD,
                 speculative_config={"decoding_type": method, "adaptive": False}) as llm:
            out = llm.chat(chat, params)[0]
            cut = llm.chat(chat, stop)[0] if method == "draft_target" else stopped
        assert out.token_ids == reference.token_ids, method
        for mine, theirs in zip(out.logprobs, reference.logprobs, strict=True):
            assert mine.keys() == theirs.keys(), method
            assert all(abs(mine[t] - theirs[t]) < 1e-3 for t in mine), method
        assert (cut.text, cut.finish_reason) == (stopped.text, stopped.finish_reason) and cut.text
        assert out.metrics.num_accepted_tokens > 0, f"{method}: no draft accepted"
        assert out.metrics.num_steps < len(out.token_ids), method
