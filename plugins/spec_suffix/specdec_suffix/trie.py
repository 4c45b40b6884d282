"""A suffix trie with counts: every substring of up to ``depth`` tokens of the sequences
added, with how often it occurred.

Why a depth-limited trie: a draft needs the continuations of the longest recent suffix of
a request, and how often each followed it. Counting every substring of at most ``depth``
tokens answers both with dictionary walks: adding a token costs ``depth`` dictionary
steps, matching a suffix a binary search over its length (if ``m`` tokens occur, so do
their last ``m - 1``), and drafting a best-first walk from the matched node. Removing a
sequence replays it, so a cache of whole requests can forget the least recently used.
"""

from __future__ import annotations

import heapq


class Node:
    """A counted substring. ``kids`` is ``None`` (a leaf: most nodes), the one child (a
    substring followed by one token only: most of the rest), or a dict token -> child; a
    child knows its ``token``. ``last``: the trie's clock when the substring last occurred.
    Small nodes are what bound a cache's bytes per token."""

    __slots__ = ("token", "count", "last", "kids")

    def __init__(self, token: int) -> None:
        self.token = token
        self.count = 0
        self.last = 0
        self.kids: Node | dict[int, Node] | None = None

    def child(self, token: int) -> Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is Node:
            return kids if kids.token == token else None
        return kids.get(token)

    def children(self) -> list[Node]:
        kids = self.kids
        return [] if kids is None else [kids] if type(kids) is Node else list(kids.values())

    def add_child(self, token: int) -> Node:
        node = Node(token)
        kids = self.kids
        if kids is None:
            self.kids = node
        elif type(kids) is Node:
            self.kids = {kids.token: kids, token: node}
        else:
            kids[token] = node
        return node

    def drop_child(self, token: int) -> None:
        kids = self.kids
        if type(kids) is Node:
            self.kids = None
        else:
            del kids[token]
            if len(kids) == 1:
                self.kids = next(iter(kids.values()))


class SuffixTrie:
    """Substrings of up to ``depth`` tokens with their counts."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node(-1)
        self.nodes = 1
        #: tokens counted so far: when a substring last occurred (uncounting leaves it)
        self.clock = 0

    def extend(self, open_nodes: list[Node], tokens: list[int], sign: int = 1) -> list[Node]:
        """Count ``tokens`` appended to a sequence whose last substrings (lengths 1 to
        ``depth - 1``, shortest first) end at ``open_nodes``; returns the new open nodes.
        ``sign`` -1 uncounts them (a node whose count reaches 0 is dropped)."""
        for token in tokens:
            extended = []
            self.clock += sign > 0
            for node in [self.root, *open_nodes]:
                child = node.child(token)
                if child is None:
                    if sign < 0:
                        continue
                    child = node.add_child(token)
                    self.nodes += 1
                child.count += sign
                if sign > 0:
                    child.last = self.clock
                if child.count <= 0:
                    node.drop_child(token)
                    self.nodes -= _size(child)
                    continue
                extended.append(child)
            open_nodes = extended[:self.depth - 1]
        return open_nodes

    def add(self, tokens: list[int]) -> None:
        self.extend([], tokens)

    def remove(self, tokens: list[int]) -> None:
        self.extend([], tokens, sign=-1)

    def match(self, context: list[int], longest: int) -> tuple[Node | None, int]:
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

    def node_of(self, tokens: list[int]) -> Node | None:
        """The node of ``tokens`` (None where they never occurred)."""
        node = self.root
        for token in tokens:
            node = node.child(token)
            if node is None:
                return None
        return node

    @staticmethod
    def draft(node: Node, max_nodes: int, max_depth: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
        """The tree of continuations of ``node``, best first: each candidate's score is the
        product of its path's frequencies (a child's count over its parent's), equal scores
        the most recently seen first (as prompt lookup takes the latest match: a text's
        nearby past is the better guess), nodes below ``min_prob`` are left out; at most
        ``max_nodes`` nodes, ``max_depth`` deep. Returns tokens, parents and scores,
        parents before children."""
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        heap = [(-c.count / node.count, -c.last, c.token, -1, 1, c) for c in node.children()]
        heapq.heapify(heap)
        while heap and len(tokens) < max_nodes:
            neg, _, tok, parent, depth, child = heapq.heappop(heap)
            if -neg < min_prob:
                break
            tokens.append(tok)
            parents.append(parent)
            scores.append(-neg)
            if depth < max_depth:
                index = len(tokens) - 1
                for c in child.children():
                    heapq.heappush(heap, (neg * c.count / child.count, -c.last, c.token, index, depth + 1, c))
        return tokens, parents, scores


def _size(node: Node) -> int:
    """Nodes under and including ``node``."""
    return 1 + sum(_size(c) for c in node.children())
