"""Draft-target speculation: a smaller model drafts, the target verifies.

Options (defaults in brackets):
    max_draft_len [4]: draft tokens per step (one draft-model forward each).
    speculative_model [none]: a model directory or .gguf with the target's vocabulary;
        checked at load, a mismatched tokenizer is an error naming both models.
    draft_layers [a quarter of the target's layers]: without speculative_model, the draft is
        the target's own first N layers with its final norm and LM head (no extra weights).
    draft_kv_cache_blocks [1024]: the draft model's KV pool, in blocks of 16 tokens.

At temperature 0 drafts are the draft model's argmax; otherwise they are sampled from the
draft distribution (after the request's temperature/top-k/top-p), which the core's
rejection sampler receives as ``draft_probs`` so the output keeps the target's distribution.
"""

from __future__ import annotations

import copy

import attrs
import torch

from specdec import DecodingType, Drafter, DraftProposal, hookimpl
from specdec.config import SpeculativeConfig, in_range
from specdec.draft_runner import DraftModelRunner
from specdec.errors import ModelLoadError
from specdec.executor.model_runner import TargetModel
from specdec.models import load_causal_lm, load_tokenizer, resolve_model_dir
from specdec.sampler import probs_from_logits


@attrs.frozen(kw_only=True)
class DraftTargetConfig(SpeculativeConfig):
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


def check_same_vocabulary(target: TargetModel, draft: TargetModel, draft_name: str) -> None:
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ModelLoadError(f"draft model {draft_name!r} has a different tokenizer from the target "
                                 f"{target.name!r}; draft_target needs the same vocabulary")
    if draft.vocab_size > target.vocab_size:
        raise ModelLoadError(f"draft model {draft_name!r} has {draft.vocab_size} output tokens, more than the "
                             f"target {target.name!r} ({target.vocab_size}); they must share a vocabulary")


class DraftTargetDrafter(Drafter):
    def __init__(self, config: DraftTargetConfig, target: TargetModel):
        super().__init__(config, target)
        if config.speculative_model:
            path = resolve_model_dir(config.speculative_model)
            model = load_causal_lm(path, target.dtype, target.device)
            draft = TargetModel(model, load_tokenizer(path), str(config.speculative_model))
            check_same_vocabulary(target, draft, config.speculative_model)
        else:
            layers = config.draft_layers or max(1, target.num_layers // 4)
            if layers >= target.num_layers:
                raise ModelLoadError(f"speculative_config.draft_layers: {layers} is not fewer than the target's "
                                     f"{target.num_layers} layers")
            draft = TargetModel(layer_skip_model(target.model, layers), target.tokenizer,
                                f"{target.name} (first {layers} layers)")
        self.runner = DraftModelRunner(draft, config.draft_kv_cache_blocks)

    def _pick(self, logits: torch.Tensor, req) -> tuple[int, torch.Tensor | None]:
        params = req.sampling_params
        if params.greedy:
            return int(logits.argmax()), None
        q = probs_from_logits(logits[None], params)[0]
        if q.shape[-1] < self.target.vocab_size:  # a draft head narrower than the target's
            q = torch.nn.functional.pad(q, (0, self.target.vocab_size - q.shape[-1]))
        return int(torch.multinomial(q, 1, generator=req.generator)), q

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        seqs = [self.runner.sync(r.request_id, r.token_ids) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for _ in range(max(draft_lens)):
            logits = self.runner.forward([seqs[i] for i in active])
            if logits is None:
                break
            still = []
            for row, i in enumerate(active):
                token, q = self._pick(logits[row], requests[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
                if len(drafts[i]) < draft_lens[i]:
                    seqs[i].token_ids.append(token)
                    still.append(i)
            active = still
            if not active:
                break
        return [DraftProposal(token_ids=d, draft_probs=torch.stack(p) if p else None,
                              sibling_sampling="iid" if p else "deterministic") if d else None
                for d, p in zip(drafts, probs)]

    @hookimpl
    def on_request_finished(self, request):
        self.runner.release(request.request_id)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="draft_target", aliases=("DraftTarget",), config_class=DraftTargetConfig,
                          drafter_class=DraftTargetDrafter,
                          description="a smaller draft model, or a layer-skip draft of the target"))
