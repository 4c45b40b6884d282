"""Per-request sampling parameters (the names vLLM and the OpenAI API use)."""

from __future__ import annotations

import attrs

from .errors import FieldError

#: temperatures below this are greedy: dividing logits by them would overflow
GREEDY_BELOW = 1e-5
#: the most top tokens a request may ask log-probabilities of at each position (OpenAI's limit)
MAX_LOGPROBS = 20


def _check_range(lo, hi, lo_open=False):
    def check(inst, attribute, value):
        if value is None:
            return
        bad = value <= lo if lo_open else value < lo
        if bad or (hi is not None and value > hi):
            left = "(" if lo_open else "["
            right = f"{hi}]" if hi is not None else "inf)"
            raise FieldError(attribute.name, f"must be in {left}{lo}, {right}, got {value!r}")
    return check


def _tuple_of_str(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _check_stop(inst, attribute, value):
    for stop in value:
        if not isinstance(stop, str) or not stop:
            raise FieldError(attribute.name, f"each stop string must be a non-empty string, got {stop!r}")


def _check_logit_bias(inst, attribute, value):
    for token, bias in (value or {}).items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise FieldError(attribute.name, f"keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise FieldError(attribute.name, f"values must be numbers in [-100, 100], got {bias!r} for token {token}")


def _choices(value) -> tuple[str, ...] | None:
    return None if value is None else tuple(value)


@attrs.frozen(kw_only=True)
class StructuredOutputs:
    """A grammar the output must follow (vLLM's ``structured_outputs`` fields); exactly one
    of them is given.

    Attributes:
        json: a JSON schema (a dict, or its text); the output is one JSON value it accepts.
        json_object: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar, in Lark or GBNF (llama.cpp's) syntax.
    """

    json: dict | str | None = attrs.field(default=None, hash=False)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = None

    def __attrs_post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise FieldError("structured_outputs", "give exactly one of json, json_object, regex, choice, grammar; "
                                                   f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise FieldError("structured_outputs.json", f"must be a JSON schema (an object or its text), "
                                                        f"got {type(self.json).__name__}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise FieldError("structured_outputs.choice", "must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise FieldError(f"structured_outputs.{name}", "must be a string")

    @property
    def kind(self) -> str:
        """The field given."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


def _structured_outputs(value) -> StructuredOutputs | None:
    if isinstance(value, dict):
        unknown = set(value) - {f.name for f in attrs.fields(StructuredOutputs)}
        if unknown:
            raise FieldError("structured_outputs", f"unknown fields {sorted(unknown)}; give one of json, "
                                                   "json_object, regex, choice, grammar")
        return StructuredOutputs(**value)
    return value


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: the most tokens to generate; 0 runs the prompt alone (to score it with
            ``prompt_logprobs``).
        temperature: 0 means greedy (as does anything below 1e-5, whose division would
            overflow, as in vLLM); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        min_p: drop tokens whose probability is below min_p times the top probability.
        repetition_penalty: >1 discourages tokens already in prompt or output (CTRL-style);
            0.01 to 100.
        seed: per-request seed; the same seed reproduces the same output.
        stop: strings that end generation (not included in the text).
        stop_token_ids: extra token ids that end generation.
        ignore_eos: keep generating past the end-of-sequence token.
        logprobs: return each generated token's log-probability under the target (its own
            distribution: before temperature, top-k/p, min-p and the repetition penalty,
            as vLLM's default) with those of the ``logprobs`` most likely tokens at its
            position (0: the generated token's alone; at most 20); None: none.
        prompt_logprobs: the same for every prompt token after the first (vLLM's name);
            such a request does not reuse the prefix cache, since cached tokens are not run.
        frequency_penalty: subtracted from a token's logit once per time it occurs in the
            output so far (OpenAI's; -2 to 2).
        presence_penalty: subtracted from the logit of every token the output holds so far
            (OpenAI's; -2 to 2).
        logit_bias: token id -> a value added to its logit (OpenAI's; -100 to 100).
        min_tokens: EOS and ``stop_token_ids`` are not sampled before this many output tokens.
        structured_outputs: a grammar every output token must follow; the target's
            distribution at each position is masked to the tokens it allows and
            renormalised (logprobs too), and the output ends with EOS once it is complete.
        extra_args: options for drafting plugins, by name (vLLM's name), e.g.
            ``{"suffix_cache": False}``: this request's text never enters suffix decoding's
            shared cache. They never change output.
    """

    max_tokens: int = attrs.field(default=64, validator=_check_range(0, None))
    temperature: float = attrs.field(default=1.0, validator=_check_range(0.0, None))
    top_k: int = attrs.field(default=0, validator=_check_range(0, None))
    top_p: float = attrs.field(default=1.0, validator=_check_range(0.0, 1.0, lo_open=True))
    min_p: float = attrs.field(default=0.0, validator=_check_range(0.0, 1.0))
    repetition_penalty: float = attrs.field(default=1.0, validator=_check_range(0.01, 100.0))
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str, validator=_check_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False
    logprobs: int | None = attrs.field(default=None, validator=_check_range(0, MAX_LOGPROBS))
    prompt_logprobs: int | None = attrs.field(default=None, validator=_check_range(0, MAX_LOGPROBS))
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_range(-2.0, 2.0))
    presence_penalty: float = attrs.field(default=0.0, validator=_check_range(-2.0, 2.0))
    logit_bias: dict[int, float] | None = attrs.field(default=None, hash=False, validator=_check_logit_bias)
    min_tokens: int = attrs.field(default=0, validator=_check_range(0, None))
    structured_outputs: StructuredOutputs | None = attrs.field(default=None, hash=False,
                                                               converter=_structured_outputs)
    extra_args: dict | None = attrs.field(default=None, hash=False)

    def __attrs_post_init__(self):
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            raise FieldError("structured_outputs", "cannot be combined with ignore_eos or min_tokens: the grammar "
                                                   "decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def draws_drafts(self) -> bool:
        """Whether drafters should draw their drafts from their own distribution: sampled
        requests without a seed, verified by rejection sampling, which keeps a draft ``x``
        with ``min(1, p(x) / q(x))``. A seeded request keeps a draft only where it equals
        the target's own draw, whatever ``q`` was: its best draft is the drafter's likeliest
        token, as a greedy request's is."""
        return not self.greedy and self.seed is None

    @property
    def shapes_logits(self) -> bool:
        """Whether the target's logits are changed before sampling (penalties, biases,
        ``min_tokens``): each verified position then needs its own history."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or self.min_tokens > 0)
