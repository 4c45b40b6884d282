"""Configuration: frozen attrs classes that validate every field as it is set.

Each method's plugin subclasses :class:`SpeculativeConfig` with its own options;
:mod:`specdec.config_loading` builds these classes from YAML or dicts.
"""

from __future__ import annotations

import difflib
from typing import ClassVar

import attrs

from .drafting.tree import StaticTree
from .errors import FieldError
from .sampling_params import SamplingParams


def in_range(lo: float | None = None, hi: float | None = None):
    """attrs validator: ``lo <= value <= hi`` (None values pass; bounds may be None)."""

    def check(inst, attribute, value):
        if value is None:
            return
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f"between {lo} and {hi}" if lo is not None and hi is not None else (
                f">= {lo}" if lo is not None else f"<= {hi}")
            raise FieldError(attribute.name, f"must be {bounds}, got {value!r}")

    return check


def one_of(*choices: str):
    """attrs validator: the value is one of ``choices``."""

    def check(inst, attribute, value):
        if value not in choices:
            raise FieldError(attribute.name, f"must be one of {', '.join(map(repr, choices))}, got {value!r}"
                             + suggest_close(str(value), choices))

    return check


def suggest_close(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


@attrs.frozen(kw_only=True)
class SpeculativeConfig:
    """Options every decoding type shares; a plugin subclasses it for its own options.

    Attributes:
        decoding_type: the registered name of the method (``ngram``, ``eagle3``...).
        max_draft_len: the most draft tokens proposed per request and step (tree: depth).
        max_total_draft_tokens: the most tree nodes per request and step (TensorRT-LLM's
            name); ``None``: chains, as many nodes as ``max_draft_len``. The scheduler
            charges these nodes against ``engine.max_num_tokens``, after the step's
            prompt chunks; a larger proposal is trimmed to its first nodes, with a warning.
        adaptive: each step, give each request the draft depth (tree: the depth and the
            nodes it brings) that maximises the step's expected tokens per second, from
            the request's live acceptance per draft position and the step cost the
            engine measures; zero when drafts do not pay, with a one-level probe after
            ``probe_interval`` steps (twice as long after each probe that does not pay,
            up to 8x) to turn speculation back on
            (:mod:`specdec.executor.planner`). ``max_draft_len`` and
            ``max_total_draft_tokens`` are the upper bounds. Setting
            ``draft_len_schedule`` or ``min_acceptance_rate`` replaces it with those
            manual rules; ``false`` drafts ``max_draft_len`` every step (what a
            ``seed`` needs to reproduce sampled output: measured step times vary).
        probe_interval: steps without drafts after which a request the planner keeps from
            drafting tries a one-level draft again, when the batch's probe budget (3% of
            the estimated step time) holds its cost.
        draft_len_schedule: batch size -> draft length. For ``B`` running requests the
            entry with the largest key ``<= B`` applies; ``0`` turns speculation off. A
            tree's node budget shrinks in proportion to its depth.
        min_acceptance_rate: a request whose acceptance rate over the last
            ``acceptance_window`` speculative steps stays below this stops speculating
            for ``retry_after`` steps, then tries again. ``0`` disables the switch.
        min_chain_probability: a chain drafted a level at a time (EAGLE, EAGLE-3, MTP's
            chain, a draft model) stops growing once the product of its tokens' draft
            probabilities, the drafter's own chance that the target accepts it all, falls
            below this; the token that crosses it is still verified
            (:mod:`specdec.drafting.chain_stop`). ``0``: chains grow to the depth asked.
        lookup: a second method, asked first each step for every decoding request: a
            lookup in text already seen (``{decoding_type: suffix}`` or ``ngram``), whose
            draft costs no model forward. Where the adaptive planner prices its draft at
            least as high as this method's (tokens a second, this method's drafting time
            counted), the lookup's draft is verified and this method is not asked; without
            the planner, wherever the lookup has a draft
            (:meth:`specdec.executor.planner.DraftPlanner.prefer_lookup`). Text that
            repeats itself or earlier requests (agents, edits, templated answers) then
            drafts deep for free, and the rest from this method. Its own ``max_draft_len``
            bounds its drafts.
    """

    decoding_type: str
    max_draft_len: int = attrs.field(default=4, validator=in_range(1, 64))
    max_total_draft_tokens: int | None = attrs.field(default=None, validator=in_range(1, 1024))
    adaptive: bool = True
    probe_interval: int = attrs.field(default=16, validator=in_range(1, None))
    draft_len_schedule: dict[int, int] | None = attrs.field(default=None)
    min_acceptance_rate: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    acceptance_window: int = attrs.field(default=8, validator=in_range(1, None))
    retry_after: int = attrs.field(default=16, validator=in_range(1, None))
    min_chain_probability: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    lookup: SpeculativeConfig | None = attrs.field(default=None)

    @lookup.validator
    def _check_lookup(self, attribute, value):
        if value is None:
            return
        if value.lookup is not None:
            raise FieldError(attribute.name, f"the lookup method {value.decoding_type!r} cannot have a lookup of "
                                             "its own; remove lookup.lookup")
        if value.decoding_type == self.decoding_type:
            raise FieldError(attribute.name, f"is {value.decoding_type!r}, the method itself; name another "
                                             "method (suffix or ngram) or remove it")

    @draft_len_schedule.validator
    def _check_schedule(self, attribute, value):
        if value is None:
            return
        for batch, length in value.items():
            if batch < 1:
                raise FieldError(attribute.name, f"batch size keys must be >= 1, got {batch}")
            if not 0 <= length <= 64:
                raise FieldError(attribute.name,
                                 f"draft lengths must be between 0 and 64, got {length} for batch size {batch}")

    @max_total_draft_tokens.validator
    def _check_total(self, attribute, value):
        if value is not None and value < self.max_draft_len:
            raise FieldError(attribute.name, f"{value} nodes cannot hold a path of max_draft_len "
                                             f"{self.max_draft_len}; give at least {self.max_draft_len}")

    def acceptance_rule(self, tokenizer=None):
        """An opt-in lossy rule from :mod:`specdec.sampler.lossy`, or None for exact
        verification (``tokenizer``: the target's, or None, for rules keyed on special tokens)."""
        return None

    def draft_len_for_batch(self, batch_size: int) -> int:
        if not self.draft_len_schedule:
            return self.max_draft_len
        keys = [k for k in self.draft_len_schedule if k <= batch_size]
        return min(self.draft_len_schedule[max(keys)], self.max_draft_len) if keys else self.max_draft_len

    def node_budget(self) -> int:
        """Tree nodes per request and step at full depth: ``max_total_draft_tokens``, or
        the method's default (chains: ``max_draft_len``)."""
        return self.max_total_draft_tokens or self.max_draft_len

    @property
    def chain_or_tree(self) -> bool:
        """Whether the drafter may be asked for a chain in place of its tree: given no more
        nodes than levels, a tree drafter drafts the chain of its best candidates (a static
        tree its chain of first children, :meth:`~specdec.drafting.tree.StaticTree.trimmed`),
        so the adaptive planner chooses, each step and request, between the chain and the
        tree (:class:`specdec.executor.planner.DraftPlanner`). A method with a tree says so."""
        return False

    @property
    def is_adaptive(self) -> bool:
        """Whether the adaptive planner chooses draft depths (no manual rule given)."""
        return self.adaptive and not self.draft_len_schedule and self.min_acceptance_rate == 0

    def nodes_for_depth(self, depth: int) -> int:
        """Tree nodes a request may draft at ``depth``: the node budget in proportion."""
        return max(depth, self.node_budget() * depth // self.max_draft_len) if depth else 0

    def draft_shape_for_batch(self, batch_size: int) -> tuple[int, int]:
        """(depth, nodes) a request may draft with ``batch_size`` requests running."""
        depth = self.draft_len_for_batch(batch_size)
        return depth, self.nodes_for_depth(depth)


#: Nodes of a dynamic tree when ``max_total_draft_tokens`` is not given.
DYNAMIC_TREE_NODES = 16


@attrs.frozen(kw_only=True)
class TreeDraftConfig(SpeculativeConfig):
    """Options of the drafters that grow their draft a level at a time from their own
    logits, one batched draft forward per level (EAGLE, MTP:
    :class:`specdec.drafting.feature_drafter.FeatureDrafter`): a chain by default,
    a static tree where the method has a choice list (:meth:`static_tree_choices`), or an
    EAGLE-2 dynamic tree.

    Attributes:
        use_dynamic_tree: each level expands the ``dynamic_tree_max_topK`` best frontier
            nodes (by cumulative log-probability) into their as many best children; after
            ``max_draft_len`` levels the ``max_total_draft_tokens`` (default
            :attr:`dynamic_tree_nodes`, 16 unless the method says otherwise) best nodes
            are verified. With ``adaptive`` on, the planner may ask for the chain instead,
            step by step and request by request, where it pays more (:attr:`chain_or_tree`).
        dynamic_tree_max_topK: children per expanded node and nodes expanded per level.
        min_chain_probability: as in :class:`SpeculativeConfig`; 0.5 here: these draft
            modules learn the target's distribution, so their probabilities track what
            the target accepts.
    """

    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int = attrs.field(default=4, validator=in_range(1, 64))  # noqa: N815
    min_chain_probability: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    #: nodes of a dynamic tree when ``max_total_draft_tokens`` is not given (per method)
    dynamic_tree_nodes: ClassVar[int] = DYNAMIC_TREE_NODES

    def static_tree_choices(self) -> list[list[int]] | None:
        """The method's static tree in TensorRT-LLM's notation (EAGLE's ``eagle_choices``),
        None for none."""
        return None

    @property
    def chain_or_tree(self) -> bool:
        """A dynamic or static tree (see :attr:`SpeculativeConfig.chain_or_tree`)."""
        return self.use_dynamic_tree or self.static_tree_choices() is not None

    def node_budget(self) -> int:
        if self.max_total_draft_tokens:
            return self.max_total_draft_tokens
        choices = self.static_tree_choices()
        if choices:
            return StaticTree.from_choices(choices).num_nodes
        if self.use_dynamic_tree:
            return max(self.dynamic_tree_nodes, self.max_draft_len)
        return self.max_draft_len


def bool_or_auto(value, _type=None) -> bool | str:
    """``true``, ``false`` or ``auto`` (an option whose default the engine decides)."""
    if not isinstance(value, bool) and value != "auto":
        raise TypeError(f"expected true, false or auto, got {value!r}")
    return value


def _check_bool_or_auto(inst, attribute, value) -> None:
    try:
        bool_or_auto(value)
    except TypeError as exc:
        raise FieldError(attribute.name, str(exc)) from None


#: ``engine.quantization`` values (:mod:`specdec.model.quantization`); ``none`` is read as None.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8", "w4a8")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine options: batching, KV cache size, context length.

    Attributes:
        max_batch_size: most requests decoded in one step.
        max_num_tokens: token budget of one target forward (prefill chunks included).
        block_size: tokens per KV cache block.
        kv_cache_blocks: size of the KV pool in blocks; takes precedence when set. A model's
            sliding-window layers get pools of their own besides, a few windows per request
            (``specdec.kvcache.window_blocks``; where those would not be smaller, one pool).
        kv_cache_memory_fraction: else, this share of the device's free memory (after loading).
        kv_cache_memory_mb: else, this many MiB. On a CPU the pool is an anonymous memory
            map: the OS commits its pages as the cache fills (``specdec.kvcache.zeroed``).
        max_model_len: context length limit; defaults to the model's own.
        enable_prefix_caching: share KV blocks of identical prompt prefixes across requests.
            Under a drafter that reads every prompt token's hidden states (EAGLE, MTP) the
            engine keeps those states beside the blocks, out of the same memory budget.
        num_threads: torch CPU threads (None leaves torch's default).
        batch_invariant: compute every token so that its result depends on its own sequence
            only, not on the drafts or requests sharing the forward: greedy output is then
            bit-identical between plain and speculative decoding, alone and batched, in
            bfloat16 too (:mod:`specdec.numerics.invariant`). ``auto`` (the default) turns it
            on where it costs nothing: a bfloat16 CPU target, unquantized or on the
            integer-dot kernels, not compiled unless its compiled forward is invariant (see
            ``compile``), whose layers specdec's CPU kernels take
            (:func:`specdec.numerics.invariant.mode_costs_nothing`). ``true`` or ``false``
            decides it.
        quantization: ``int8`` or ``int4`` weight-only target on torch's packed CPU kernels,
            or ``w8a8`` / ``w4a8``: the same weights multiplied with 8-bit activations by
            specdec's integer-dot kernels, whose extra verified rows cost little
            (:mod:`specdec.model.quantization`; a GGUF's own 4-bit blocks are used as they are);
            None (``none``) keeps the model's weights in ``dtype``. ``auto`` (the default):
            ``w4a8`` for a GGUF target of Q4_0 / Q4_1 blocks on a CPU with ``dtype: auto``
            (the embedded model), None otherwise
            (:func:`specdec.numerics.auto.resolve_quantization`). The quantized model is the target:
            speculative output equals its own plain output.
        draft_quantization: ``w8a8``: the drafter's own linear layers (EAGLE's layer and
            head, Medusa's heads, a draft model's layers) run on the integer-dot kernels with
            8-bit weights and activations, as the target's do; a drafted level then costs a
            fraction of its bfloat16 time. Output is unchanged (the target verifies every
            draft); acceptance may move slightly. None (``none``) keeps them in ``dtype``.
            ``auto`` (the default): ``w8a8`` where the target runs on the integer-dot kernels
            (``quantization`` ``w4a8`` or ``w8a8``), None elsewhere
            (:func:`specdec.numerics.auto.resolve_draft_quantization`).
        prepack_weights: bfloat16 linear layers on CPU multiply by weights reordered once
            into oneDNN's layout instead of at every call (:mod:`specdec.kernels.prepacked`):
            bit-identical results, faster products, one more copy of those weights in
            memory. On a CPU without bfloat16 instructions, where oneDNN refuses the
            reorder, they run specdec's linear kernel instead
            (:func:`specdec.kernels.cpu.kernel_linear`). No effect on other dtypes and devices.
        compile: run the target's forward through ``torch.compile`` (inductor; on the CPU
            with frozen weights, so ``prepack_weights`` does not apply): the work between
            the matrix products is fused, and a step costs about half its eager time on a
            small model (Performance: "Compiled target forward"). Its graphs compile when
            the engine starts (under a minute for the embedded model, seconds once torch's
            on-disk caches hold them). ``auto`` (the default): on where the compiled
            forward is batch-invariant, a bfloat16 CPU target whose every product runs the
            integer-dot kernels (``w4a8``, ``w8a8``: the embedded model by default), whose
            one graph calls the invariant attention kernel
            (:func:`specdec.numerics.auto.compiles_invariant`); off elsewhere, where a
            compiled forward fuses operations by the step's token count and is not
            batch-invariant (with ``batch_invariant: auto`` then off). Where it is on, a
            drafter's module compiles too (the ``compile_draft`` hook: EAGLE's and MTP's
            layers, a draft model), so that a drafted level is not eager Python beside a
            compiled target step.
        tensor_parallel_size: ranks the target is sharded over (transformers' tensor-parallel
            plan; heads, KV heads and MLP width must divide by it). On one machine specdec
            starts the other ranks itself; under ``torchrun`` every rank runs the program and
            rank 0 serves. Eager and unquantized. Default 1.
        distributed_timeout_s: the longest any collective of a tensor-parallel group waits
            before the engine reports the worker that did not answer (the ranks get at least
            60 s to meet when the group starts: a worker imports torch first). Default 60.
        cuda_graphs: on a CUDA target, replay captured CUDA graphs of the forward for steps
            of up to 512 tokens (decodes, draft chains and trees; prompt chunks up to 64
            tokens), padded into buckets of sequences and tokens
            (:mod:`specdec.executor.cuda_graphs`): a step then costs about its GPU time
            instead of ~1,400 launches from Python. Graphs are captured on first use and
            take memory beside the KV cache. Not with ``compile`` or ``batch_invariant:
            true``. Off by default.
    """

    max_batch_size: int = attrs.field(default=8, validator=in_range(1, 4096))
    max_num_tokens: int = attrs.field(default=512, validator=in_range(16, None))
    block_size: int = attrs.field(default=16, validator=in_range(1, 1024))
    kv_cache_blocks: int | None = attrs.field(default=None, validator=in_range(1, None))
    kv_cache_memory_mb: int = attrs.field(default=1024, validator=in_range(1, None))
    kv_cache_memory_fraction: float | None = attrs.field(default=None, validator=in_range(0.001, 0.95))
    max_model_len: int | None = attrs.field(default=None, validator=in_range(1, None))
    enable_prefix_caching: bool = True
    num_threads: int | None = attrs.field(default=None, validator=in_range(1, None))
    batch_invariant: bool | str = attrs.field(default="auto", validator=_check_bool_or_auto)
    quantization: str | None = attrs.field(default="auto", converter=lambda v: None if v == "none" else v,
                                           validator=attrs.validators.optional(one_of(*QUANTIZATIONS)))
    draft_quantization: str | None = attrs.field(default="auto", converter=lambda v: None if v == "none" else v,
                                                 validator=attrs.validators.optional(one_of("auto", "none", "w8a8")))
    prepack_weights: bool = True
    compile: bool | str = attrs.field(default="auto", validator=_check_bool_or_auto)
    cuda_graphs: bool = attrs.field(default=False, validator=lambda inst, attribute, value: _graphs_alone(inst, value))
    tensor_parallel_size: int = attrs.field(
        default=1, validator=[in_range(1, 1024), lambda inst, attribute, value: _eager_tp(inst, value)])
    distributed_timeout_s: float = attrs.field(default=60.0, validator=in_range(1, None))


def _eager_tp(engine: EngineConfig, size: int) -> None:
    """A tensor-parallel target runs eagerly and unquantized."""
    if size == 1:
        return
    for field, on in (("compile", engine.compile is True), ("cuda_graphs", engine.cuda_graphs)):
        if on:
            raise FieldError("tensor_parallel_size", f"cannot be combined with {field}: a tensor-parallel target "
                                                     f"runs eagerly; turn {field} off")
    if engine.quantization not in (None, "auto"):
        raise FieldError("tensor_parallel_size", f"cannot be combined with quantization: {engine.quantization}: "
                                                 "a tensor-parallel target runs unquantized; set quantization: "
                                                 "none (auto is none under tensor parallelism)")


def _graphs_alone(engine: EngineConfig, cuda_graphs: bool) -> None:
    """``cuda_graphs`` captures the eager forward with the stock attention kernel."""
    if cuda_graphs and engine.compile is True:
        raise FieldError("cuda_graphs", "cannot be combined with compile: the graphs capture the eager forward; "
                                        "turn one of them off")
    if cuda_graphs and engine.batch_invariant is True:
        raise FieldError("cuda_graphs", "cannot be combined with batch_invariant: true, whose attention is not "
                                        "captured; turn one of them off (auto is off on CUDA)")


@attrs.frozen(kw_only=True)
class SpecdecConfig:
    """The whole configuration, as one YAML file holds it.

    Attributes:
        model: a local transformers model directory or ``.gguf`` file; ``null``: the
            embedded default model (SmolLM2-135M-Instruct).
        tokenizer: where the tokenizer lives, if not beside the model.
        dtype: the target's weights and activations; ``auto``: bfloat16.
        device: ``cpu``, ``cuda`` or ``auto`` (CUDA where available).
        speculative_config: the drafting method and its options; ``null``: no speculation.
        sampling: the default sampling parameters of requests that give none.
        engine: batching, KV cache, numerics and compilation.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = attrs.field(default="auto", validator=one_of("auto", "float32", "bfloat16", "float16"))
    device: str = attrs.field(default="auto", validator=one_of("auto", "cpu", "cuda"))
    speculative_config: SpeculativeConfig | None = None
    sampling: SamplingParams = attrs.Factory(SamplingParams)
    engine: EngineConfig = attrs.Factory(EngineConfig)
