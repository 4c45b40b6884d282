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

import functools
import inspect
from pathlib import Path

import attrs
import torch

from .config import SpeculativeConfig
from .config_loading import structure, unstructure
from .drafting import hookspecs
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
                        query_pre_attn_scalar=16,  # sliding layers, then a global one, as Gemma 3 ends
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
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
    one verified against drafts, by default) over ``n`` requests is compared (chi-square) with
    its exact distribution, computed from the stock model by summing over every earlier
    output (keep ``top_k`` small), after the penalties and biases ``params`` ask for
    (not ``min_tokens``, which needs the model's EOS ids) and, with ``structured_outputs``,
    masked to the tokens the grammar allows after each earlier output. The drafter drafts
    every step unless ``options`` say ``adaptive: true`` (see :func:`check_greedy_lossless`).
    With ``engine`` options that quantize the target, the exact distribution is the
    quantized model's (a GGUF ``model``'s own blocks). The requests have no seed: they are
    verified by rejection sampling against drafts drawn from the drafter's distribution,
    where a drafter's ``q`` decides the output's distribution (a seeded request's output is
    plain sampling's own by construction, whatever was drafted). Returns the
    p-value and the number of accepted draft tokens (a test should check drafts were
    accepted at all).
    """
    options = {"adaptive": False, **options}
    from transformers import AutoModelForCausalLM

    from .api import LLM
    from .model.loading import gguf_file, quantize_target, resolve_model_dir
    from .sampler import probs_from_logits, shape_logits
    from .sampler.grammar import apply_masks

    params = params or SamplingParams(temperature=1.0, top_k=5)
    params = attrs.evolve(params, max_tokens=position + 2, ignore_eos=params.structured_outputs is None)
    mode = (engine or {}).get("quantization")
    path = resolve_model_dir(str(model))
    if mode:  # a GGUF file's own blocks where it has them, as the engine loads it
        ref = quantize_target(path, mode, torch.float32, torch.device("cpu"), gguf_file(str(model)))
    else:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    # the n requests run as one batch: each has its own generator, so batching them changes
    # no request's distribution, and the batched step is the one serving runs
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
    # The first request runs alone and leaves the prompt's blocks in the prefix cache, where
    # the other n - 1 read them instead of each computing the prompt.
    params = attrs.evolve(params, seed=None)
    for out in [*llm.generate([prompt], params), *llm.generate([prompt] * (n - 1), params)]:
        counts[out.token_ids[position]] += 1
        accepted += out.metrics.num_accepted_tokens
    p_value = chi_square_p_value(counts, exact, n)
    assert p_value > min_p_value, f"sampled output departs from the target distribution (p-value {p_value:.2e})"
    return p_value, accepted
