"""DeepSeek-style multi-token prediction (``mtp``): an MTP module over the target's last
state, reused autoregressively up to ``max_draft_len``, drafts an EAGLE-2 dynamic tree (as
SGLang drafts DeepSeek's MTP with its EAGLE worker's top-k) or a chain, whichever the
adaptive planner finds pays more for the request.

Options (defaults in brackets; TensorRT-LLM's names):
    speculative_model [the target's own MTP layers when its config declares them
        (``num_nextn_predict_layers``), else the module shipped for the embedded model]:
        a directory in DeepSeek-V3's layout, such as one ``specdec train mtp`` wrote.
        Alias: speculative_model_dir.
    max_draft_len [3]: draft depth; one module drafts every depth, each step reading the
        state the step before produced.
    use_dynamic_tree [true], dynamic_tree_max_topK [3]: each level expands the topK best
        frontier nodes into their topK best children; after max_draft_len levels the
        max_total_draft_tokens [10] best nodes by cumulative log-probability are verified
        (:class:`specdec.config.TreeDraftConfig`); with ``adaptive`` on (the default), each
        step and request gets the tree or the chain, whichever pays more by live
        estimates. ``use_dynamic_tree: false`` drafts chains only.
    num_nextn_predict_layers [1]: modules used from the checkpoint. specdec drafts with
        the first (as SGLang does for DeepSeek); more would need a draft cache per module.
    draft_kv_cache_blocks [1024]: the module's KV pool, in blocks of 16 tokens.
    use_relaxed_acceptance_for_thinking [false], relaxed_topk [1], relaxed_delta [0.0]:
        LOSSY, opt-in: inside a thinking phase a draft token is accepted when it is among
        the target's relaxed_topk most likely tokens with probability at least the top
        token's minus relaxed_delta (TensorRT-LLM's rule, on the softmax of the raw
        logits). begin_thinking_phase_token / end_thinking_phase_token [the tokenizer's
        ``<think>`` / ``</think>`` when it has them] delimit the phase; with no begin
        token every position counts as thinking. Outside it, verification is exact.

Without relaxed acceptance, verification is lossless: greedy output equals the target's
greedy output; sampled chains are drawn from the draft distribution (rejection sampling),
trees take the top-k tokens deterministically.
"""

from __future__ import annotations

import attrs

from specdec.plugin_api import DecodingType, FieldError, RelaxedAcceptance, TreeDraftConfig, hookimpl, in_range

from .checkpoint import SHIPPED_MODULE, load_module, save_module
from .drafter import MTPDrafter
from .model import MTPModule, build_module
from .trainer import MTPTrainer

#: Delimiters of a thinking phase, looked up in the tokenizer when not given.
THINKING_TOKENS = ("<think>", "</think>")


@attrs.frozen(kw_only=True)
class MTPConfig(TreeDraftConfig):
    max_draft_len: int = attrs.field(default=3, validator=in_range(1, 64))
    use_dynamic_tree: bool = True
    dynamic_tree_max_topK: int = attrs.field(default=3, validator=in_range(1, 64))  # noqa: N815
    dynamic_tree_nodes = 10  # the best node budget on the embedded model
    speculative_model: str | None = None
    num_nextn_predict_layers: int = attrs.field(default=1)
    draft_kv_cache_blocks: int = attrs.field(default=1024, validator=in_range(1, None))
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = attrs.field(default=1, validator=in_range(1, 64))
    relaxed_delta: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    begin_thinking_phase_token: int | None = None
    end_thinking_phase_token: int | None = None

    @num_nextn_predict_layers.validator
    def _one_module(self, attribute, value):
        if value != 1:
            raise FieldError(attribute.name, f"got {value}; specdec drafts with one MTP module, reused for every "
                                             "depth (max_draft_len sets the depth): give 1")

    def acceptance_rule(self, tokenizer=None):
        """Relaxed acceptance in thinking phases when switched on: NOT lossless there."""
        if not self.use_relaxed_acceptance_for_thinking:
            return None
        begin, end = self.begin_thinking_phase_token, self.end_thinking_phase_token
        if begin is None and end is None and tokenizer is not None:
            vocab = tokenizer.get_vocab()
            if all(t in vocab for t in THINKING_TOKENS):
                begin, end = (vocab[t] for t in THINKING_TOKENS)
        return RelaxedAcceptance(self.relaxed_topk, self.relaxed_delta, begin, end)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="mtp", aliases=("MTP",), config_class=MTPConfig, drafter_class=MTPDrafter,
                          trainer_class=MTPTrainer, lossy_options=("use_relaxed_acceptance_for_thinking",),
                          description="DeepSeek-V3 multi-token prediction module (the target's own MTP layers, "
                                      "or one trained with `specdec train mtp`), reused for a chain or a dynamic tree"))


__all__ = ["SHIPPED_MODULE", "MTPConfig", "MTPDrafter", "MTPModule", "MTPTrainer", "build_module", "load_module",
           "save_module"]
