"""A suffix trie with counts: every substring of up to ``depth`` tokens of the sequences
added, with how often it occurred.

Why a depth-limited trie: a draft needs the continuations of the longest recent suffix of
a request, and how often each followed it. Counting every substring of at most ``depth``
tokens answers both with child lookups: adding a token costs ``depth`` of them, matching a
suffix a binary search over its length (if ``m`` tokens occur, so do their last
``m - 1``), and drafting a best-first walk from the matched node. Removing a sequence
replays it, so a cache of whole requests can forget the least recently used.

Why flat arrays: a node is an integer id into typed arrays (its token, count, clock,
first child, siblings), not a Python object. A cache of a thousand requests holds millions
of nodes; as objects the garbage collector would walk every one of them in each full
collection, a stall of every request the process serves. Arrays and dicts of integers
are not walked. Children are a linked list of siblings, scanned where a node has few
(most have one), and indexed by a dict of token -> child where it has more than
:data:`WIDE`.
"""

from __future__ import annotations

import heapq
from array import array

#: children from which a node's are indexed by token, not scanned
WIDE = 8
#: no node (an absent child or sibling)
NONE = -1


class SuffixTrie:
    """Substrings of up to ``depth`` tokens with their counts; :attr:`root` is node 0."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = 0
        self.token = array("i", [-1])
        self.count = array("i", [0])
        #: the trie's clock when the substring last occurred
        self.last = array("q", [0])
        self.first = array("i", [NONE])  # first child
        self.next = array("i", [NONE])  # next sibling
        self.prev = array("i", [NONE])  # previous sibling, or ``-2 - parent`` for a first child
        #: node -> {token: child} for nodes of more than WIDE children
        self.wide: dict[int, dict[int, int]] = {}
        self.free = array("i")
        self.nodes = 1
        #: tokens counted so far: when a substring last occurred (uncounting leaves it)
        self.clock = 0

    def children(self, node: int) -> list[int]:
        out, kid, siblings = [], self.first[node], self.next
        while kid != NONE:
            out.append(kid)
            kid = siblings[kid]
        return out

    def _add_child(self, node: int, token: int, index: dict[int, int] | None, siblings: int, clock: int) -> int:
        """A new child of ``node`` for ``token``, counted once at ``clock``; ``index``: the
        node's wide index, ``siblings`` its children (counted up to :data:`WIDE`)."""
        head = self.first[node]
        if self.free:
            kid = self.free.pop()
            self.token[kid], self.count[kid], self.last[kid], self.first[kid], self.next[kid], self.prev[kid] = (
                token, 1, clock, NONE, head, -2 - node)
        else:
            kid = len(self.token)
            self.token.append(token)
            self.count.append(1)
            self.last.append(clock)
            self.first.append(NONE)
            self.next.append(head)
            self.prev.append(-2 - node)
        if head != NONE:
            self.prev[head] = kid
        self.first[node] = kid
        if index is not None:
            index[token] = kid
        elif siblings >= WIDE:
            self.wide[node] = {self.token[k]: k for k in self.children(node)}
        self.nodes += 1
        return kid

    def _drop_child(self, node: int, kid: int) -> None:
        """Unlink ``kid`` from ``node`` and free it with everything under it."""
        before, after = self.prev[kid], self.next[kid]
        if before <= -2:
            self.first[node] = after
        else:
            self.next[before] = after
        if after != NONE:
            self.prev[after] = before
        index = self.wide.get(node)
        if index is not None:
            del index[self.token[kid]]
            if len(index) <= WIDE:
                del self.wide[node]
        stack = [kid]
        while stack:
            gone = stack.pop()
            stack += self.children(gone)
            self.wide.pop(gone, None)
            self.free.append(gone)
            self.nodes -= 1

    def extend(self, open_nodes: list[int], tokens: list[int], sign: int = 1) -> list[int]:
        """Count ``tokens`` appended to a sequence whose last substrings (lengths 1 to
        ``depth - 1``, shortest first) end at ``open_nodes``; returns the new open nodes.
        ``sign`` -1 uncounts them (a node whose count reaches 0 is dropped).

        The longest substring is counted first: a node dropped then (and everything under
        it, all longer than the substrings still to count) is never one of them, where
        counting the shortest first ("7" reaching 0 in "... 7 7") would drop an open node
        before its own turn."""
        count, last, first, siblings, token_of = self.count, self.last, self.first, self.next, self.token
        wide, cap = self.wide, self.depth - 1
        for token in tokens:
            extended = []
            self.clock += sign > 0
            clock = self.clock
            for node in [*reversed(open_nodes), self.root]:
                index = wide.get(node)
                if index is not None:
                    kid, seen = index.get(token, NONE), WIDE
                else:  # scan the siblings (inlined: a token costs ``depth`` of these lookups)
                    kid, seen = first[node], 0
                    while kid != NONE and token_of[kid] != token:
                        kid = siblings[kid]
                        seen += 1
                if kid == NONE:
                    if sign > 0:
                        extended.append(self._add_child(node, token, index, seen, clock))
                    continue
                if sign > 0:
                    count[kid] += 1
                    last[kid] = clock
                elif count[kid] == 1:
                    self._drop_child(node, kid)
                    continue
                else:
                    count[kid] -= 1
                extended.append(kid)
            extended.reverse()
            open_nodes = extended[:cap]
        return open_nodes

    def add(self, tokens: list[int]) -> None:
        self.extend([], tokens)

    def remove(self, tokens: list[int]) -> None:
        self.extend([], tokens, sign=-1)

    def match(self, context: list[int], longest: int) -> tuple[int | None, int]:
        """The node of the longest suffix of ``context`` (at most ``longest`` tokens) that
        occurred, and its length; ``(None, 0)`` where not even the last token did."""
        lo, hi, best = 1, min(longest, len(context), self.depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.node_of(context[len(context) - mid:])
            if node is None:
                hi = mid - 1
            else:
                best, lo = (node, mid), mid + 1
        return best if best is not None else (None, 0)

    def node_of(self, tokens: list[int]) -> int | None:
        """The node of ``tokens`` (None where they never occurred)."""
        node, wide, first, siblings, token_of = self.root, self.wide, self.first, self.next, self.token
        for token in tokens:
            index = wide.get(node)
            if index is not None:
                node = index.get(token, NONE)
            else:  # the siblings scanned, as in :meth:`extend`
                node = first[node]
                while node != NONE and token_of[node] != token:
                    node = siblings[node]
            if node == NONE:
                return None
        return node

    def draft(self, node: int, max_nodes: int, max_depth: int, min_prob: float
              ) -> tuple[list[int], list[int], list[float]]:
        """The tree of continuations of ``node``, best first: each candidate's score is the
        product of its path's frequencies (a child's count over its parent's), equal scores
        the most recently seen first (as prompt lookup takes the latest match: a text's
        nearby past is the better guess), nodes below ``min_prob`` are left out; at most
        ``max_nodes`` nodes, ``max_depth`` deep. Returns tokens, parents and scores,
        parents before children."""
        count, last, token = self.count, self.last, self.token
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap = [(-count[c] / count[node], -last[c], token[c], -1, 1, c) for c in self.children(node)]
        heapq.heapify(heap)
        while heap and len(tokens) < max_nodes:
            neg, _, tok, parent, depth, kid = heapq.heappop(heap)
            if -neg < min_prob:
                break
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            if depth < max_depth:
                index = len(tokens) - 1
                for c in self.children(kid):
                    heapq.heappush(heap, (neg * count[c] / count[kid], -last[c], token[c], index, depth + 1, c))
        return tokens, parents, scores
