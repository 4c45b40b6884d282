"""Conformance kit for drafting plugins, and tiny random models of real architectures.

A third-party plugin runs these in its own tests::

    from specdec import testing

    def test_conformance(tmp_path):
        testing.check_registration("bigram", distribution="specdec-example-drafter")
        testing.check_config_round_trip({"decoding_type": "bigram", "max_draft_len": 3})
        testing.check_greedy_lossless({"decoding_type": "bigram", "max_draft_len": 3},
                                      model=testing.tiny_model_dir(tmp_path))

Every check raises AssertionError with a message saying what is wrong.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch

from .config import SpeculativeConfig
from .config_loading import structure, unstructure
from .drafting import hookspecs
from .parallel.group import free_port
from .plugins import DecodingType, get_registry, hook_names
from .sampling_params import SamplingParams

#: Tiny configurations of the architectures the executor supports (random weights).
TINY_ARCHITECTURES = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, sliding_window=8),
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                        query_pre_attn_scalar=16),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}


def tiny_model_dir(directory: str | Path, arch: str = "llama", vocab_size: int = 128, seed: int = 0,
                   max_position_embeddings: int = 512) -> Path:
    """Save a randomly initialised tiny causal LM of a real architecture; return its directory.

    The weights are scaled up so greedy decoding does not collapse to one repeated token.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(directory) / f"tiny-{arch}-{seed}"
    if (directory / "config.json").exists():
        return directory
    options = dict(TINY_ARCHITECTURES[arch])
    config = AutoConfig.for_model(options.pop("model_type"), vocab_size=vocab_size,
                                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
                                  **options)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    return directory


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (or where the shorter one ends), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def near_tie_at(model, prompt: list[int], output: list[int], index: int, tol: float = 1e-4) -> tuple[bool, float]:
    """Whether the stock transformers ``model``'s top-2 logits after ``prompt + output[:index]``
    are within ``tol`` (a divergence there is rounding, not a bug), and their gap."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output[:index])])).logits[0, -1].float()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return gap <= tol, gap


#: Six short, varied prompts for training tests (``specdec train`` on the embedded model).
TRAIN_PROMPTS = ["Write a haiku about a lighthouse.", "Give two tips for learning chess.",
                 "What is 12 times 7? Explain briefly.", "Describe a rainy street in one sentence.",
                 "Name three uses of a paper clip.", "Translate into Spanish: The cat sleeps on the warm roof."]


def prompt_file(directory: str | Path, prompts: list[str] | None = None) -> Path:
    """A ``specdec train`` data file of ``{"prompt": ...}`` lines (default :data:`TRAIN_PROMPTS`)."""
    import json

    path = Path(directory) / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (prompts or TRAIN_PROMPTS)))
    return path


def train_briefly(method: str, directory: str | Path, data: str | Path | None = None, init: str | None = None,
                  **trainer_options) -> tuple[Path, dict, list[dict]]:
    """``specdec train METHOD`` for 10 CPU steps on the embedded model (the target's float32
    answers of 16 tokens to :data:`TRAIN_PROMPTS`, or to ``data``; ``init`` as ``--init``);
    returns the output directory, the run's report and its per-step history (loss and the
    method's metrics)."""
    from .training import TrainOptions, train

    directory = Path(directory)
    data = data or prompt_file(directory)
    out = directory / method
    report = train(TrainOptions(method=method, data=str(data), out=str(out), max_new_tokens=16, batch_size=8,
                                eval_prompts=1, gen_dtype="float32", device="cpu", max_steps=10, lr=1e-3,
                                warmup_steps=2, init=init, trainer_options=trainer_options), progress=False)
    history = torch.load(out / "checkpoint.pt", weights_only=False)["state"]["history"]
    return out, report, history


def check_rows_match_unrolled(train_step, serve_forward, feature_size: int, vocab_size: int = 128,
                              length: int = 9, atol: float = 1e-4) -> None:
    """A feature drafter's module (:mod:`specdec.drafting.feature_drafter`) drafts at inference what it
    learnt in training: the draft runner's committed rows, two sibling tree nodes and a
    grandchild give the states of :func:`specdec.training.unrolled_attention`'s unrolled
    steps, and rows committed after the drafts were dropped continue as in training.

    ``train_step(tokens [L], feature [1, L, F], positions [L], attend) -> [1, L, F]`` is one
    training step; ``serve_forward`` the runner's module forward
    (:meth:`specdec.drafting.feature_drafter.FeatureDrafter.draft_forward`'s signature).
    """
    from .drafting.runner import DraftInput, DraftRunner
    from .training import unrolled_attention

    g = torch.Generator().manual_seed(1)
    x, a, b, c = (torch.randint(0, vocab_size, (length,), generator=g) for _ in range(4))  # step 0; depths 1, 1, 2
    feats = torch.randn(1, length, feature_size, generator=g)

    def unrolled(tokens_per_step):
        attend, next_step = unrolled_attention(torch.ones(1, length, dtype=torch.bool))
        feature, outs = feats, []
        for j, tokens in enumerate(tokens_per_step):
            feature = train_step(tokens, feature, torch.arange(length) + j, attend)
            next_step()
            outs.append(feature[0])
        return outs

    with torch.no_grad():
        step0, step1a, step2 = unrolled([x, a, c])
        _, step1b = unrolled([x, b])
        runner = DraftRunner.for_module(serve_forward, 16, 4, torch.float32, torch.device("cpu"),
                                        feature=torch.zeros(1, feature_size))
        seq = runner.sequence("r")
        k = length - 3
        out = runner.forward([DraftInput(seq, x[:k].tolist(), features={"feature": feats[0, :k]},
                                         output_rows=list(range(k)))])[0]
        close = functools.partial(torch.testing.assert_close, atol=atol, rtol=atol)
        close(out, step0[:k], msg=lambda m: f"committed rows differ from training's step 0: {m}")
        i = k - 1
        lvl1 = runner.forward([DraftInput(seq, [int(a[i]), int(b[i])], parents=[-1, -1],
                                          features={"feature": out[i:i + 1].expand(2, -1)}, output_rows=[0, 1])])[0]
        close(lvl1[0], step1a[i], msg=lambda m: f"a depth-1 node differs from training's step 1: {m}")
        close(lvl1[1], step1b[i], msg=lambda m: f"its sibling differs from training's step 1: {m}")
        lvl2 = runner.forward([DraftInput(seq, [int(c[i])], parents=[0], features={"feature": lvl1[:1]})])[0]
        close(lvl2[0], step2[i], msg=lambda m: f"a depth-2 node differs from training's step 2: {m}")
        runner.drop_pending(seq)
        more = runner.forward([DraftInput(seq, x[k:].tolist(), features={"feature": feats[0, k:]},
                                          output_rows=list(range(length - k)))])[0]
        close(more, step0[k:], msg=lambda m: f"rows committed after dropped drafts differ: {m}")


def check_registration(name: str, distribution: str | None = None) -> DecodingType:
    """The decoding type is found through its entry point, with a sound config and documented hooks."""
    registry = get_registry()
    failures = [f for f in registry.failures if distribution is None or f.distribution == distribution]
    assert not failures, f"plugins failed to load: {failures}"
    assert name in registry.types, f"decoding type {name!r} not registered; installed: {registry.names()}"
    dtype = registry.types[name]
    if distribution is not None:
        assert dtype.distribution == distribution, \
            f"{name!r} comes from {dtype.distribution!r}, expected {distribution!r}"
    assert issubclass(dtype.config_class, SpeculativeConfig), "config_class must subclass SpeculativeConfig"
    if dtype.drafter_class is not None:
        marker = f"{hookspecs.PROJECT_NAME}_impl"
        known = set(hook_names())
        for attr in dir(dtype.drafter_class):
            fn = getattr(dtype.drafter_class, attr, None)
            if getattr(fn, marker, None) is not None:
                assert attr in known, \
                    f"{dtype.drafter_class.__name__}.{attr} is marked @hookimpl but no hook has that name"
                spec_args = set(inspect.signature(getattr(hookspecs, attr)).parameters)
                impl_args = set(inspect.signature(fn).parameters) - {"self"}
                assert impl_args <= spec_args, f"{attr} takes {impl_args - spec_args}, which the hook does not pass"
        assert "prepare_draft_tokens" in dtype.hooks_implemented(), \
            f"{dtype.drafter_class.__name__} does not implement prepare_draft_tokens"
    return dtype


def check_config_round_trip(options: dict) -> SpeculativeConfig:
    """``options`` build the method's config, which unstructures back to the same config."""
    config = structure(options, SpeculativeConfig, "speculative_config")
    again = structure(unstructure(config), SpeculativeConfig, "speculative_config")
    assert again == config, f"config does not survive a round trip: {config} -> {again}"
    for key, value in options.items():
        if key != "decoding_type":
            assert getattr(config, key) == value or list(getattr(config, key)) == value, f"{key} was not kept"
    return config


def check_greedy_lossless(options: dict, model: str | Path | None = None, prompts: list | None = None,
                          max_tokens: int = 24, dtype: str = "float32", min_accepted: int = 1,
                          engine: dict | None = None, device: str = "auto"):
    """Greedy output with the drafter equals plain greedy output, token for token, and the
    drafter really took part: it proposed draft tokens, and at least ``min_accepted`` of
    them were accepted over all prompts (a drafter that never drafts, or always fails,
    would otherwise pass). The default prompts repeat a random sequence, which drafters
    that read the context predict; give ``min_accepted=0`` only for a drafter that cannot
    predict the model at all (an untrained head on a random model) and check acceptance
    in another test.

    ``model`` defaults to a tiny random Llama; prompts are token-id lists by default so a
    model without a tokenizer works. The drafter drafts every step unless ``options`` say
    ``adaptive: true``: the adaptive planner's choices follow measured step times, which
    would make the check depend on the machine's load. ``engine`` options (say
    ``{"quantization": "int4"}``) and ``device`` apply to both runs. Returns the speculative outputs.
    """
    from .api import LLM

    options = {"adaptive": False, **options}

    if prompts is None:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 100, (n,), generator=g).tolist() * 2 for n in (5, 9, 14)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    name = str(model) if model else None
    plain = LLM(model=name, dtype=dtype, device=device, engine=engine).generate(prompts, params)
    spec = LLM(model=name, dtype=dtype, device=device, engine=engine,
               speculative_config=options).generate(prompts, params)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a.token_ids == b.token_ids, (f"prompt {i}: speculative greedy output differs from plain greedy output:"
                                            f"\nplain {a.token_ids}\nspec  {b.token_ids}")
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    faults = sum(o.metrics.num_drafter_faults for o in spec)
    assert drafted > 0, f"the drafter proposed no draft tokens ({faults} drafter faults): nothing was verified"
    assert accepted >= min_accepted, (f"{accepted} of {drafted} draft tokens accepted, expected at least "
                                      f"{min_accepted}: the drafter does not predict the target")
    return spec


def chi_square_p_value(counts: torch.Tensor, exact: torch.Tensor, n: int) -> float:
    """p-value of observed ``counts`` against probabilities ``exact`` (cells expected < 5 pooled).

    0 when a token with probability 0 was observed.
    """
    if counts[exact == 0].sum() > 0:
        return 0.0
    expected = exact * n
    big = expected >= 5
    stat = float((((counts - expected) ** 2)[big] / expected[big]).sum())
    cells = int(big.sum())
    small_expected = float(expected[~big & (exact > 0)].sum())
    if small_expected > 0:
        small_observed = float(counts[~big & (exact > 0)].sum())
        stat += (small_observed - small_expected) ** 2 / small_expected
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def check_sampling_lossless(options: dict, model: str | Path, prompt: list[int], n: int = 1500,
                            params: SamplingParams | None = None, position: int = 1, min_p_value: float = 1e-3,
                            engine: dict | None = None, device: str = "auto"):
    """Sampled output follows the target's distribution with the drafter in the loop.

    The empirical distribution of output token ``position`` (the second token, the first
    one verified against drafts, by default) over ``n`` seeds is compared (chi-square) with
    its exact distribution, computed from the stock model by summing over every earlier
    output (keep ``top_k`` small), after the penalties and biases ``params`` ask for
    (not ``min_tokens``, which needs the model's EOS ids) and, with ``structured_outputs``,
    masked to the tokens the grammar allows after each earlier output. The drafter drafts
    every step unless ``options`` say ``adaptive: true`` (see :func:`check_greedy_lossless`).
    With ``engine`` options that quantize the target, the exact distribution is the
    quantized model's. Returns the
    p-value and the number of accepted draft tokens (a test should check drafts were
    accepted at all).
    """
    options = {"adaptive": False, **options}
    from transformers import AutoModelForCausalLM

    from .api import LLM
    from .model.loading import quantize_target
    from .sampler import probs_from_logits, shape_logits
    from .sampler.grammar import apply_masks

    params = params or SamplingParams(temperature=1.0, top_k=5)
    params = attrs.evolve(params, max_tokens=position + 2, ignore_eos=params.structured_outputs is None)
    mode = (engine or {}).get("quantization")
    if mode:
        ref = quantize_target(Path(model), mode, torch.float32, torch.device("cpu"))
    else:
        ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    # the n seeded requests run as one batch: each has its own generator, so batching them
    # changes no request's distribution, and the batched step is the one serving runs
    llm = LLM(model=str(model), dtype="float32", device=device, engine={"max_batch_size": 64, **(engine or {})},
              speculative_config=options)

    @torch.no_grad()
    def marginal(prefix: list[int], steps: int) -> torch.Tensor:
        logits = ref(torch.tensor([prefix])).logits[0, -1:].clone()
        if params.structured_outputs is not None:
            grammar = llm.engine.grammars.grammar(params.structured_outputs)
            grammar.advance(prefix[len(prompt):])
            apply_masks(logits, torch.tensor([0]), grammar.masks()[0])
        logits = shape_logits(logits, [prefix], params, len(prompt), frozenset())
        probs = probs_from_logits(logits, params)[0]
        if steps == 0:
            return probs
        return sum(probs[t] * marginal(prefix + [t], steps - 1) for t in torch.nonzero(probs).flatten().tolist())

    exact = marginal(list(prompt), position)
    counts, accepted = torch.zeros_like(exact), 0
    for out in llm.generate([prompt] * n, [attrs.evolve(params, seed=seed) for seed in range(n)]):
        counts[out.token_ids[position]] += 1
        accepted += out.metrics.num_accepted_tokens
    p_value = chi_square_p_value(counts, exact, n)
    assert p_value > min_p_value, f"sampled output departs from the target distribution (p-value {p_value:.2e})"
    return p_value, accepted


#: Chat prompts on which drafters shipped for the embedded model are checked (not in any
#: training data or bench category).
SHIPPED_CHECK_PROMPTS = [
    [{"role": "user", "content": "Explain why the sky looks blue, in two sentences."}],
    [{"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes? Think step by step."}]]
SHIPPED_CHECK_PARAMS = SamplingParams(max_tokens=48, temperature=0.0)


@functools.lru_cache(maxsize=1)
def embedded_plain_chat() -> tuple:
    """Plain greedy float32 answers of the embedded model to :data:`SHIPPED_CHECK_PROMPTS`
    (computed once per process)."""
    from .api import LLM

    return tuple(LLM(dtype="float32").chat(SHIPPED_CHECK_PROMPTS, SHIPPED_CHECK_PARAMS))


def steady_costs(llm, step: float = 0.03, per_token: float = 5e-4, per_level: float = 2e-3) -> None:
    """Give ``llm``'s adaptive planner a fixed cost model (``step + per_token * tokens``
    seconds a step, ``per_level`` a drafted level) in place of the clock's, so that a test of
    its decisions does not depend on the machine's load."""
    from .executor.planner import FixedCosts

    llm.engine.planner.costs = FixedCosts(step, per_token, per_level)


def check_shipped_drafter(options: dict, min_length: float):
    """A drafter on the embedded model in float32, drafting its full shape every step
    (``adaptive`` off unless ``options`` says otherwise): greedy output equals plain greedy
    output on :data:`SHIPPED_CHECK_PROMPTS`, and the acceptance length (tokens per target
    step) is at least ``min_length``. Returns the speculative ``LLM`` and the length."""
    from .api import LLM

    spec = LLM(dtype="float32", speculative_config={"adaptive": False, **options})
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
    the same drafts are proposed and accepted (float32, batch-invariant numerics, so the
    hidden states of the prompt tokens the target still runs do not depend on how many
    share the forward either). A drafter that reads every prompt token's hidden state gets
    the cached prefix's states from the engine; one that reads the newest only needs none."""
    from .api import LLM

    llm = LLM(dtype="float32", engine={"batch_invariant": True}, speculative_config={"adaptive": False, **options})
    first, again = (llm.chat(SHIPPED_CHECK_PROMPTS[:1], SHIPPED_CHECK_PARAMS)[0] for _ in range(2))
    assert first.metrics.num_cached_prompt_tokens == 0 < again.metrics.num_cached_prompt_tokens
    assert again.token_ids == first.token_ids == embedded_plain_chat()[0].token_ids
    drafts = [(o.metrics.drafted_at, o.metrics.accepted_at) for o in (first, again)]
    assert drafts[0] == drafts[1] and first.metrics.num_accepted_tokens > 0, drafts


def check_shipped_sampling(options: dict, n: int = 250, question: str = "Name a color.",
                           params: SamplingParams | None = None) -> int:
    """:func:`check_sampling_lossless` on the embedded model (a short chat ``question``,
    temperature 1, top-k 4 unless ``params`` say otherwise); returns the accepted draft tokens."""
    from .api import LLM
    from .model.loading import resolve_model_dir

    prompt = LLM(dtype="float32").apply_chat_template([{"role": "user", "content": question}])
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
    """Plain greedy float32 answers of the embedded model to :data:`STRUCTURED_CHECK_PROMPTS`
    under :data:`STRUCTURED_CHECK_PARAMS` (computed once per process)."""
    from .api import LLM

    return tuple(LLM(dtype="float32").chat(STRUCTURED_CHECK_PROMPTS, STRUCTURED_CHECK_PARAMS))


def check_structured_lossless(options: dict, min_accepted: int = 1):
    """Structured output under speculation is the constrained target's: on the embedded
    model in float32, JSON-schema-constrained greedy output with the drafter (drafting
    every step unless ``options`` say ``adaptive: true``) equals plain constrained greedy
    output token for token, parses as JSON the schema accepts (or stops at ``max_tokens``),
    and at least ``min_accepted`` draft tokens were accepted. Returns the outputs."""
    import json

    from .api import LLM

    spec = LLM(dtype="float32", speculative_config={"adaptive": False, **options})
    got = spec.chat(STRUCTURED_CHECK_PROMPTS, STRUCTURED_CHECK_PARAMS)
    for i, (a, b) in enumerate(zip(embedded_plain_structured(), got)):
        assert b.token_ids == a.token_ids, (f"prompt {i}: constrained output departs from plain constrained greedy "
                                            f"at token {first_divergence(a.token_ids, b.token_ids)}")
        if b.finish_reason == "stop":
            assert follows_check_schema(json.loads(b.text)), f"prompt {i}: {b.text!r} does not follow the schema"
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert accepted >= min_accepted, f"{options}: {accepted} draft tokens accepted, expected >= {min_accepted}"
    return got


@contextlib.contextmanager
def running_server(config: str, directory: str | Path, args: tuple[str, ...] = (),
                   env: dict | None = None) -> Iterator[str]:
    """`specdec serve` with ``config`` (YAML text, written into ``directory``) on a free
    loopback port, in a subprocess, with more command-line ``args`` and ``env`` variables,
    its output in ``directory/server.log``: yields its base URL, stops it on exit."""
    import httpx

    cfg = Path(directory) / "cfg.yaml"
    cfg.write_text(config)
    port = free_port()
    log = Path(directory) / "server.log"  # a file, not a pipe: an unread pipe fills and stalls the server
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "-c", str(cfg), "--port", str(port),
                                 *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()}")
            if time.time() > deadline:
                raise RuntimeError("the server did not start within 180 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still busy after 30 s: no server outlives its test
            proc.kill()
            proc.wait()


def stream_chat(client, prompt: str, **options) -> str:
    """The text of one streamed chat completion of ``prompt`` through an ``openai.OpenAI`` client."""
    chunks = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}], stream=True,
                                            **options)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
