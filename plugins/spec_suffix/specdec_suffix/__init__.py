"""Suffix decoding (SuffixDecoding, Oliaro et al. 2025): drafts from what followed the
request's latest tokens in its own prompt and output, and in earlier requests' outputs.

Two counted suffix tries (:mod:`.trie`) serve a request: its own (prompt and accepted
output, updated as tokens are accepted) and the cache, shared by the requests of one
drafter (``cache_scope: engine``: one ``LLM``, one server) or of every drafter of the
process on the same model (``process``), which holds the outputs (and with
``cache_prompts`` the prompts) of finished requests, the least recently finished forgotten
first beyond ``max_cached_requests`` or ``max_cached_tokens``. Each step every suffix of
the request that a trie knows (up to ``max_match_len`` tokens) gives a tree of its
continuations, drafted best first, a node scored by the product of its path's frequencies
(equal scores: the most recently seen first), nodes below ``min_token_prob`` left out, at
most ``max_spec_factor * match + max_spec_offset`` nodes (a long match is trusted further)
and no more nodes than the depth the planner chose, as the reference caps a tree by the
speculative token count (a tree then costs what the chain the planner priced would, and
holds the likeliest paths); of a trie's trees the one with the largest total score is its
proposal. The request's own proposal is drafted wherever it matched at least
``min_request_match`` tokens (``source: request_first``): a conversation's own past
predicts its next tokens better than counts pooled over other requests, whose larger
totals would otherwise win; elsewhere, and always with ``source: best_score`` (the
reference's rule), whichever of the two scores more is drafted. A proposal's ``kind`` is
its match length (capped at 8), so the planner learns how deep each kind pays.

A request whose ``SamplingParams.extra_args`` holds ``{"suffix_cache": False}`` never
enters the cache (it still drafts from it and from itself). The cache changes which
tokens are drafted, never which are kept: output is the target's.

Options (defaults in brackets):
    max_draft_len [16]: deepest draft.
    max_tree_depth [24]: longest substring counted (match plus continuation).
    max_match_len [12]: longest suffix matched.
    max_spec_factor [1.0], max_spec_offset [0.0]: draft nodes per matched token, and added.
    min_token_prob [0.1]: least path frequency a drafted node has.
    max_cached_requests [1000], max_cached_tokens [200000]: the cache's bound (about 0.5 KB
        a cached token at the default depth: ``scripts/bench_suffix_cache.py``).
    cache_prompts [false]: whether prompts enter the cache too.
    cache_scope [engine]: ``engine`` or ``process`` (see above).
    source [request_first]: ``request_first`` or ``best_score`` (see above).
    min_request_match [3]: the shortest match of the request's own that ``request_first``
        drafts without comparing it to the cache's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Literal

import attrs

from specdec.plugin_api import DecodingType, Drafter, DraftProposal, SpeculativeConfig, hookimpl, in_range

from .trie import SuffixTrie

#: match lengths from which proposals share one planner estimate
LONGEST_KIND = 8


@attrs.frozen(kw_only=True)
class SuffixConfig(SpeculativeConfig):
    max_draft_len: int = attrs.field(default=16, validator=in_range(1, 64))
    max_tree_depth: int = attrs.field(default=24, validator=in_range(2, 256))
    max_match_len: int = attrs.field(default=12, validator=in_range(1, 255))
    max_spec_factor: float = attrs.field(default=1.0, validator=in_range(0.0, 64.0))
    max_spec_offset: float = attrs.field(default=0.0, validator=in_range(-64.0, 64.0))
    min_token_prob: float = attrs.field(default=0.1, validator=in_range(0.0, 1.0))
    max_cached_requests: int = attrs.field(default=1000, validator=in_range(0, None))
    max_cached_tokens: int = attrs.field(default=200_000, validator=in_range(0, None))
    cache_prompts: bool = False
    cache_scope: Literal["engine", "process"] = attrs.field(
        default="engine", validator=attrs.validators.in_(("engine", "process")))
    source: Literal["request_first", "best_score"] = attrs.field(
        default="request_first", validator=attrs.validators.in_(("request_first", "best_score")))
    min_request_match: int = attrs.field(default=3, validator=in_range(1, 255))


class SuffixCache:
    """The shared trie over finished requests, bounded by requests and tokens (least
    recently added forgotten first); one lock, as drafters of several engines may share it."""

    def __init__(self, config: SuffixConfig):
        self.trie = SuffixTrie(config.max_tree_depth)
        self.max_requests, self.max_tokens = config.max_cached_requests, config.max_cached_tokens
        self.entries: OrderedDict[int, list[int]] = OrderedDict()
        self.tokens = 0
        self.lock = threading.Lock()
        self._next = 0

    def add(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) > self.max_tokens or not self.max_requests:
            return
        with self.lock:
            self.trie.add(tokens)
            self.entries[self._next] = tokens
            self._next += 1
            self.tokens += len(tokens)
            while len(self.entries) > self.max_requests or self.tokens > self.max_tokens:
                _, old = self.entries.popitem(last=False)
                self.trie.remove(old)
                self.tokens -= len(old)


_PROCESS_CACHES: dict[tuple, SuffixCache] = {}
_PROCESS_LOCK = threading.Lock()


class SuffixDrafter(Drafter):
    def __init__(self, config: SuffixConfig, target):
        super().__init__(config, target)
        if config.cache_scope == "process":
            key = (str(getattr(target, "path", None)), attrs.astuple(config))
            with _PROCESS_LOCK:
                self.cache = _PROCESS_CACHES.setdefault(key, SuffixCache(config))
        else:
            self.cache = SuffixCache(config)

    def _own(self, request) -> SuffixTrie:
        """The request's trie, caught up with its tokens."""
        state = request.drafter_state
        trie = state.get("suffix_trie")
        if trie is None:
            trie = state["suffix_trie"] = SuffixTrie(self.config.max_tree_depth)
            state["suffix_open"], state["suffix_counted"] = [], 0
        done = state["suffix_counted"]
        if done < len(request.token_ids):
            state["suffix_open"] = trie.extend(state["suffix_open"], request.token_ids[done:])
            state["suffix_counted"] = len(request.token_ids)
        return trie

    def _propose(self, trie: SuffixTrie, context: list[int], depth: int, nodes: int):
        """The best-scoring tree over every suffix of ``context`` that ``trie`` knows, as the
        reference does (a shorter match with more agreeing continuations can beat the
        longest): (score, tokens, parents, match length), or None."""
        _, longest = trie.match(context, self.config.max_match_len)
        best, seen = None, None  # seen: (count, the deepest continuation) of the last match drafted
        for matched in range(longest, 0, -1):
            budget = min(nodes, depth, int(self.config.max_spec_factor * matched + self.config.max_spec_offset + 1e-6))
            if budget <= 0:
                break  # shorter matches get no more nodes
            node = trie.node_of(context[len(context) - matched:])
            if seen is not None and trie.count[node] == seen[0] and budget <= seen[1]:
                continue  # it occurred only where the longer match did: the same tree, no more nodes
            tokens, parents, scores = trie.draft(node, budget, depth, self.config.min_token_prob)
            seen = (trie.count[node], trie.depth - matched)
            if tokens and (best is None or sum(scores) > best[0]):
                best = (sum(scores), tokens, parents, matched)
        return best

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals = []
        for req, depth, nodes in zip(requests, draft_lens, max_nodes):
            best = self._propose(self._own(req), req.token_ids, depth, nodes)
            if best is None or self.config.source == "best_score" or best[3] < self.config.min_request_match:
                with self.cache.lock:
                    shared = self._propose(self.cache.trie, req.token_ids, depth, nodes)
                best = max((p for p in (best, shared) if p is not None), default=None, key=lambda p: p[0])
            proposals.append(None if best is None else DraftProposal(
                token_ids=best[1], parents=best[2], kind=min(best[3], LONGEST_KIND)))
        return proposals

    @hookimpl
    def on_draft_verified(self, results):
        for result in results:
            if result.new_token_ids:
                self._own(result.request)

    @hookimpl
    def on_request_finished(self, request):
        request.drafter_state.pop("suffix_trie", None)
        request.drafter_state.pop("suffix_open", None)
        if (request.sampling_params.extra_args or {}).get("suffix_cache", True) is False:
            return
        start = 0 if self.config.cache_prompts else request.prompt_len
        self.cache.add(list(request.token_ids[start:]))


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="suffix", aliases=("suffix_decoding",), config_class=SuffixConfig,
                          drafter_class=SuffixDrafter,
                          description="suffix decoding: trees of what followed the request's latest tokens in "
                                      "itself and in earlier requests"))
