"""Logits processing, applied identically to target and draft distributions.

Order (as in vLLM and transformers): the request's penalties, biases and ``min_tokens``
(:func:`shape_logits`, on the target's rows, each with its own history), then
temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import torch

from ..drafting.interface import DraftProposal
from ..kernels import argmax_rows, cpu_kernel_available, sampling_probs_cpu
from ..sampling_params import SamplingParams
from .acceptance import draw


def shape_logits(logits: torch.Tensor, histories: list[list[int]], params: SamplingParams, prompt_len: int,
                 end_ids: frozenset[int] | set[int]) -> torch.Tensor:
    """The logits a request samples from: row ``i`` after the repetition penalty (over
    ``histories[i]``, the prompt and the output before the row's token), the frequency and
    presence penalties (over the output part, ``histories[i][prompt_len:]``), ``logit_bias``,
    and, while the output is shorter than ``min_tokens``, ``end_ids`` (EOS and the stop
    token ids) made impossible. Each row depends on its own history only, so a verified
    draft position gets what plain decoding would have given it there."""
    if not params.shapes_logits:
        return logits
    logits = logits.float().clone()
    penalty = params.repetition_penalty
    for row, history in enumerate(histories):
        if penalty != 1.0:  # CTRL's: positive logits of tokens seen are divided, negative ones multiplied
            seen_ids = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
            seen = logits[row, seen_ids]
            logits[row, seen_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
        output = history[prompt_len:]
        if (params.frequency_penalty or params.presence_penalty) and output:
            ids, counts = torch.tensor(output, device=logits.device).unique(return_counts=True)
            logits[row, ids] -= params.frequency_penalty * counts.float() + params.presence_penalty
        if len(output) < params.min_tokens:
            logits[row, sorted(end_ids | set(params.stop_token_ids))] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[:, ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution ``[rows, vocab]`` (float32) after temperature, top-k, top-p, min-p.

    Call it on draft logits too, so that draft and target distributions match in kind.
    Greedy requests (temperature 0) get a one-hot distribution of the argmax. On a CPU
    with specdec's kernels built, the sampling kernel computes it (the same rules, a few
    passes over a row instead of a dozen operations); elsewhere :func:`probs_from_logits_torch`.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax_rows(logits), logits.shape[-1]).float()
    if logits.device.type == "cpu" and cpu_kernel_available():
        return sampling_probs_cpu(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    return probs_from_logits_torch(logits, params)


def probs_from_logits_torch(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """:func:`probs_from_logits` of a sampled request in torch operations: the reference
    the sampling kernel is tested against, and the version off the CPU."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = probs.masked_fill(probs < nucleus_floor(probs, params.top_p), 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


class TargetRows:
    """A request's target distributions for one step, each row computed when first read.

    Row 0 is the root's, row ``k + 1`` draft node ``k``'s, each after :func:`shape_logits`
    (with the history of its own path) and :func:`probs_from_logits`. Rejection sampling
    reads only the rows of the nodes on the path it walks, and a row costs a pass over the
    whole vocabulary several times over, so a sampled step computes the rows it reads and
    not the rest; :meth:`all` gives every row at once where a rule needs them all.
    """

    def __init__(self, logits: torch.Tensor, history: list[int], proposal: DraftProposal | None,
                 params: SamplingParams, prompt_len: int, end_ids: frozenset[int]):
        self.logits, self.history, self.proposal = logits, history, proposal
        self.params, self.prompt_len, self.end_ids = params, prompt_len, end_ids
        self._rows: dict[int, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self._rows:
            self._rows[row] = self._probs(self.logits[row:row + 1], [self._history(row)])[0]
        return self._rows[row]

    def all(self) -> torch.Tensor:
        """``[rows, vocab]``: every row's distribution, computed together."""
        return self._probs(self.logits, [self._history(row) for row in range(len(self))])

    def _probs(self, logits: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
        shaped = shape_logits(logits, histories, self.params, self.prompt_len, self.end_ids)
        return probs_from_logits(shaped, self.params)

    def _history(self, row: int) -> list[int]:
        """The tokens before row ``row``'s distribution: the request's, then its node's path."""
        if not self.params.shapes_logits or row == 0:
            return self.history  # read only by shape_logits, and only when the params shape logits
        path, node = [], row - 1
        while node >= 0:
            path.append(self.proposal.token_ids[node])
            node = self.proposal.parents[node]
        return self.history + path[::-1]


#: likeliest tokens a row's nucleus is first looked for among (doubled until it fits)
NUCLEUS_WINDOW = 64
#: the widest window before the whole row: selecting more costs as much as a sort
NUCLEUS_WINDOW_MAX = 1024


def nucleus_floor(probs: torch.Tensor, top_p: float, window: int = NUCLEUS_WINDOW) -> torch.Tensor:
    """``[rows, 1]``: each row's smallest probability inside its top-p nucleus.

    A token is in the nucleus when the tokens strictly likelier than it hold less than
    ``top_p`` of the mass, so tokens of equal probability are in or out together (the
    nucleus does not depend on how a sort orders ties) and the likeliest token always is.
    The nucleus is looked for among a row's ``window`` likeliest tokens, the window
    doubling for the rows whose nucleus reaches its end (up to :data:`NUCLEUS_WINDOW_MAX`,
    then the whole row): a partial selection instead of a sort of the vocabulary, which
    costs milliseconds a row on a CPU (a flat row, whose nucleus is thousands of tokens,
    costs up to about 1.6 sorts).
    """
    window = min(window, probs.shape[-1])
    whole = window == probs.shape[-1]  # a sort of the whole row is faster than a selection of all of it
    top = (probs.sort(dim=-1, descending=True) if whole else probs.topk(window, dim=-1)).values
    # the last value with less than top_p before it (in the window's order) is the floor: its
    # equals after it in that order, whatever their mass, are not below it (a top_p that
    # float32 rounds to 0 leaves nothing inside: the likeliest token is the floor)
    inside = (top.cumsum(-1) - top < top_p).sum(-1, keepdim=True)
    floor = top.gather(-1, (inside - 1).clamp(min=0))
    wider = (inside[:, 0] == window) & (not whole)
    if wider.any():
        floor[wider] = nucleus_floor(probs[wider], top_p,
                                     2 * window if 2 * window <= NUCLEUS_WINDOW_MAX else probs.shape[-1])
    return floor


def pick_draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                     vocab_size: int, draft_to_target: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """A draft token from one row of draft logits, as a target token id.

    ``logits`` cover the draft vocabulary: target ids ``draft_to_target`` (``None``: the
    target's first ``len(logits)`` ids). Requests that do not draw drafts
    (:attr:`SamplingParams.draws_drafts`: greedy and seeded ones) get the argmax and no
    distribution; the others a draw from the processed draft distribution, returned
    with it over the whole target vocabulary (zero outside the draft vocabulary) for
    the rejection sampler.
    """
    if not params.draws_drafts:
        best = int(argmax_rows(logits))
        return (best if draft_to_target is None else int(draft_to_target[best])), None
    q_small = probs_from_logits(logits[None], params)[0]
    pick = draw(q_small, generator)
    q = torch.zeros(vocab_size, device=q_small.device)
    if draft_to_target is None:
        q[:q_small.shape[-1]] = q_small
        return pick, q
    q[draft_to_target.to(q.device)] = q_small
    return int(draft_to_target[pick]), q
