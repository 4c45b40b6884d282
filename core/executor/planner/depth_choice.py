"""The choice of draft depths: what a step costs with drafts, and the depths that pay most.

A step's price comes from the cost model (``costs``) and the attention the step does, which
depends on how the target's attention runs: the paged kernels attend each query over its
own keys; the torch reference pads groups of sequences to the widest and longest
(``padded``), and in the batch-invariant mode runs a step's draft trees as a batch of their
own (``tree_batch``). :func:`best_depths` adds draft positions one at a time, the best
expected gain per node first over all requests, and keeps the prefix with the highest
expected tokens per second.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import attrs

from ...kvcache.layout import TREE_BATCH_PAIRS, padded_group_cost, padded_groups

#: the attention work of a step's draft trees run as a batch of their own, in thousands of pairs
TREE_BATCH_WORK = TREE_BATCH_PAIRS / 1000


def attention_work(sequences: list[tuple[int, int]], padded: bool, trees: bool = False) -> float:
    """Attention of a step in thousands of query-key pairs, for ``(cached, new)`` tokens of
    each sequence: the torch reference pads the sequences of each of its groups to the
    widest and longest of the group and pays for every group it runs (``padded``,
    :func:`padded_groups`, :func:`padded_group_cost`); the paged kernel attends each query
    over its own sequence's keys. ``trees``: the step's draft trees run as a batch of
    their own (the batch-invariant torch attention, :data:`TREE_BATCH_WORK`)."""
    extra = TREE_BATCH_WORK if trees else 0.0
    if not padded:
        return extra + sum(n * (c + n) for c, n in sequences) / 1000
    return extra + sum(padded_group_cost([sequences[i] for i in g]) for g in padded_groups(sequences)) / 1000


class StepShape:
    """A step before drafts (its sequences as ``(cached, new)`` tokens), and the attention
    work it would do with drafts: ``tokens`` in all, ``drafting`` of the one-token
    sequences given drafts (those with the longest contexts), the widest of them verifying
    ``widest`` tokens (each draft token is one more query and one more key of its
    sequence; padded, every drafting sequence is counted that wide), ``trees`` whether
    some of the drafts are trees, which cost a batch of their own where ``tree_batch``
    (the batch-invariant torch attention)."""

    def __init__(self, sequences: list[tuple[int, int]], padded: bool, tree_batch: bool = False):
        self.padded = padded
        self.tree_batch = tree_batch
        self.tokens = sum(n for _, n in sequences)
        self.work = attention_work(sequences, padded) if sequences else 0.0
        self.wide = [(c, n) for c, n in sequences if n > 1]
        self.singles = sorted((c for c, n in sequences if n == 1), reverse=True)
        self.decode_context = 1 + sum(self.singles) / len(self.singles) if self.singles else 0.0  # keys of a decode
        self._padded_work: dict[tuple[int, int], float] = {}

    def work_at(self, tokens: int, widest: int = 1, drafting: int = 0, trees: bool = False) -> float:
        extra = TREE_BATCH_WORK if trees and drafting and self.tree_batch else 0.0
        if not self.padded:
            return extra + self.work + (tokens - self.tokens) * (self.decode_context + 1) / 1000
        if not drafting:
            return self.work
        key = (widest, drafting)
        if key not in self._padded_work:  # the planner asks for the same few shapes many times a step
            singles = [(c, widest if i < drafting else 1) for i, c in enumerate(self.singles)]
            self._padded_work[key] = attention_work(self.wide + singles, True)
        return extra + self._padded_work[key]


@attrs.define
class DraftOption:
    """What drafting ``j`` levels deep would bring one request: ``gains[j - 1]`` expected
    extra tokens from level ``j`` (``P(at least j accepted)``), ``nodes[j]`` the tokens
    the step verifies for it at depth ``j`` (``nodes[0]``: 0)."""

    gains: list[float]
    nodes: list[int]


def best_depths(options: list[DraftOption], base_tokens: int, step_seconds: Callable[[int, int, int], float],
                draft_seconds: Callable[[int, float], float] = lambda depth, tokens: 0.0) -> list[int]:
    """The depth of each option that maximises expected tokens per second of the step.

    ``base_tokens``: the step's target tokens without any draft (every request's root,
    prompt chunks); each request emits one token without drafts.
    ``step_seconds(tokens, widest, drafting)``: the step's time with ``tokens`` target
    tokens, ``drafting`` requests verifying drafts, the widest ``widest`` tokens.
    ``draft_seconds(d, expected)``: drafting time when the deepest request drafts ``d``
    levels and the step is expected to emit ``expected`` tokens (a drafter catches up on
    them at its next call).
    """
    depths = [0] * len(options)
    tokens, expected, deepest, widest, drafting = base_tokens, float(len(options)), 0, 1, 0
    best_rate, best = expected / step_seconds(tokens, widest, drafting), list(depths)
    # every gain still to add: no later prefix expects more than ``expected + left`` tokens,
    # nor takes less time than this one (the costs only grow), so the search stops once
    # that bound cannot beat the best rate (at a batch of eight, after a quarter of it)
    left = sum(sum(opt.gains[:len(opt.nodes) - 1]) for opt in options)
    heap = []

    def push(i: int) -> None:
        j = depths[i] + 1
        opt = options[i]
        if j < len(opt.nodes) and j <= len(opt.gains):
            heapq.heappush(heap, (-opt.gains[j - 1] / max(opt.nodes[j] - opt.nodes[j - 1], 1), i, j))

    for i in range(len(options)):
        push(i)
    while heap:
        _, i, j = heapq.heappop(heap)
        opt = options[i]
        tokens += opt.nodes[j] - opt.nodes[j - 1]
        expected += opt.gains[j - 1]
        left -= opt.gains[j - 1]
        drafting += j == 1
        depths[i] = j
        deepest = max(deepest, j)
        widest = max(widest, 1 + opt.nodes[j])
        seconds = step_seconds(tokens, widest, drafting) + draft_seconds(deepest, expected)
        if expected / seconds > best_rate * 1.001:  # a draft must pay, not tie
            best_rate, best = expected / seconds, list(depths)
        elif (expected + left) / seconds <= best_rate * 1.001:
            break
        push(i)
    return best


class StepLoad:
    """The target tokens of a step as chosen so far (``depths`` of ``options`` over
    ``base_tokens``), to price one more request's draft of ``extra`` tokens."""

    def __init__(self, base_tokens: int, options: list[DraftOption], depths: list[int]):
        self.tokens = base_tokens + sum(opt.nodes[d] for opt, d in zip(options, depths))
        self.widest = max((1 + opt.nodes[d] for opt, d in zip(options, depths) if d), default=1)
        self.drafting = sum(d > 0 for d in depths)

    def extra_seconds(self, step_seconds: Callable[[int, int, int], float], extra: int) -> float:
        now = step_seconds(self.tokens, self.widest, self.drafting)
        return step_seconds(self.tokens + extra, max(self.widest, 1 + extra), self.drafting + 1) - now

    def add(self, extra: int) -> None:
        self.tokens += extra
        self.widest = max(self.widest, 1 + extra)
        self.drafting += 1


