"""Tokens into requests: each request takes the tokens its step kept, one by one, until a
stop condition (EOS, a stop token, ``max_tokens``, the context's end, a stop string), with
their logprobs where asked; a request's grammar moves on with them.

Tokens accepted from a draft may run past a stop; they are dropped, so speculative output
ends exactly where plain decoding's would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..drafting.interface import StepResult
from .request import Request
from .step_items import StepItem, StepOutput


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int] | frozenset[int], tokenizer, max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def process(self, items: list[StepItem], results: list[StepResult], logits: torch.Tensor) -> list[StepOutput]:
        """Append each result's tokens to its request; score the logprobs asked for."""
        asks, askers = [], []  # (logits rows, tokens, top-k) and the index of the result asking
        for i, (it, res) in enumerate(zip(items, results)):
            top = it.request.sampling_params.logprobs
            if res.new_token_ids and top is not None:
                asks.append(([it.logits_from, *(it.logits_from + 1 + n for n in res.accepted_nodes)],
                             res.new_token_ids, top))
                askers.append(i)
        prompt_asks = []
        for it in items:
            if it.prompt_rows:
                first = it.start + it.prompt_rows.start + 1
                rows = range(it.prompt_logits_from, it.prompt_logits_from + len(it.prompt_rows))
                prompt_asks.append(it.request)
                asks.append((rows, it.request.token_ids[first:first + len(it.prompt_rows)],
                             it.request.sampling_params.prompt_logprobs))
        answers = token_logprobs(asks, logits)
        for req, entries in zip(prompt_asks, answers[len(askers):]):
            req.prompt_logprobs += entries
        logprobs = dict(zip(askers, answers))
        outputs = []
        for i, (it, res) in enumerate(zip(items, results)):
            req = res.request
            out = self._append(req, res.new_token_ids)
            if req.grammar is not None and not out.finished:
                req.error = req.grammar.advance(out.new_token_ids)
                if req.error is not None:  # the request's own grammar: it alone fails
                    req.finish_reason = "error"
                    out.finished = True
            prompt_done = it.is_prefill and it.start + len(it.tokens) == req.prefill_target
            if prompt_done and req.sampling_params.max_tokens == 0:  # a prompt scored alone
                req.finish_reason = "length"
                out.finished = True
            if i in logprobs:  # the tokens kept: a stop may have cut the step's tokens short
                req.output_logprobs += logprobs[i][:len(out.new_token_ids)]
            outputs.append(out)
        return outputs

    def _append(self, req: Request, new: list[int]) -> StepOutput:
        """Append accepted tokens one by one, stopping at EOS, stop ids, max_tokens or the context end."""
        params = req.sampling_params
        appended: list[int] = []
        for tok in new:
            req.token_ids.append(tok)
            appended.append(tok)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            if (tok in self.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                req.finish_reason = "stop"
            elif req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        if params.stop and self.tokenizer is not None:
            kept = self._cut_at_stop_string(req, len(appended))
            del appended[kept:]
        return StepOutput(request=req, new_token_ids=appended, finished=req.finish_reason is not None)

    def _stop_hit(self, req: Request, num_output: int) -> str | None:
        """The output text of the first ``num_output`` tokens cut before its first stop
        string, or None if it holds none."""
        text = self.tokenizer.decode(req.output_token_ids[:num_output], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in req.sampling_params.stop) if i >= 0]
        return text[:min(hits)] if hits else None

    def _cut_at_stop_string(self, req: Request, num_new: int) -> int:
        """End the request at the token that completes a stop string, dropping the tokens
        after it; returns how many of the ``num_new`` new tokens remain."""
        total = req.num_output_tokens
        if self._stop_hit(req, total) is None:
            return num_new
        kept = next(k for k in range(1, num_new + 1) if self._stop_hit(req, total - num_new + k) is not None)
        del req.token_ids[len(req.token_ids) - (num_new - kept):]
        req.stop_text = self._stop_hit(req, req.num_output_tokens)
        req.finish_reason = "stop"
        return kept


def token_logprobs(asks: list[tuple[Sequence[int], list[int], int]], logits: torch.Tensor
                   ) -> list[list[dict[int, float]]]:
    """For each ask (logits rows, the token each row chose or predicts, how many top
    tokens), one dict per token: its log-probability under the target's own distribution
    at its row (its first key), then those of the most likely tokens there. One
    log-softmax over every ask's rows; a verified draft token's row is the row plain
    decoding would have read, so its figures are plain decoding's."""
    if not asks:
        return []
    flat = torch.tensor([r for rows, _, _ in asks for r in rows], device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, flat).float(), dim=-1)
    tokens = torch.tensor([t for _, ask_tokens, _ in asks for t in ask_tokens], device=logits.device)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(num_top for _, _, num_top in asks)
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out, row = [], 0
    for _, ask_tokens, num_top in asks:
        entries = []
        for token in ask_tokens:
            entry = {token: chosen[row]}
            for top_id, value in zip(top_ids[row][:num_top], top_values[row][:num_top]):
                entry.setdefault(top_id, value)
            entries.append(entry)
            row += 1
        out.append(entries)
    return out
