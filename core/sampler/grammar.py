"""Structured output: a grammar every generated token must follow, with llguidance.

llguidance compiles JSON schemas, regular expressions, choices and Lark or GBNF grammars
against the target's tokenizer and answers, for a matcher at some point of the output,
the bitmask of tokens allowed next (one bit per token id). A request's matcher stays at
the end of its committed output; to mask a draft, a copy of it walks each node's path
(consume, then roll back), so a tree node's mask comes from its own path. Rows of tokens
the grammar can never reach keep every token allowed: they are never read, and a row with
nothing allowed would make a distribution of NaNs.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from ..drafting.interface import DraftProposal
from ..errors import RequestError
from ..sampling_params import StructuredOutputs

#: compiled grammars kept (as fresh matchers to copy); the least recently used goes first
GRAMMAR_CACHE_SIZE = 64


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for ``spec``; a RequestError naming the field if it is malformed."""
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if spec.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", list(spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError) as exc:
        raise RequestError(f"structured_outputs.{spec.kind}: {exc}") from exc


class GrammarCompiler:
    """Matchers for one tokenizer; compiled grammars are cached, a request gets a copy.
    Thread-safe: the server checks requests on its event loop while the engine thread adds them."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int] | set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise RequestError("structured output needs the target's tokenizer, and this target has none")
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_ids)
        return self._ll_tokenizer

    def check(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` now (cached); a RequestError saying what is wrong with it if
        llguidance refuses it."""
        with self._lock:
            self._compiled_matcher(spec)

    def grammar(self, spec: StructuredOutputs) -> Grammar:
        """A matcher at the start of the output, a copy of the compiled one; errors as :meth:`check`."""
        with self._lock:
            fresh = self._compiled_matcher(spec).deep_copy()
        return Grammar(fresh, self._tokenizer().vocab_size, frozenset(self.eos_token_ids))

    def _compiled_matcher(self, spec: StructuredOutputs):
        """The cached matcher of ``spec`` (compiled on first use); the caller holds the lock."""
        text = grammar_text(spec)
        compiled = self._compiled.get(text)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
            if compiled.is_error():
                raise RequestError(f"structured_outputs.{spec.kind} is not a grammar llguidance accepts: "
                                   f"{compiled.get_error().strip()}")
            self._compiled[text] = compiled
            if len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return compiled


class Grammar:
    """One request's matcher, kept at the end of its committed output."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset[int]):
        self.matcher = matcher
        self.eos_token_ids = eos_token_ids
        self.words = (vocab_size + 31) // 32  # the tokenizer's vocabulary: ids past it are never allowed

    def advance(self, tokens: list[int]) -> str | None:
        """Commit output tokens, each one its row's mask allowed (an EOS ends the output
        and is not consumed); a message if llguidance gave up on the grammar (a resource
        limit), after which the request cannot go on."""
        for token in tokens:
            if token in self.eos_token_ids:
                break
            if not self.matcher.consume_token(token):
                return (f"structured_outputs: the grammar engine gave up after token {token}: "
                        f"{self.matcher.get_error().splitlines()[0]}; simplify the grammar")
        return None

    def masks(self, proposal: DraftProposal | None = None) -> tuple[torch.Tensor, list[bool]]:
        """Bitmask rows ``[1 + nodes, words]`` (int32), the root's then each node's (the
        tokens allowed after its path), and whether each node is reachable: its parent is
        (or it is a root child), no EOS comes before it, and the parent's row allows its
        token. Unreachable nodes' rows allow everything. The committed matcher is not
        touched: the paths are walked on a copy (consumed, rolled back to the next node's
        parent), replaced by a fresh copy should llguidance give up on a path."""
        nodes = len(proposal.token_ids) if proposal is not None else 0
        bitmask = torch.full((1 + nodes, self.words), -1, dtype=torch.int32)
        reachable = [False] * nodes
        self._fill(self.matcher, bitmask, 0)
        walker, path = None, []  # path: the nodes the walker has consumed, root child first
        for node in range(nodes):
            token, parent = proposal.token_ids[node], proposal.parents[node]
            if parent >= 0 and (not reachable[parent] or proposal.token_ids[parent] in self.eos_token_ids):
                continue
            if not _allowed(bitmask[parent + 1], token):
                continue
            if token in self.eos_token_ids:
                reachable[node] = True
                continue  # the output ends here: nothing after it is read
            if walker is None or walker.is_error():
                walker, path = self.matcher.deep_copy(), []
            ancestors = _ancestors(proposal.parents, node)
            common = 0
            while common < min(len(path), len(ancestors)) and path[common] == ancestors[common]:
                common += 1
            walker.rollback(len(path) - common)
            walker.consume_tokens([proposal.token_ids[step] for step in ancestors[common:]])
            path = ancestors
            if not walker.is_error():
                reachable[node] = True
                self._fill(walker, bitmask, node + 1)
        return bitmask, reachable

    def _fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        """Row ``row``: the tokens ``matcher`` allows next; EOS alone once the grammar is complete."""
        if not matcher.is_stopped():
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
            return
        bitmask[row] = 0
        for eos in self.eos_token_ids:
            bitmask[row, eos // 32] |= _bit(eos % 32)


def _ancestors(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if index == 31 else 1 << index


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmasks: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that ``bitmasks[i]`` does not
    allow (token ids past the bitmask's words included), in place. Bit ``t % 32`` of word
    ``t // 32`` is bit ``t % 8`` of byte ``t // 8`` (little-endian), so the bitmask unpacks
    a byte at a time."""
    shifts = torch.arange(8, dtype=torch.uint8)
    allowed = ((bitmasks.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab].to(logits.device)
    rows = rows.to(logits.device)
    with torch.inference_mode():  # the forward's logits are inference tensors
        logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, float("-inf")))
