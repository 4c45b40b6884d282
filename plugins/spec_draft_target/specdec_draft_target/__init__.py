"""Draft-target speculation: a smaller model drafts, the target verifies.

Options (defaults in brackets):
    max_draft_len [2]: draft tokens per step (one draft-model forward each); the best with
        the shipped draft on the embedded model.
    speculative_model [the shipped draft on the embedded model, else none]: a model
        directory or .gguf with the target's vocabulary (checked at load: a mismatched
        tokenizer is an error naming both models), or a directory `specdec train
        draft_target` wrote (its embeddings and LM head are the target's). Alias:
        speculative_model_dir.
    draft_layers [a quarter of the target's layers]: with no draft model, the draft is the
        target's own first N layers with its final norm and LM head (no extra weights).
    draft_kv_cache_blocks [1024]: the draft model's KV pool, in blocks of 16 tokens.

At temperature 0 drafts are the draft model's argmax; otherwise they are sampled from the
draft distribution (after the request's temperature/top-k/top-p), which the core's
rejection sampler receives as ``draft_probs`` so the output keeps the target's
distribution. A trained draft may read a reduced vocabulary (the tokens it was trained to
predict); its probabilities are zero elsewhere, which rejection sampling handles exactly.
"""

from __future__ import annotations

import copy

import attrs
import torch

from specdec.plugin_api import (
    EMBEDDED_NAME,
    SECTION,
    ChainStop,
    DecodingType,
    Drafter,
    DraftInput,
    DraftProposal,
    DraftRunner,
    ModelLoadError,
    SpeculativeConfig,
    TargetModel,
    causal_lm_forward,
    check_target,
    head_rows,
    hookimpl,
    in_range,
    load_causal_lm,
    load_draft_vocab,
    load_tokenizer,
    pick_draft_token,
    read_config,
    resolve_model_dir,
)

from .checkpoint import SHIPPED_DRAFT, load_trained_draft
from .trainer import DraftTargetTrainer


@attrs.frozen(kw_only=True)
class DraftTargetConfig(SpeculativeConfig):
    max_draft_len: int = attrs.field(default=2, validator=in_range(1, 64))
    speculative_model: str | None = None
    draft_layers: int | None = attrs.field(default=None, validator=in_range(1, None))
    draft_kv_cache_blocks: int = attrs.field(default=1024, validator=in_range(1, None))


def layer_skip_model(target_model, layers: int):
    """The target's first ``layers`` decoder layers, its final norm and head, sharing weights."""
    base_name = target_model.base_model_prefix
    base = getattr(target_model, base_name)
    draft_base = copy.copy(base)
    draft_base._modules = dict(base._modules)
    draft_base.layers = torch.nn.ModuleList(list(base.layers)[:layers])
    draft_base.config = copy.copy(base.config)
    draft_base.config.num_hidden_layers = layers
    draft = copy.copy(target_model)
    draft._modules = dict(target_model._modules)
    setattr(draft, base_name, draft_base)
    draft.config = draft_base.config
    return draft


def check_same_vocabulary(target: TargetModel, draft_model, tokenizer, draft_name: str) -> None:
    if target.tokenizer is not None and tokenizer is not None:
        if target.tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ModelLoadError(f"draft model {draft_name!r} has a different tokenizer from the target "
                                 f"{target.name!r}; draft_target needs the same vocabulary")
    vocab = draft_model.get_output_embeddings().weight.shape[0]
    if vocab > target.vocab_size:
        raise ModelLoadError(f"draft model {draft_name!r} has {vocab} output tokens, more than the "
                             f"target {target.name!r} ({target.vocab_size}); they must share a vocabulary")


def load_draft(config: DraftTargetConfig, target: TargetModel) -> tuple[torch.nn.Module, torch.Tensor | None]:
    """The draft causal LM and its draft vocabulary (None: the whole vocabulary)."""
    source = config.speculative_model
    if source is None and config.draft_layers is None and target.name == EMBEDDED_NAME:
        source = str(SHIPPED_DRAFT)
    if source is not None:
        path = resolve_model_dir(source)
        meta = read_config(path).get(SECTION)
        if meta is not None:  # written by `specdec train draft_target`
            check_target(path, meta, target)
            return load_trained_draft(path, target), load_draft_vocab(path, target.vocab_size)
        model = load_causal_lm(path, target.dtype, target.device)
        check_same_vocabulary(target, model, load_tokenizer(path), source)
        return model, None
    if target.tensor_parallel_size > 1:
        raise ModelLoadError(f"speculative_config.draft_layers: a layer-skip draft runs the target's own decoder "
                             f"layers, which are sharded over {target.tensor_parallel_size} ranks and run only with "
                             "all of them; give a separate draft model (speculative_config.speculative_model)")
    layers = config.draft_layers or max(1, target.num_layers // 4)
    if layers >= target.num_layers:
        raise ModelLoadError(f"speculative_config.draft_layers: {layers} is not fewer than the target's "
                             f"{target.num_layers} layers")
    return layer_skip_model(target.model, layers), None


class DraftTargetDrafter(Drafter):
    def __init__(self, config: DraftTargetConfig, target: TargetModel):
        super().__init__(config, target)
        self.model, self.draft_vocab = load_draft(config, target)
        head = self.model.get_output_embeddings()
        if self.draft_vocab is not None:
            head = head_rows(head.weight, self.draft_vocab.to(head.weight.device))
        self.head = head
        self.runner = DraftRunner.for_module(causal_lm_forward(self.model), config.draft_kv_cache_blocks, 16,
                                             target.dtype, target.device)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    @hookimpl
    def compile_draft(self, target):
        self.runner.compile()

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        seqs = [self.runner.sync(r.request_id, r.token_ids) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        inputs = {i: DraftInput(seq, seq.token_ids[seq.num_computed:]) for i, seq in enumerate(seqs)}
        stops = [ChainStop(self.config.min_chain_probability) for _ in requests]
        while inputs:
            order = list(inputs)
            outs = self.runner.forward([inputs[i] for i in order])
            if outs is None:
                break
            logits = self._logits(torch.cat(outs))
            inputs = {}
            for row, i in enumerate(order):
                req = requests[i]
                token, q = pick_draft_token(logits[row], req.sampling_params, req.generator,
                                            self.target.vocab_size, self.draft_vocab)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
                if len(drafts[i]) < draft_lens[i] and stops[i].grows_past(logits[row], token, q):
                    inputs[i] = DraftInput(seqs[i], [token])
        return [DraftProposal(token_ids=d, draft_probs=torch.stack(p) if p else None,
                              sibling_sampling="iid" if p else "deterministic") if d else None
                for d, p in zip(drafts, probs)]

    @hookimpl
    def on_request_finished(self, request):
        self.runner.release(request.request_id)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="draft_target", aliases=("DraftTarget",), config_class=DraftTargetConfig,
                          drafter_class=DraftTargetDrafter, trainer_class=DraftTargetTrainer,
                          description="a smaller draft model (trained by `specdec train draft_target`), "
                                      "or a layer-skip draft of the target"))


__all__ = ["SHIPPED_DRAFT", "DraftTargetConfig", "DraftTargetDrafter", "DraftTargetTrainer"]
