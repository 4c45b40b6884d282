"""The target model: unmodified transformers code over specdec's paged KV cache.

specdec registers its own attention implementation with transformers' AttentionInterface
(and a mask function that builds nothing). The model is called with explicit position ids,
``use_cache=False`` and a :class:`ForwardMetadata` riding along as the ``specdec`` keyword,
which transformers hands to every attention call: the attention writes the new tokens' K/V
into their slots and attends over each sequence's context through its slots, with the mask
the step built (causal for prompts, tree-shaped for drafts, block-diagonal across requests).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..kernels import (
    gather_context,
    grouped_attention,
    invariant_attention,
    paged_attention,
    paged_attention_is_triton,
    prepack_linear,
)
from ..kernels.cpu import attend_key_rows
from ..kvcache import PagedKVCache
from ..kvcache.layout import AttentionLayout
from ..numerics.invariant import make_linear_invariant, restore_linear
from .hf_config import text_config

ATTENTION_NAME = "specdec_paged"


@attrs.define
class ForwardMetadata:
    """What the attention layers need for one packed forward: the cache and the step's
    layout. ``probe`` collects K/V shapes instead. ``batch_invariant``: attention whose
    result for a token does not depend on the rest of the step (:mod:`specdec.numerics.invariant`).
    ``hidden_layers``: the layers whose hidden states the forward returns (hooked by
    :meth:`TargetModel.capture_hidden_layers` first)."""

    cache: PagedKVCache | None
    layout: AttentionLayout | None = None
    probe: list | None = None
    batch_invariant: bool = False
    hidden_layers: frozenset[int] = frozenset()


class SequenceKV(NamedTuple):
    """One sequence's step and its cache as tensors, so that a compiled graph traces its
    attention (the K/V writes, the context gather and one SDPA call a layer, fused by
    inductor) instead of calling the opaque operator, whose Python and four dispatches per
    layer cost more than the attention itself at a decode or a chain verification.
    ``keys``/``values``: every layer's pool; ``slots [T]`` where the new tokens' K/V go;
    ``context [S]`` the sequence's slots, new ones included; ``mask [T, S]`` which of them
    each new token sees (None for one token, which sees them all)."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    context: torch.Tensor
    mask: torch.Tensor | None


class KeyRows(NamedTuple):
    """A step's K/V destinations and every token's key row as tensors, so that a compiled
    graph calls the CPU batch-invariant attention kernel itself (one operator a layer, no
    Python), for any number of tokens and sequences: ``keys``/``values`` every layer's
    pool, ``slots [T]`` where the new tokens' K/V go, the rest
    :attr:`~specdec.kvcache.layout.AttentionLayout.invariant_key_rows` and the tokens'
    positions. Where the sliding-window layers have pools of their own
    (:class:`specdec.kvcache.window_blocks.WindowBlocks`), ``window_slots`` and
    ``window_key_slots`` are ``slots`` and ``key_slots`` there."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    slots: torch.Tensor
    key_slots: torch.Tensor
    key_pos: torch.Tensor
    offset: torch.Tensor
    count: torch.Tensor
    query_pos: torch.Tensor
    window_slots: torch.Tensor | None = None
    window_key_slots: torch.Tensor | None = None

    def row_tensors(self) -> list[torch.Tensor]:
        """The step's tensors past the pools, the window fields only where they are given:
        what a compiled graph takes with sizes dynamic in their first dimension."""
        return [t for t in self[2:] if t is not None]


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             specdec: ForwardMetadata | SequenceKV | KeyRows | None = None, sliding_window=None,
                             softcap=None, **kwargs):
    """specdec's attention, by what ``specdec`` holds: the step's :class:`ForwardMetadata`
    (an eager forward), a compiled graph's inputs (:class:`SequenceKV`, :class:`KeyRows`:
    traced into the graph), or None (a compiled forward whose step's metadata waits in
    :data:`compiled_step`: the opaque operator)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(specdec, KeyRows):
        layer, step = module.layer_idx, specdec
        slots, key_slots = ((step.window_slots, step.window_key_slots)
                            if sliding_window is not None and step.window_slots is not None
                            else (step.slots, step.key_slots))
        _write_kv(step.keys[layer], step.values[layer], slots, key, value)
        out = attend_key_rows(query[0], step.keys[layer], step.values[layer], key_slots, step.key_pos,
                              step.offset, step.count, step.query_pos, scale, sliding_window, softcap)
        return out.unsqueeze(0), None
    if isinstance(specdec, SequenceKV) and sliding_window is None and softcap is None:
        layer, step = module.layer_idx, specdec
        _write_kv(step.keys[layer], step.values[layer], step.slots, key, value)
        k, v = gather_context(step.keys[layer], step.values[layer], step.context)
        return grouped_attention(query[0], k, v, step.mask, scale).unsqueeze(0), None
    if not isinstance(specdec, ForwardMetadata):
        return torch.ops.specdec.paged_attention(query, key, value, module.layer_idx, scale, sliding_window,
                                                 softcap), None
    return _attend(module.layer_idx, query, key, value, specdec, scale, sliding_window, softcap), None


def _write_kv(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key, value) -> None:
    """The new tokens' K/V (``[1, kv_heads, T, dim]``) into their slots of one layer's pools."""
    keys.index_copy_(0, slots, key[0].transpose(0, 1).to(keys.dtype))
    values.index_copy_(0, slots, value[0].transpose(0, 1).to(values.dtype))


def _attend(layer: int, query, key, value, meta: ForwardMetadata, scale: float, sliding_window, softcap):
    """Write the new tokens' K/V into their slots, attend; ``[1, T, heads, value_dim]``."""
    if meta.probe is not None:
        meta.probe.append((layer, KVLayer(key.shape[1], key.shape[3], value.shape[3], sliding_window)))
        return query.new_zeros(1, query.shape[2], query.shape[1], value.shape[3])
    keys, values = meta.cache.keys[layer], meta.cache.values[layer]
    layout = meta.cache.layout_for(layer, meta.layout)
    _write_kv(keys, values, layout.slot_mapping, key, value)
    attend = invariant_attention if meta.batch_invariant else paged_attention
    return attend(query[0], keys, values, layout, scale, sliding_window, softcap).unsqueeze(0)


#: ``meta``: the metadata of the compiled target forward this thread runs now
#: (:meth:`TargetModel.compile`).
compiled_step = threading.local()


#: inductor's options for every graph here: no size, stride or alignment checks after the
#: operators it does not generate (a step is faster without them)
NO_ASSERTS_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}

#: inductor's options for a graph with a C++ wrapper (a Python wrapper's operator calls cost
#: a third of a decode step): the wrapper built apart from the kernels, at gcc's ``-O1``
#: (one ``-O3`` build of both took 180 s of the embedded target's first compilation on two
#: cores, apart 27 s, its steps no slower)
CPP_WRAPPER_OPTIONS = {**NO_ASSERTS_OPTIONS, "cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def compile_unguarded(fn, **options):
    """``torch.compile`` of ``fn`` with graphs of its own and no guards on modules. Dynamo
    keeps graphs per code object, so ``fn`` gets a code object of its own: its graphs are
    not guarded on the modules they read (the checks cost time every call; nothing changes
    those modules once compiled) and would otherwise serve another caller's calls."""
    fn.__code__ = fn.__code__.replace()
    return torch.compile(fn, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                                      **options})


def _compiled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                        sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The paged attention as one operator opaque to torch.compile: the step's layout is a
    Python object that cannot be a graph input, so the operator reads it from
    :data:`compiled_step`; it writes the cache (not an input either) as the eager path does.
    Defined through ``torch.library.Library`` rather than ``torch.library.custom_op``, whose
    Python wrapper layers cost more on every call."""
    meta = getattr(compiled_step, "meta", None)
    if meta is None:
        raise RuntimeError("the specdec attention runs only inside a specdec engine step")
    return _attend(layer, query, key, value, meta, scale, sliding_window, softcap).contiguous()


_library = torch.library.Library("specdec", "DEF")
_library.define("paged_attention(Tensor query, Tensor key, Tensor value, int layer, float scale, "
                "int? sliding_window, float? softcap) -> Tensor")
_library.impl("paged_attention", _compiled_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("specdec::paged_attention")
def _(query, key, value, layer, scale, sliding_window, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


def _pools_dynamic(keys, values) -> None:
    """Mark a KV cache's pools dynamic in their slots, once per cache: a compiled graph then
    serves every engine's cache, whatever its number of blocks (sized from free memory, it
    differs between engines sharing a target)."""
    if not hasattr(keys[0], "_dynamo_dynamic_indices"):
        for pool in (*keys, *values):
            torch._dynamo.mark_dynamic(pool, 0)


def _one_size_symbol_per_pool_size(step) -> None:
    """While a graph is traced: the pools of ``step`` (:class:`KeyRows`, :class:`SequenceKV`)
    that have one size share one size symbol. Each pool is marked dynamic on its own
    (:func:`_pools_dynamic`), so each would bring a symbol of its own, which the compiled
    graph takes as an integer argument converted to a tensor at every call: two per layer.
    Comparing each pool's size with the sizes seen before guards on their equality, and
    Dynamo then keeps one symbol for them (the sliding-window layers' smaller pools keep
    another)."""
    if step is None:
        return
    sizes = []
    for pool in (*step.keys, *step.values):
        if not any(pool.shape[0] == size for size in sizes):
            sizes.append(pool.shape[0])


def _no_mask(*args, **kwargs):
    return None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class KVLayer(NamedTuple):
    """What one attention layer keeps per token: ``heads`` K/V heads of ``key_dim`` and
    ``value_dim``, and its sliding ``window`` (None: every position)."""

    heads: int
    key_dim: int
    value_dim: int
    window: int | None


def probe_kv_layers(call, name: str) -> list[KVLayer]:
    """Each attention layer's :class:`KVLayer`, read by one probing forward: ``call(meta)``
    runs one token with ``specdec=meta``."""
    probe: list = []
    with torch.inference_mode():
        call(ForwardMetadata(cache=None, probe=probe))
    probe.sort(key=lambda entry: entry[0])
    if [p[0] for p in probe] != list(range(len(probe))):
        raise TypeError(f"{name}: attention layers report indices {[p[0] for p in probe]}; "
                        f"expected 0..{len(probe) - 1}")
    return [p[1] for p in probe]


@attrs.frozen
class TargetParts:
    """The pieces of the target that drafters reuse (shared, never copied; do not train them).

    Attributes:
        embed_tokens: the input embedding module (``[vocab, hidden]`` weight).
        final_norm: the norm applied before the LM head (None if the model has none).
        lm_head: the output projection (``[vocab, hidden]`` weight).
        decoder_layers: the decoder layers, in order.
        rotary_emb: the module computing rotary ``(cos, sin)`` from positions, or None.
        hf_config: the text config (architecture of a draft layer "like the target's").
        hidden_size, num_layers, vocab_size: as their names say.
        rope_layer_types: each layer's type where the rotary module takes it (Gemma 3:
            sliding layers rotate with another base), else None.
    """

    embed_tokens: torch.nn.Module
    final_norm: torch.nn.Module | None
    lm_head: torch.nn.Module
    decoder_layers: torch.nn.ModuleList
    rotary_emb: torch.nn.Module | None
    hf_config: object
    hidden_size: int
    num_layers: int
    vocab_size: int
    rope_layer_types: tuple[str, ...] | None = None

    def rope(self, like: torch.Tensor, positions: torch.Tensor, layer: int = -1):
        """Rotary ``(cos, sin)`` at ``positions`` as decoder layer ``layer`` reads them, or
        None where the model has no rotary module. Models whose layers differ in kind
        (Gemma 3: sliding layers rotate with another base) take the layer's type."""
        if self.rotary_emb is None:
            return None
        if self.rope_layer_types is not None:
            return self.rotary_emb(like, positions, self.rope_layer_types[layer])
        return self.rotary_emb(like, positions)


def target_parts(model) -> TargetParts:
    """The :class:`TargetParts` of a transformers causal LM."""
    layers, norm = _decoder_parts(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = text_config(model.config)
    head = model.get_output_embeddings()
    rotary = getattr(base, "rotary_emb", None)
    types = getattr(config, "layer_types", None)
    takes_type = rotary is not None and types is not None and \
        "layer_type" in inspect.signature(rotary.forward).parameters
    return TargetParts(embed_tokens=model.get_input_embeddings(), final_norm=norm, lm_head=head,
                       decoder_layers=layers, rotary_emb=rotary, hf_config=config,
                       hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                       vocab_size=head.out_features, rope_layer_types=tuple(types) if takes_type else None)


def _decoder_parts(model) -> tuple[torch.nn.ModuleList, torch.nn.Module | None]:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers (model.model.layers)")
    return layers, getattr(base, "norm", None)


class TargetModel:
    """A causal LM ready for paged, packed, tree-masked forwards.

    Attributes a drafter may use: ``parts`` (embeddings, final norm, LM head, layers: see
    :class:`TargetParts`), ``tokenizer`` (or None), ``hf_config``, ``num_layers``,
    ``vocab_size``, ``hidden_size``, ``device``, ``dtype``, ``eos_token_ids``,
    ``max_model_len``, ``name``, ``path`` (the directory its weights came from, or None),
    ``tensor_parallel_size`` (ranks its decoder layers are sharded over: a drafter may use
    the embeddings, final norm and LM head alone, never those layers);
    ``model`` is the transformers module itself.
    """

    def __init__(self, model, tokenizer, name: str, max_model_len: int | None = None, path=None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.hf_config = text_config(model.config)
        self.num_layers = self.hf_config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().out_features
        self.hidden_size = self.hf_config.hidden_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_model_len = max_model_len or getattr(self.hf_config, "max_position_embeddings", None) or 4096
        self.eos_token_ids = self._eos_ids()
        model.set_attn_implementation(ATTENTION_NAME)
        self._layers, self._norm = _decoder_parts(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._invariant = False
        self._hooked: set[int] = set()  # layers with a hook writing ``_captured``
        self._capturing: frozenset[int] = frozenset()  # layers whose states this forward keeps
        self._linear_forwards: tuple[bool, bool] | None = None
        self._compiled: dict[frozenset[int], Callable] | None = None  # a graph per set of layers kept
        self._layer_sets: dict[frozenset[int], frozenset[int]] = {}
        self._lock = threading.Lock()
        layers = self._probe_kv_layers()
        #: per attention layer, (K/V heads, key size, value size)
        self.layer_shapes = [layer[:3] for layer in layers]
        #: per attention layer, its sliding window (None: it reads every position)
        self.layer_windows = [layer.window for layer in layers]

    #: ranks the target is sharded over (:mod:`specdec.parallel`); its decoder layers run
    #: only with every rank taking part
    tensor_parallel_size = 1

    def check_healthy(self) -> None:
        """Raise if the target can no longer run (a tensor-parallel worker is gone)."""

    def new_kv_cache(self, num_blocks: int, block_size: int, num_window_blocks: int = 0) -> PagedKVCache:
        """A KV cache of ``num_blocks`` blocks for this target's layers, its sliding-window
        layers' pools of ``num_window_blocks`` blocks where given (:class:`PagedKVCache`)."""
        return PagedKVCache(self.layer_shapes, num_blocks, block_size, self.dtype, self.device, self.layer_windows,
                            num_window_blocks)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.hf_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids

    def _probe_kv_layers(self) -> list[KVLayer]:
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        return probe_kv_layers(lambda meta: self.model(input_ids=one, position_ids=one, use_cache=False,
                                                       logits_to_keep=1, specdec=meta), type(self.model).__name__)

    def set_linear_forwards(self, batch_invariant: bool, prepack: bool) -> None:
        """Choose every linear layer's forward: batch-invariant
        (:func:`specdec.kernels.make_linear_invariant`) where ``batch_invariant`` asks and the
        stock product is not already, else on its weight prepacked for oneDNN where
        ``prepack`` asks and that is exact (:func:`specdec.kernels.prepack_linear`), else
        the stock one. The attention half of the invariant mode is
        :attr:`ForwardMetadata.batch_invariant`."""
        if self._linear_forwards == (batch_invariant, prepack):
            return
        self._linear_forwards = (batch_invariant, prepack)
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                restore_linear(module)
                if not (batch_invariant and make_linear_invariant(module)) and prepack:
                    prepack_linear(module)

    @property
    def parts(self) -> TargetParts:
        """What drafters reuse of the target: embeddings, final norm, LM head, layers, sizes."""
        return target_parts(self.model)

    def capture_hidden_layers(self, layers: list[int]) -> None:
        """Hook these layers (``-1``: final norm output), so that a forward whose
        :attr:`ForwardMetadata.hidden_layers` names them returns their hidden states. A
        forward keeps the states it names and no others (nor does its compiled graph)."""
        for layer in sorted(layers):
            if layer in self._hooked:
                continue
            if layer == -1:
                module = self._norm
                if module is None:
                    raise TypeError(f"{type(self.model).__name__} has no final norm module to capture")
            elif 0 <= layer < self.num_layers:
                module = self._layers[layer]
            else:
                raise ValueError(f"hidden layer {layer} asked for; the target has layers 0..{self.num_layers - 1} "
                                 "(or -1 for the final normalised state)")
            module.register_forward_hook(self._make_hook(layer))
            self._hooked.add(layer)

    def _make_hook(self, layer: int):
        def hook(_module, _inputs, output):
            if layer in self._capturing:
                out = output[0] if isinstance(output, tuple) else output
                self._captured[layer] = out[0]

        return hook

    def compile(self, batch_invariant: bool = False) -> None:
        """Run the forwards through ``torch.compile`` from now on (``engine.compile``).

        Inductor fuses what the transformers code does between the matrix products (norms,
        rotary embeddings, activations, residuals: on the CPU a third of a decode step goes
        to dispatching them) and, on the CPU, freezes the weights and packs them for oneDNN
        itself where the linear layers are stock (``set_linear_forwards(False, False)``; a
        quantized target's layers are not, and it is not frozen);
        products that share an input (q/k/v, gate/up) become one. Three graphs, each
        compiled on its first call: one token of one sequence (a decode at batch 1) and
        two or more tokens of one sequence (a prompt chunk, a draft chain or tree at batch
        1), whose attention is traced into the graph (:class:`SequenceKV`), and two or more
        tokens of several sequences, whose attention is one opaque operator
        (``torch.ops.specdec.paged_attention``: a batch's layout is Python), as is any
        layer with a sliding window or soft-capping. A graph of two or more tokens keeps at
        least two logits rows (one row is asked as two). Where the paged attention runs a
        Triton kernel (CUDA), several tokens of one sequence take the operator too.

        ``batch_invariant`` (a target on the integer-dot kernels, see
        :func:`specdec.numerics.auto.compiles_invariant`): one graph serves every step,
        its attention the CPU invariant kernel called from the graph (:class:`KeyRows`),
        its bfloat16 roundings those of the eager code (``emulate_precision_casts``, or
        capturing a hidden state would change the fusion and the numerics with it), its
        wrapper C++ (``cpp_wrapper``: a Python wrapper's ~240 operator calls cost a third
        of a decode step; the first compilation takes longer). A step of one token runs
        its token twice, since a graph traced at one token is compiled apart, with other
        kernels: each token's result then depends on its own sequence only, whatever
        shares the step. Where a drafter reads hidden states, the graph keeps the layers
        it reads and no others: every state kept is a buffer inductor may not reuse and a
        fusion it may not make, in every step, at the price of a graph per set of layers
        read, compiled on its first forward.

        Engines sharing the target (:mod:`specdec.model.kept`) compile it once: a second
        call with the same ``batch_invariant`` keeps the graphs there are.
        """
        if self._compiled is not None:
            if batch_invariant != self._invariant:
                raise RuntimeError(f"{self.name} is compiled with batch_invariant={self._invariant}; an engine "
                                   f"asking for {batch_invariant} needs a target of its own")
            return
        model = self.model
        self._invariant = batch_invariant
        self._trace_sequences = not paged_attention_is_triton(self.device)
        # Freezing packs stock linear weights for oneDNN; a quantized target has none, and
        # freezing's passes run again in every process (the embedded model in w4a8 reached
        # its first token 60 s after start frozen, 23 s not, torch's caches warm).
        self._freeze = self.device.type == "cpu" and any(isinstance(m, torch.nn.Linear) for m in model.modules())
        self._compiled = {}
        if self._norm is not None:
            self.capture_hidden_layers([-1])

    @property
    def lone_token_rows(self) -> int:
        """Rows a forward of one token runs: two on the batch-invariant compiled graph (a lone
        token runs twice, :meth:`_invariant_logits`), so a decode step's first draft token
        adds no row there; one elsewhere."""
        return 2 if self._compiled is not None and self._invariant else 1

    def _graph_states(self, layers: frozenset[int]) -> frozenset[int]:
        """The states a compiled forward asked for ``layers`` keeps: the final norm's too,
        where there is one, so that plain decoding and the drafters that read the last state
        (EAGLE, MTP, Medusa, ReDrafter) share one graph. The norm's output is written for
        the head anyway: keeping it costs nothing, a second graph costs a compilation."""
        return layers | {-1} if self._norm is not None else layers

    def _graph(self, layers: frozenset[int]) -> Callable:
        """The compiled forward keeping ``layers``' states (:meth:`_graph_states`): a code
        object of its own, so that its graphs serve that set only."""
        layers = self._graph_states(layers)
        graph = self._compiled.get(layers)
        if graph is None:
            model = self.model

            def logits(input_ids, position_ids, rows, sequence):
                _one_size_symbol_per_pool_size(sequence)
                return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=rows,
                             specdec=sequence).logits

            graph = self._compiled[layers] = compile_unguarded(logits)
        return graph

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One packed forward. Returns float32 logits of ``logits_rows`` and the hidden
        states of ``meta.hidden_layers``.

        ``input_ids`` and ``positions`` are ``[T]``; every token's K/V lands in its slot
        (``meta.layout``). One forward at a time: engines sharing the target may run in
        different threads.
        """
        if self._compiled is None:
            logits, captured = self.forward_raw(input_ids, positions, meta, logits_rows)
            return logits.float(), captured
        with self._capturing_states(self._graph_states(meta.hidden_layers)):
            logits = self._compiled_logits(input_ids[None], positions[None], meta, logits_rows)
            tokens = len(input_ids)  # a token run twice (_invariant_logits) is captured twice
            return logits, {layer: self._captured[layer][:tokens] for layer in meta.hidden_layers}

    def forward_raw(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                    logits_rows: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The eager forward as :meth:`forward`, its logits in the model's dtype: what a
        CUDA graph captures (:mod:`specdec.executor.cuda_graphs`), which reads its outputs after a replay."""
        with self._capturing_states(meta.hidden_layers):
            out = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
                             logits_to_keep=logits_rows, specdec=meta)
            return out.logits[0], {layer: self._captured[layer] for layer in meta.hidden_layers}

    @contextlib.contextmanager
    def _capturing_states(self, layers: frozenset[int]):
        """The hooks of ``layers`` keep their states for one forward, one forward at a time.
        The set is interned: a compiled graph is guarded on it. Outside a forward no hook
        keeps anything (a layer-skip draft runs the target's own layers)."""
        with self._lock:
            self._captured, self._capturing = {}, self._layer_sets.setdefault(layers, layers)
            try:
                yield
            finally:
                self._capturing = frozenset()

    def _compiled_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                         rows: torch.Tensor) -> torch.Tensor:
        count = len(rows)
        if self._invariant:
            return self._invariant_logits(ids, positions, meta, rows)
        # Inference-mode copies: the graphs' guards tell them from tensors made outside it.
        ids, positions, rows = ids.clone(), positions.clone(), rows.repeat(2 if count == 1 and ids.shape[1] > 1 else 1)
        if ids.shape[1] > 1:
            for tensor, dim in ((ids, 1), (positions, 1), (rows, 0)):
                torch._dynamo.mark_dynamic(tensor, dim)
        traced = ids.shape[1] == 1 or (self._trace_sequences and len(meta.layout.seqs) == 1)
        sequence = self._sequence_kv(meta) if traced else None
        compiled_step.meta = meta
        try:
            # Set for the call, where compiling happens (freezing passed as an option of
            # torch.compile left the weights unpacked, torch 2.13). The products that share
            # an input (q/k/v, gate/up) run as one.
            with torch._inductor.config.patch({**NO_ASSERTS_OPTIONS, "freezing": self._freeze,
                                               "cpp.enable_concat_linear": True}):
                return self._graph(meta.hidden_layers)(ids, positions, rows, sequence)[0, :count].float()
        finally:
            compiled_step.meta = None

    def _invariant_logits(self, ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                          rows: torch.Tensor) -> torch.Tensor:
        key_rows, layout, windows = meta.layout.invariant_key_rows, meta.layout, meta.cache.window_blocks
        step = KeyRows(tuple(meta.cache.keys), tuple(meta.cache.values), layout.slot_mapping, key_rows["slots"],
                       key_rows["key_pos"], key_rows["offset"], key_rows["count"], layout.query_positions,
                       *((windows.slots(layout.slot_mapping), windows.slots(key_rows["slots"]))
                         if windows is not None else ()))
        count = len(rows)
        # Inference-mode copies (repeat copies); one token runs twice, as a graph of one would
        # be compiled apart, and one logits row is asked as two.
        copies = 2 if ids.shape[1] == 1 else 1
        ids, positions, rows = ids.repeat(1, copies), positions.repeat(1, copies), rows.repeat(2 if count == 1 else 1)
        per_token = ("slots", "offset", "count", "query_pos", "window_slots")
        step = step._replace(**{name: getattr(step, name).repeat(copies if name in per_token else 1)
                                for name in step._fields[2:] if getattr(step, name) is not None})
        for tensor, dim in ((ids, 1), (positions, 1), (rows, 0), *((t, 0) for t in step.row_tensors())):
            torch._dynamo.mark_dynamic(tensor, dim)
        _pools_dynamic(step.keys, step.values)
        with torch._inductor.config.patch({**CPP_WRAPPER_OPTIONS, "emulate_precision_casts": True}):
            return self._graph(meta.hidden_layers)(ids, positions, rows, step)[0, :count].float()

    @staticmethod
    def _sequence_kv(meta: ForwardMetadata) -> SequenceKV:
        """The one sequence of ``meta``'s step as graph inputs, its sizes dynamic (the
        cache's too, :func:`_pools_dynamic`; no mask for one token). A context of one slot
        (a one-token prompt) is given twice, or the one-token graph would be specialised to
        it: two equal scores weigh the value 1/2 + 1/2, exactly."""
        slots, context, mask = meta.layout.slot_mapping.clone(), meta.layout.context_slots, meta.layout.dense_mask
        context = context.repeat(2) if len(context) == 1 else context.clone()
        torch._dynamo.mark_dynamic(context, 0)
        if mask is not None:
            mask = mask.clone()
            for tensor, dim in ((slots, 0), (mask, 0), (mask, 1)):
                torch._dynamo.mark_dynamic(tensor, dim)
        _pools_dynamic(meta.cache.keys, meta.cache.values)
        return SequenceKV(tuple(meta.cache.keys), tuple(meta.cache.values), slots, context, mask)
