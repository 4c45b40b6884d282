"""Prompt lookup (n-gram) drafting, with TensorRT-LLM's options.

The pool maps every n-gram (``min_matching_ngram_size <= n <= max_matching_ngram_size``)
seen in a sequence to the places it was followed by something. It is updated
incrementally as tokens are accepted, never by rescanning the context. To draft, the
longest suffix n-gram of the request that the pool knows is looked up and the tokens that
followed it are proposed, from the place whose preceding tokens agree longest with the
request's (up to :data:`COPY_AGREEMENT`); since a place points into a live sequence, its
continuation grows as that sequence does. A proposal's ``kind`` is its match length: the
n-gram's, or :data:`COPY_AGREEMENT` where the request agrees with the place for that many
tokens or more (it is copying), so the core's adaptive planner learns per request how far
drafts from one-token matches, longer matches and copies are accepted, and verifies each
as deep as it pays (often not at all for a one-token match).

Options (defaults in brackets):
    max_draft_len [12]: tokens proposed per step.
    max_matching_ngram_size [3]: the longest suffix tried first.
    min_matching_ngram_size [1]: the shortest suffix still trusted.
    is_public_pool [true]: one pool shared by all requests, or one per request.
    is_keep_all [true]: keep every place an n-gram occurred, or only the newest (as
        TensorRT-LLM does).
    is_use_oldest [true]: of the places agreeing longest, draft from the oldest, or the
        newest.
    max_places_per_ngram [8]: places kept per n-gram, bounding the pool's memory.
    max_pool_ngrams [262144]: n-grams a pool keeps; beyond it the least recently seen go
        (with them the finished sequences only they pointed into), so a long-running
        server's public pool stays bounded.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import attrs

from specdec.plugin_api import DecodingType, Drafter, DraftProposal, FieldError, SpeculativeConfig, hookimpl, in_range

#: tokens before a draft that agree with its place, from which the request counts as
#: copying: coincidental three-token matches of a request that does not copy are a kind of
#: their own, so they are not verified deep on the acceptance of requests that copy
COPY_AGREEMENT = 8


@attrs.frozen(kw_only=True)
class NGramConfig(SpeculativeConfig):
    # Longer than the core default: copied spans are long, and the planner verifies only
    # the depth that pays.
    max_draft_len: int = attrs.field(default=12, validator=in_range(1, 64))
    max_matching_ngram_size: int = attrs.field(default=3, validator=in_range(1, 32))
    min_matching_ngram_size: int = attrs.field(default=1, validator=in_range(1, 32))
    is_public_pool: bool = True
    is_keep_all: bool = True
    is_use_oldest: bool = True
    max_places_per_ngram: int = attrs.field(default=8, validator=in_range(1, 1024))
    max_pool_ngrams: int = attrs.field(default=1 << 18, validator=in_range(1, None))

    @min_matching_ngram_size.validator
    def _check_min(self, attribute, value):
        if value > self.max_matching_ngram_size:
            raise FieldError(attribute.name,
                             f"must be <= max_matching_ngram_size ({self.max_matching_ngram_size}), got {value}")


class NGramPool:
    """n-gram -> places ``(sequence, index)`` where the n-gram was followed by ``sequence[index]``."""

    def __init__(self, config: NGramConfig):
        self.sizes = range(config.max_matching_ngram_size, config.min_matching_ngram_size - 1, -1)
        self.keep = config.max_places_per_ngram if config.is_keep_all else 1
        self.oldest = config.is_use_oldest
        self.capacity = config.max_pool_ngrams
        self.places: OrderedDict[tuple[int, ...], deque] = OrderedDict()  # least recently seen first

    def index(self, seq: list[int], start: int, stop: int) -> None:
        """Record the n-grams ending just before each index in ``[start, stop)`` of ``seq``."""
        for i in range(max(start, 1), stop):
            for n in self.sizes:
                if n > i:
                    continue
                key = tuple(seq[i - n:i])
                found = self.places.get(key)
                if found is None:
                    found = self.places[key] = deque(maxlen=self.keep)
                    if len(self.places) > self.capacity:
                        self.places.popitem(last=False)
                else:
                    self.places.move_to_end(key)
                    if self.oldest and self.keep > 1 and len(found) == self.keep:
                        continue  # full, and the oldest places are the ones wanted
                found.append((seq, i))

    def lookup(self, seq: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the longest known suffix n-gram of ``seq``, at
        the place agreeing longest with ``seq`` before it, and the match length (0: no
        match; see the module docstring)."""
        length = len(seq)
        for n in self.sizes:
            if n > length:
                continue
            found = self.places.get(tuple(seq[length - n:]))
            if not found:
                continue
            best, best_agreement = None, 0
            for source, i in found if self.oldest else reversed(found):
                if source is seq and i >= length:
                    continue
                agreement = _agreement(source, i, seq, n)
                if agreement > best_agreement:
                    best, best_agreement = (source, i), agreement
            if best is None:
                continue
            source, i = best
            return source[i:i + k], max(n, COPY_AGREEMENT) if best_agreement >= COPY_AGREEMENT else n
        return [], 0


def _agreement(source: list[int], i: int, seq: list[int], n: int) -> int:
    """How many tokens before ``source[i]`` agree with the end of ``seq`` (at least the
    ``n`` of the n-gram matched), counted up to :data:`COPY_AGREEMENT`."""
    length, m = len(seq), n
    while m < COPY_AGREEMENT and m < i and m < length and source[i - m - 1] == seq[length - m - 1]:
        m += 1
    return m


class NGramDrafter(Drafter):
    def __init__(self, config: NGramConfig, target):
        super().__init__(config, target)
        self.public = NGramPool(config) if config.is_public_pool else None

    def _pool(self, request) -> NGramPool:
        if self.public is not None:
            return self.public
        return request.drafter_state.setdefault("ngram_pool", NGramPool(self.config))

    def _catch_up(self, request) -> None:
        done = request.drafter_state.get("ngram_indexed", 0)
        if done < len(request.token_ids):
            self._pool(request).index(request.token_ids, done, len(request.token_ids))
            request.drafter_state["ngram_indexed"] = len(request.token_ids)

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        proposals = []
        for req, k in zip(requests, draft_lens):
            self._catch_up(req)
            draft, matched = self._pool(req).lookup(req.token_ids, k)
            proposals.append(DraftProposal(token_ids=draft, kind=matched) if draft else None)
        return proposals

    @hookimpl
    def on_draft_verified(self, results):
        for result in results:
            if result.new_token_ids:
                self._catch_up(result.request)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="ngram", aliases=("NGram", "prompt_lookup"), config_class=NGramConfig,
                          drafter_class=NGramDrafter,
                          description="prompt lookup: drafts what followed the longest matching suffix"))
