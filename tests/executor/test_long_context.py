"""Long prompts through the default CPU target (the GGUF's 4-bit blocks on the integer-dot
kernels): a prompt of hundreds to thousands of tokens is prefilled in chunks of the step's
token budget (512), and a chunk that keeps no logits multiplies no rows through the head.
Outputs equal plain decoding's, alone and batched with short requests."""

import subprocess
import sys
import textwrap

import pytest
from helpers import count_accepted_by_source, long_document_prompt
from specdec_test_support.embedded import steady_costs

from specdec import LLM, SamplingParams
from specdec.errors import RequestError
from specdec.kernels import int8_dot

pytestmark = pytest.mark.skipif(not int8_dot.kernel_available(), reason="the integer-dot kernels are not built here")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
#: prompt lengths: past one chunk, past three, and past seven (4,100 keys a row)
LENGTHS = [600, 2000, 4100]


def test_a_first_prompt_of_600_tokens_in_a_fresh_process():
    """The reproduction of the crash: the first request of a process, 600 tokens. Its first
    512-token chunk keeps no logits, and the head's product of zero rows divided by zero
    inside the kernel (SIGFPE). Run eagerly: the kernel is the same as compiled."""
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from helpers import long_document_prompt
        from specdec import LLM, SamplingParams
        llm = LLM(engine={"compile": False})
        assert llm.config.engine.quantization == "w4a8", llm.config.engine.quantization
        out = llm.generate([{"prompt_token_ids": long_document_prompt(llm.get_tokenizer(), 600)}],
                           SamplingParams(max_tokens=8, temperature=0))[0]
        print(len(out.token_ids))
    """)
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.strip() == "8"


@pytest.fixture(scope="module")
def default_target():
    return LLM(engine={"compile": False})


@pytest.fixture(scope="module")
def prompts(default_target):
    tok = default_target.get_tokenizer()
    return {n: long_document_prompt(tok, n) for n in LENGTHS}


@pytest.fixture(scope="module")
def alone(default_target, prompts):
    """Each long prompt's plain greedy answer, run alone."""
    return {n: default_target.generate([ids], GREEDY)[0].token_ids for n, ids in prompts.items()}


def test_long_prompts_batched_with_short_ones_answer_as_alone(default_target, prompts, alone):
    short = [default_target.apply_chat_template([{"role": "user", "content": "Name a color."}]), [1, 2, 3]]
    short_alone = [o.token_ids for o in default_target.generate(short, GREEDY)]
    batch = [prompts[600], short[0], prompts[4100], short[1], prompts[2000]]
    outs = default_target.generate(batch, GREEDY)
    assert [o.token_ids for o in outs] == [alone[600], short_alone[0], alone[4100], short_alone[1], alone[2000]]
    assert all(len(o.token_ids) > 0 for o in outs)
    assert default_target.engine.kv.pool.usage() == 0 or not default_target.engine.has_unfinished()


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_speculation_on_long_prompts_equals_plain(default_target, prompts, alone, method):
    """Drafts verified at thousands of positions (the prompt lookup finds the document's own
    text; EAGLE-3 reads the target's states of every chunk): plain decoding's answer."""
    spec = LLM(engine={"compile": False}, speculative_config={"decoding_type": method, "adaptive": False})
    outs = spec.generate([prompts[n] for n in LENGTHS] + [[1, 2, 3]], GREEDY)
    for n, out in zip(LENGTHS, outs):
        assert out.token_ids == alone[n], f"{method}, {n} tokens"
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_a_lookup_beside_eagle3_under_the_planner_on_long_prompts_batched_with_a_short_one(
        default_target, prompts, monkeypatch):
    """EAGLE-3 with suffix decoding as its lookup (``speculative_config.lookup``), the
    adaptive planner on a fixed cost model (its choices then do not follow the machine's
    load): the answers to documents of 2,000 and 600 tokens, which quote them, beside a
    short chat, equal plain decoding's, and drafts of both were accepted."""
    params = SamplingParams(max_tokens=48, temperature=0.0)
    batch = [prompts[2000], default_target.apply_chat_template([{"role": "user", "content": "Name a color."}]),
             prompts[600]]
    want = [o.token_ids for o in default_target.generate(batch, params)]
    accepted = count_accepted_by_source(monkeypatch)
    spec = LLM(engine={"compile": False},
               speculative_config={"decoding_type": "eagle3", "lookup": {"decoding_type": "suffix"}})
    steady_costs(spec)
    assert [o.token_ids for o in spec.generate(batch, params)] == want
    assert accepted["lookup"] > 0 and accepted["method"] > 0, accepted


def test_a_prompt_past_the_context_is_a_clear_error_and_the_engine_goes_on(prompts):
    """At a context of 1,024 tokens (``engine.max_model_len``; the model's own 8,192 is
    checked the same way, and the prompts above attend 4,100 keys): a longer prompt is
    refused naming both lengths, one that fills the context but a token ends there with
    finish reason ``length``, and the engine serves the next request."""
    llm = LLM(engine={"compile": False, "max_model_len": 1024})
    limit = llm.engine.max_model_len
    assert limit == 1024
    too_long = prompts[4100][:limit + 10]
    with pytest.raises(RequestError, match=f"the prompt has {limit + 10} tokens but the context holds {limit}"):
        llm.generate([too_long], GREEDY)
    out = llm.generate([too_long[:limit - 1]], SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert llm.generate([prompts[600]], GREEDY)[0].token_ids  # still serving
