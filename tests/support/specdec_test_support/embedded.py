"""specdec's own checks on the embedded model: the shipped drafters' greedy equality,
acceptance, prefix-cache reuse and sampling, and structured output, each against plain
decoding of the same model. The bundled plugins' tests and the core's use them; a
third-party plugin uses the public kit, :mod:`specdec.testing`, instead.

Greedy checks run the model as users run it, ``LLM()``'s defaults (on a CPU its GGUF's
4-bit blocks on the integer-dot kernels, compiled, batch-invariant, so that speculative
output is bit for bit plain output): every ``LLM`` of a process shares that compiled
target, which decodes several times faster than the float32 model. Sampling checks run
in float32, where the stock transformers model gives the exact distribution."""

from __future__ import annotations

import functools
import json

from specdec import LLM, SamplingParams
from specdec.executor.planner import FixedCosts
from specdec.model.loading import load_tokenizer, resolve_model_dir
from specdec.testing import check_sampling_lossless, first_divergence
from specdec.text_codec import TextCodec

#: Chat prompts on which drafters shipped for the embedded model are checked (not in any
#: training data or bench category).
SHIPPED_CHECK_PROMPTS = [
    [{"role": "user", "content": "Explain why the sky looks blue, in two sentences."}],
    [{"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes? Think step by step."}]]
SHIPPED_CHECK_PARAMS = SamplingParams(max_tokens=48, temperature=0.0)

#: Turns of an agent that repeats itself: the second and third restate the first's answer
#: (what drafting from text already seen predicts).
AGENT_TURNS = [
    "Write a Python function `area(w, h)` returning w * h, with a docstring.",
    "Now write the same function again but name it `rect_area`, keeping the docstring.",
    "Write the function `area(w, h)` once more, exactly as before.",
]


@functools.lru_cache(maxsize=1)
def embedded_llm() -> LLM:
    """``LLM()`` on the embedded model, plain, held for the whole process: while it lives,
    every ``LLM`` asking for the default target shares its compiled target, even after an
    ``LLM`` of another target was built in between."""
    return LLM()


@functools.lru_cache(maxsize=1)
def embedded_plain_chat() -> tuple:
    """Plain greedy answers of :func:`embedded_llm` to :data:`SHIPPED_CHECK_PROMPTS`
    (computed once per process)."""
    return tuple(embedded_llm().chat(SHIPPED_CHECK_PROMPTS, SHIPPED_CHECK_PARAMS))


def steady_costs(llm, step: float = 0.03, per_token: float = 5e-4, per_level: float = 2e-3) -> None:
    """Give ``llm``'s adaptive planner a fixed cost model (``step + per_token * tokens``
    seconds a step, ``per_level`` a drafted level) in place of the clock's, so that a test of
    its decisions does not depend on the machine's load."""
    llm.engine.planner.costs = FixedCosts(step, per_token, per_level)


def check_shipped_drafter(options: dict, min_length: float):
    """A drafter on the embedded model (``LLM()``'s defaults), drafting its full shape every step
    (``adaptive`` off unless ``options`` says otherwise): greedy output equals plain greedy
    output on :data:`SHIPPED_CHECK_PROMPTS`, and the acceptance length (tokens per target
    step) is at least ``min_length``. Returns the speculative ``LLM`` and the length."""
    spec = LLM(speculative_config={"adaptive": False, **options})
    got = spec.chat(SHIPPED_CHECK_PROMPTS, SHIPPED_CHECK_PARAMS)
    for i, (a, b) in enumerate(zip(embedded_plain_chat(), got)):
        assert b.token_ids == a.token_ids, f"prompt {i}: output departs from plain greedy at token " \
                                           f"{first_divergence(a.token_ids, b.token_ids)}"
    length = sum(len(o.token_ids) for o in got) / sum(o.metrics.num_steps for o in got)
    assert length >= min_length, f"{options}: acceptance length {length:.3f} < {min_length}"
    return spec, length


def check_shipped_prefix_cache(options: dict) -> None:
    """A repeated chat prompt on the embedded model is served from the prefix cache and
    drafted from exactly as the first time: greedy output equals plain greedy output, and
    the same drafts are proposed and accepted (the default target's numerics are
    batch-invariant, so the hidden states of the prompt tokens the target still runs do not
    depend on how many share the forward either). A drafter that reads every prompt token's hidden state gets
    the cached prefix's states from the engine; one that reads the newest only needs none."""
    llm = LLM(speculative_config={"adaptive": False, **options})
    assert llm.engine.batch_invariant, "the default target's numerics are not batch-invariant here"
    first, again = (llm.chat(SHIPPED_CHECK_PROMPTS[:1], SHIPPED_CHECK_PARAMS)[0] for _ in range(2))
    assert first.metrics.num_cached_prompt_tokens == 0 < again.metrics.num_cached_prompt_tokens
    assert again.token_ids == first.token_ids == embedded_plain_chat()[0].token_ids
    drafts = [(o.metrics.drafted_at, o.metrics.accepted_at) for o in (first, again)]
    assert drafts[0] == drafts[1] and first.metrics.num_accepted_tokens > 0, drafts


def check_shipped_sampling(options: dict, n: int = 250, question: str = "Name a color.",
                           params: SamplingParams | None = None) -> int:
    """:func:`check_sampling_lossless` on the embedded model (a short chat ``question``,
    temperature 1, top-k 4 unless ``params`` say otherwise); returns the accepted draft tokens."""
    codec = TextCodec(load_tokenizer(resolve_model_dir(None)))  # no model loaded for a prompt
    prompt = codec.apply_chat_template([{"role": "user", "content": question}])
    _, accepted = check_sampling_lossless(options, resolve_model_dir(None), prompt=prompt, n=n,
                                          params=params or SamplingParams(temperature=1.0, top_k=4))
    return accepted


def check_structured_sampling(options: dict, n: int = 250) -> int:
    """:func:`check_shipped_sampling` under a grammar (a regex of at least four colour
    words, so no output ends before the token checked): sampled output follows the masked,
    renormalised target distribution. Returns the accepted draft tokens."""
    params = SamplingParams(temperature=1.0, top_k=4,
                            structured_outputs={"regex": r"(red|green|blue)(, (red|green|blue)){3,6}"})
    return check_shipped_sampling(options, n, "List colors: red, green, blue, red, green, blue", params)


#: A JSON schema and chat prompts for structured output on the embedded model.
STRUCTURED_CHECK_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "age", "hobbies"]}
STRUCTURED_CHECK_PROMPTS = [
    [{"role": "user", "content": "Describe a person named Alice, 30, who likes chess, as JSON."}],
    [{"role": "user", "content": "Make up a character for a story and give name, age and hobbies in JSON."}]]
STRUCTURED_CHECK_PARAMS = SamplingParams(max_tokens=64, temperature=0.0,
                                         structured_outputs={"json": STRUCTURED_CHECK_SCHEMA})


def follows_check_schema(value) -> bool:
    """Whether ``value`` is an object :data:`STRUCTURED_CHECK_SCHEMA` accepts."""
    return (isinstance(value, dict) and isinstance(value.get("name"), str)
            and isinstance(value.get("age"), int) and not isinstance(value.get("age"), bool)
            and isinstance(value.get("hobbies"), list) and len(value["hobbies"]) <= 3
            and all(isinstance(h, str) for h in value["hobbies"]))


@functools.lru_cache(maxsize=1)
def embedded_plain_structured() -> tuple:
    """Plain greedy answers of the embedded model (``LLM()``'s defaults) to
    :data:`STRUCTURED_CHECK_PROMPTS` under :data:`STRUCTURED_CHECK_PARAMS` (computed once per
    process)."""
    return tuple(embedded_llm().chat(STRUCTURED_CHECK_PROMPTS, STRUCTURED_CHECK_PARAMS))


def check_structured_lossless(options: dict, min_accepted: int = 1):
    """Structured output under speculation is the constrained target's: on the embedded
    model (``LLM()``'s defaults), JSON-schema-constrained greedy output with the drafter (drafting
    every step unless ``options`` say ``adaptive: true``) equals plain constrained greedy
    output token for token, parses as JSON the schema accepts (or stops at ``max_tokens``),
    and at least ``min_accepted`` draft tokens were accepted. Returns the outputs."""
    spec = LLM(speculative_config={"adaptive": False, **options})
    got = spec.chat(STRUCTURED_CHECK_PROMPTS, STRUCTURED_CHECK_PARAMS)
    for i, (a, b) in enumerate(zip(embedded_plain_structured(), got)):
        assert b.token_ids == a.token_ids, (f"prompt {i}: constrained output departs from plain constrained greedy "
                                            f"at token {first_divergence(a.token_ids, b.token_ids)}")
        if b.finish_reason == "stop":
            assert follows_check_schema(json.loads(b.text)), f"prompt {i}: {b.text!r} does not follow the schema"
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert accepted >= min_accepted, f"{options}: {accepted} draft tokens accepted, expected >= {min_accepted}"
    return got


