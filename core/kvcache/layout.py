"""Where one packed step's sequences keep their K/V, and which keys each query sees.

Built once per step by the engine and shared by every layer. The torch reference reads
it as one padded row per sequence (:attr:`AttentionLayout.padded`), or, for one sequence,
sliding windows, soft-capping and pending draft nodes, as packed context slots and a dense
``[T, S]`` mask; the Triton kernel reads block tables, per-sequence starts and the tree
masks directly. Each view is derived lazily, once.
"""

from __future__ import annotations

import array
from functools import cached_property

import attrs
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..kernels.invariant_attention import KEY_BLOCK, ROW_MULTIPLE, round_up


def width_group(num_new: int) -> int:
    """The padding group of a sequence with ``num_new`` new tokens in a step: sequences of
    one group differ in width by less than 2x."""
    return num_new.bit_length()


#: What the torch attention pays per padded group of sequences (a gather of their keys
#: and values, one product, a scatter: ~14 operations a layer), in query-key pairs of
#: padded work, and what gathering one key costs in query-key pairs (embedded model,
#: bfloat16, 2-core CPU: a group ~50-100 us a layer, ``B`` sequences of ``N`` queries over ``W``
#: keys about ``B * W * (0.085 + 0.021 * N)`` us on top).
GROUP_PAIRS = 4096
KEY_GATHER_PAIRS = 4
#: What the batch-invariant torch attention (not its kernels) pays, on top, for a step's draft
#: trees: it runs them as one batch of two dozen operations a layer of their own
#: (``scripts/profile_step.py --batch-invariant --curve`` measures it).
TREE_BATCH_PAIRS = 4 * GROUP_PAIRS


def padded_group_cost(sequences: list[tuple[int, int]]) -> int:
    """The cost of one padded group of ``(cached, new)`` sequences, in query-key pairs."""
    rows = max(n for _, n in sequences)
    keys = max(c + n for c, n in sequences)
    return GROUP_PAIRS + len(sequences) * keys * (rows + KEY_GATHER_PAIRS)


def padded_groups(sequences: list[tuple[int, int]]) -> list[list[int]]:
    """The torch attention's padded groups of a step's ``(cached, new)`` sequences (their
    indices): first by :func:`width_group`, then neighbouring groups merged while one
    group costs less than two (:func:`padded_group_cost`). Eight decodes and one
    two-token draft share a group (padding seven queries is cheaper than a second group),
    a 16-node tree gets its own."""
    buckets: dict[int, list[int]] = {}
    for i, (_, n) in enumerate(sequences):
        buckets.setdefault(width_group(n), []).append(i)
    groups = [buckets[k] for k in sorted(buckets)]
    cost = lambda g: padded_group_cost([sequences[i] for i in g])  # noqa: E731
    while len(groups) > 1:
        savings = [cost(a) + cost(b) - cost(a + b) for a, b in zip(groups, groups[1:])]
        best = max(range(len(savings)), key=savings.__getitem__)
        if savings[best] <= 0:
            break
        groups[best:best + 2] = [groups[best] + groups[best + 1]]
    return groups


def causal_mask(n: int) -> torch.Tensor:
    """``[n, n]`` bool, True on and below the diagonal. Built by comparison: torch 2.13's
    ``tril_`` on a bool tensor runs a parallel section, which waited milliseconds for a
    descheduled thread while another process shared this 2-core CPU (once per sequence per
    step in the stock attention's ``padded`` view)."""
    rows = torch.arange(n)
    return rows[:, None] >= rows


def long_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values``: through an ``array``, whose one C loop over the list
    costs a fraction of what ``torch.tensor`` pays per element (context-long key rows)."""
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.long).to(device)


def slot_ids(block_table: list[int], block_size: int, start: int, count: int) -> list[int]:
    """Cache slots of positions ``start .. start + count`` of a sequence with this block table."""
    if count <= 0:
        return []
    first, last = start // block_size, (start + count + block_size - 1) // block_size
    if last > len(block_table):
        raise IndexError(f"positions up to {start + count - 1} need {last} blocks; the table holds {len(block_table)}")
    slots = [slot for block in block_table[first:last] for slot in range(block * block_size, (block + 1) * block_size)]
    return slots[start - first * block_size:start - first * block_size + count]


@attrs.define
class SequenceSlice:
    """One sequence's share of a step.

    ``start`` tokens are in the cache before this step; the ``len(positions)`` new tokens
    go to cache indices ``start ..``. ``tree_mask[i, j]``: new token ``i`` sees new token
    ``j`` (None: causal). Every new token sees every cached token, except where
    ``pending_mask`` (``[n, m]``) says otherwise for the last ``m`` cached ones: the nodes
    of a draft tree expanded level by level, which sit at ``pending_positions``. Layouts
    with a pending mask and a sliding window run on the torch reference.
    """

    block_table: list[int]
    start: int
    positions: torch.Tensor  # long [n]
    tree_mask: torch.Tensor | None = None
    pending_mask: torch.Tensor | None = None
    pending_positions: torch.Tensor | None = None


class AttentionLayout:
    """``context_bound``: the longest context the Triton kernel plans its key splits for
    (None: this step's longest); a CUDA graph's layout sets it to the model's limit, so
    that one launch serves every step it replays."""

    def __init__(self, seqs: list[SequenceSlice], block_size: int, device: torch.device,
                 context_bound: int | None = None):
        self.seqs = seqs
        self.block_size = block_size
        self.device = device
        self.context_bound = context_bound
        self.num_tokens = sum(len(s.positions) for s in seqs)
        self._window_masks: dict[int, torch.Tensor] = {}
        self.kernel_cache: dict = {}  # what kernels and layers derive from the layout, per step

    def remapped(self, block_of: list[int]) -> AttentionLayout:
        """This step over other blocks: every block table's block ``b`` read as
        ``block_of[b]`` (the sliding-window layers' own blocks,
        :class:`specdec.kvcache.window_blocks.WindowBlocks`)."""
        seqs = [attrs.evolve(s, block_table=[block_of[b] for b in s.block_table]) for s in self.seqs]
        return AttentionLayout(seqs, self.block_size, self.device, self.context_bound)

    def _key_slots(self, seq: SequenceSlice, count: int, first: int = 0) -> torch.Tensor:
        """Cache slots of positions ``first .. first + count`` of ``seq`` (a tensor op, not a
        Python loop over the context)."""
        pos = torch.arange(first, first + count)
        return torch.tensor(seq.block_table)[pos // self.block_size] * self.block_size + pos % self.block_size

    @cached_property
    def slot_mapping(self) -> torch.Tensor:
        """``[T]`` the cache slot each new token's K/V is written to."""
        return torch.cat([self._key_slots(s, len(s.positions), s.start) for s in self.seqs]).to(self.device)

    @cached_property
    def first_tokens(self) -> list[int]:
        """Each sequence's first token in the packed batch."""
        first = [0]
        for s in self.seqs[:-1]:
            first.append(first[-1] + len(s.positions))
        return first

    @cached_property
    def query_positions(self) -> torch.Tensor:
        return torch.cat([s.positions for s in self.seqs]).to(self.device)

    def _tree(self, s: SequenceSlice) -> torch.Tensor:
        n = len(s.positions)
        return s.tree_mask if s.tree_mask is not None else causal_mask(n)

    # -- the torch reference's view --------------------------------------------------

    @cached_property
    def context_slots(self) -> torch.Tensor:
        """``[S]`` every sequence's committed and new slots, packed in sequence order."""
        return torch.cat([self._key_slots(s, s.start + len(s.positions)) for s in self.seqs]).to(self.device)

    @cached_property
    def has_pending(self) -> bool:
        return any(s.pending_mask is not None for s in self.seqs)

    @staticmethod
    def _cached_positions(s: SequenceSlice) -> torch.Tensor:
        pos = torch.arange(s.start)
        if s.pending_positions is not None:
            pos[s.start - len(s.pending_positions):] = s.pending_positions
        return pos

    @cached_property
    def key_positions(self) -> torch.Tensor:
        return torch.cat([torch.cat([self._cached_positions(s), s.positions]) for s in self.seqs]).to(self.device)

    @cached_property
    def dense_mask(self) -> torch.Tensor | None:
        """``[T, S]``: block-diagonal across sequences; None when one query sees everything."""
        if len(self.seqs) == 1 and len(self.seqs[0].positions) == 1 and not self.has_pending:
            return None
        total_k = sum(s.start + len(s.positions) for s in self.seqs)
        mask = torch.zeros(self.num_tokens, total_k, dtype=torch.bool)
        q0 = k0 = 0
        for s in self.seqs:
            n = len(s.positions)
            mask[q0:q0 + n, k0:k0 + s.start] = True
            if s.pending_mask is not None:
                m = s.pending_mask.shape[1]
                mask[q0:q0 + n, k0 + s.start - m:k0 + s.start] = s.pending_mask
            mask[q0:q0 + n, k0 + s.start:k0 + s.start + n] = self._tree(s)
            q0 += n
            k0 += s.start + n
        return mask.to(self.device)

    @cached_property
    def padded(self) -> list[dict[str, torch.Tensor]]:
        """The torch reference's view of a batch: sequences grouped by their number of new
        tokens (:func:`padded_groups`), each group on padded rows, so that one wide
        sequence (a draft tree, a prompt chunk) does not pad every row of the batch
        (attention work: per group, rows * widest * longest). Per group: ``slots [B * K]`` the keys' cache slots,
        ``mask [B, N, K]`` which keys each query sees, ``queries [B * N]`` the packed token
        of each padded query, ``rows [T_g]`` the padded row of each of the group's tokens
        and ``tokens [T_g]`` their packed index. Padding sees slot 0 only."""
        first = self.first_tokens
        out = []
        for members in padded_groups([(s.start, len(s.positions)) for s in self.seqs]):
            seqs = [self.seqs[b] for b in members]
            width = max(s.start + len(s.positions) for s in seqs)
            rows = max(len(s.positions) for s in seqs)
            slots = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), rows, width, dtype=torch.bool)
            mask[:, :, 0] = True
            queries = torch.zeros(len(seqs), rows, dtype=torch.long)
            padded_rows: list[int] = []
            tokens: list[int] = []
            for g, (b, s) in enumerate(zip(members, seqs)):
                n, keys = len(s.positions), s.start + len(s.positions)
                slots[g, :keys] = self._key_slots(s, keys)
                mask[g, :n, :s.start] = True
                mask[g, :n, s.start:keys] = self._tree(s)
                queries[g, :n] = torch.arange(first[b], first[b] + n)
                padded_rows += range(g * rows, g * rows + n)
                tokens += range(first[b], first[b] + n)
            out.append({"slots": slots.flatten().to(self.device), "mask": mask.to(self.device),
                        "queries": queries.flatten().to(self.device),
                        "rows": torch.tensor(padded_rows, device=self.device),
                        "tokens": torch.tensor(tokens, device=self.device)})
        return out

    @cached_property
    def invariant_rows(self) -> list[dict[str, torch.Tensor]]:
        """:meth:`invariant_row_groups` with every node of a draft tree a key row of its own
        (the Triton kernel's view)."""
        return self.invariant_row_groups(trees=True)

    @cached_property
    def invariant_causal_rows(self) -> list[dict[str, torch.Tensor]]:
        """:meth:`invariant_row_groups` without the draft trees, which the torch attention
        reads from :attr:`invariant_trees`."""
        return self.invariant_row_groups(trees=False)

    @cached_property
    def _is_tree(self) -> list[bool]:
        """Per sequence: whether its new tokens are a draft tree (a mask other than causal)."""
        return [s.tree_mask is not None and not bool(torch.equal(s.tree_mask.cpu(), causal_mask(len(s.positions))))
                for s in self.seqs]

    @staticmethod
    def _node_columns(s: SequenceSlice) -> list[torch.Tensor]:
        """Each tree node's key columns among its sequence's: the context, then the new
        tokens it sees (its ancestors and itself) in order."""
        return [torch.cat([torch.arange(s.start), s.start + s.tree_mask[i].cpu().nonzero().flatten()])
                for i in range(len(s.positions))]

    @cached_property
    def invariant_trees(self) -> dict | None:
        """The step's draft trees as the torch batch-invariant attention reads them (None:
        there are none), all ``t`` of them in one batch of ``n``
        nodes each (the most of a tree, rounded up to a multiple of
        :data:`specdec.kernels.invariant_attention.ROW_MULTIPLE`): every node's scores against its tree's keys
        (context and new tokens) in one product, then each node's key row gathered from
        them; the value blocks that hold context only, shared by a tree's nodes, in one
        product, the rest per node. Indices into the cache are slots; padding points at
        the tree's first key (a score no row gathers, a value weighed by zero).

        - ``tokens [t, n]`` each node's packed token (padding nodes repeat their tree's
          first); ``nodes`` / ``node_tokens``: the real nodes' index among the ``t * n``
          and their packed token;
        - ``key_slots [t, P]`` each tree's keys, ``P`` a multiple of
          :data:`specdec.kernels.invariant_attention.KEY_BLOCK`;
        - ``cols [t, n, W]`` each node's key row as columns of ``key_slots``: the context,
          then its ancestors in order; padding points at column ``P`` (a ``-inf`` score), a
          padding node sees column 0 only; ``key_pos [t, n, W]`` and ``query_pos [t, n]``
          positions, for sliding windows;
        - ``shared`` blocks (``int``): the most context-only blocks of a tree, whose values
          ``shared_slots [t, shared * KEY_BLOCK]`` sit in a tree's rows at the same columns
          for every node;
        - ``own`` blocks (``int``) per node after its tree's context-only ones: their row
          positions ``own_pos [t, own * KEY_BLOCK]`` and values ``own_slots [t, n, own *
          KEY_BLOCK]``;
        - ``block_order [t, shared + own]`` (None when every tree has the same number of
          context-only blocks): which of the ``shared``, then ``own`` block results, then a
          zero block (index ``shared + own``) is a node's ``b``-th, so that each node adds
          its blocks in its row's order (the order of a sum of more than 16 blocks matters)."""
        trees = [(s, first) for s, is_tree, first in zip(self.seqs, self._is_tree, self.first_tokens) if is_tree]
        if not trees:
            return None
        rows = [self._node_columns(s) for s, _ in trees]
        num_trees, n = len(trees), round_up(max(len(s.positions) for s, _ in trees), ROW_MULTIPLE)
        tree_slots = [self._key_slots(s, s.start + len(s.positions)) for s, _ in trees]
        padded_keys = round_up(max(len(slots) for slots in tree_slots), KEY_BLOCK)
        width = round_up(max(len(r) for tree_rows in rows for r in tree_rows), KEY_BLOCK)
        shared = [s.start // KEY_BLOCK for s, _ in trees]
        own = max(round_up(max(len(r) for r in tree_rows), KEY_BLOCK) // KEY_BLOCK - c
                  for tree_rows, c in zip(rows, shared))
        most_shared = max(shared)
        tokens = torch.zeros(num_trees, n, dtype=torch.long)
        key_slots = torch.zeros(num_trees, padded_keys, dtype=torch.long)
        cols = torch.full((num_trees, n, width), padded_keys, dtype=torch.long)
        cols[:, :, 0] = 0
        key_pos = torch.zeros(num_trees, n, width, dtype=torch.long)
        query_pos = torch.zeros(num_trees, n, dtype=torch.long)
        shared_slots = torch.zeros(num_trees, most_shared * KEY_BLOCK, dtype=torch.long)
        own_pos = torch.zeros(num_trees, own * KEY_BLOCK, dtype=torch.long)
        own_slots = torch.zeros(num_trees, n, own * KEY_BLOCK, dtype=torch.long)
        block_order = torch.full((num_trees, most_shared + own), most_shared + own, dtype=torch.long)
        nodes: list[int] = []
        node_tokens: list[int] = []
        for t, ((s, first), tree_rows, slots, c) in enumerate(zip(trees, rows, tree_slots, shared)):
            tree_key_pos = torch.cat([torch.arange(s.start), s.positions.cpu()])
            key_slots[t] = slots[0]
            key_slots[t, :len(slots)] = slots
            tokens[t] = first
            shared_slots[t] = slots[0]
            shared_slots[t, :c * KEY_BLOCK] = slots[:c * KEY_BLOCK]
            own_pos[t] = torch.arange(c * KEY_BLOCK, (c + own) * KEY_BLOCK)
            own_slots[t] = slots[0]
            block_order[t, :c] = torch.arange(c)
            block_order[t, c:c + own] = torch.arange(most_shared, most_shared + own)
            for i, row in enumerate(tree_rows):
                tokens[t, i] = first + i
                cols[t, i, :len(row)] = row
                key_pos[t, i, :len(row)] = tree_key_pos[row]
                tail = row[c * KEY_BLOCK:(c + own) * KEY_BLOCK]
                own_slots[t, i, :len(tail)] = slots[tail]
                nodes.append(t * n + i)
                node_tokens.append(first + i)
            query_pos[t, :len(tree_rows)] = s.positions.cpu()
        views = {"tokens": tokens, "nodes": torch.tensor(nodes), "node_tokens": torch.tensor(node_tokens),
                 "key_slots": key_slots, "cols": cols, "key_pos": key_pos, "query_pos": query_pos,
                 "shared_slots": shared_slots, "own_pos": own_pos, "own_slots": own_slots}
        views = {k: v.to(self.device) for k, v in views.items()}
        uniform = len(set(shared)) == 1
        return {**views, "shared": most_shared, "own": own,
                "block_order": None if uniform else block_order.to(self.device)}

    def invariant_row_groups(self, trees: bool) -> list[dict[str, torch.Tensor]]:
        """The batch-invariant attention's view (:mod:`specdec.kernels.invariant_attention`): key rows in which a
        query at position ``p`` sees its keys at columns ``0..p``, as plain decoding lays
        them out. A causal sequence (a prompt chunk, a decode token, a draft chain) is one
        row shared by its queries; each node of a draft tree gets its own row, its
        ancestors compacted behind the context (``trees``; else the trees are left out).
        Causal rows are grouped like :attr:`padded` (:func:`padded_groups`), tree nodes in
        a group of their own, rows padded to the group's most queries and to a multiple of
        :data:`specdec.kernels.invariant_attention.KEY_BLOCK` keys. Per group: ``slots [R, W]``,
        ``key_pos [R, W]``, ``queries [R, M]`` (packed token index; padding repeats token
        0), ``query_pos [R, M]``, ``bias [R, M, W]`` (0 where a query sees a key, else
        ``-inf``), ``rows`` / ``tokens``: the padded row of each real query and its packed
        index."""
        if self.has_pending:
            raise ValueError("the batch-invariant attention does not read pending draft masks")
        # a member: (sequence, its key columns in the row, its queries' packed tokens, positions, key counts)
        groups: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        causal = [b for b, is_tree in enumerate(self._is_tree) if not is_tree]
        group_of = {causal[i]: g for g, members in enumerate(
            padded_groups([(self.seqs[b].start, len(self.seqs[b].positions)) for b in causal])) for i in members}
        key_pos: list[torch.Tensor] = []
        for b, (s, first) in enumerate(zip(self.seqs, self.first_tokens)):
            n = len(s.positions)
            positions = s.positions.cpu()
            key_pos.append(torch.cat([torch.arange(s.start), positions]))
            tokens = torch.arange(first, first + n)
            if not self._is_tree[b]:
                groups.setdefault(group_of[b], []).append(
                    (b, torch.arange(s.start + n), tokens, positions, torch.arange(s.start + 1, s.start + n + 1)))
            elif trees:
                for i, cols in enumerate(self._node_columns(s)):
                    groups.setdefault(-1, []).append((b, cols, tokens[i:i + 1], positions[i:i + 1],
                                                     torch.tensor([len(cols)])))
        tables = pad_sequence([torch.tensor(s.block_table) for s in self.seqs], batch_first=True)
        key_pos_table = pad_sequence(key_pos, batch_first=True)
        out = []
        for _, members in sorted(groups.items()):
            seq = torch.tensor([b for b, *_ in members])
            cols = pad_sequence([c for _, c, *_ in members], batch_first=True, padding_value=-1)
            width = round_up(cols.shape[1], KEY_BLOCK)
            cols = F.pad(cols, (0, width - cols.shape[1]), value=-1)
            real, cols = cols >= 0, cols.clamp(min=0)
            slots = tables[seq].gather(1, cols // self.block_size) * self.block_size + cols % self.block_size
            queries = pad_sequence([t for _, _, t, _, _ in members], batch_first=True)
            m = queries.shape[1]
            counts = pad_sequence([c for *_, c in members], batch_first=True, padding_value=1)
            real_queries = pad_sequence([torch.ones(len(t), dtype=torch.bool) for _, _, t, _, _ in members],
                                        batch_first=True).flatten()
            rows = torch.arange(len(members) * m)[real_queries]
            bias = torch.zeros(len(members), m, width).masked_fill_(
                torch.arange(width)[None, None, :] >= counts[:, :, None], float("-inf"))
            group = {"slots": slots * real, "key_pos": key_pos_table[seq].gather(1, cols) * real,
                     "queries": queries, "query_pos": pad_sequence([p for _, _, _, p, _ in members], batch_first=True),
                     "bias": bias, "rows": rows, "tokens": queries.flatten()[rows]}
            out.append({k: v.to(self.device) for k, v in group.items()})
        return out

    def window_mask(self, window: int) -> torch.Tensor:
        """The dense mask narrowed to keys less than ``window`` positions back (built once per step)."""
        if window not in self._window_masks:
            near = (self.query_positions[:, None] - self.key_positions[None, :]) < window
            self._window_masks[window] = near if self.dense_mask is None else near & self.dense_mask
        return self._window_masks[window]

    @cached_property
    def token_key_rows(self) -> dict[str, torch.Tensor]:
        """Every token's keys as one row of cache slots, pending draft nodes included (what
        :func:`specdec.kernels.cpu.attend_key_rows` reads): a causal sequence's tokens
        share one row and see its first keys up to their own; each node of a tree (or a
        level of one over pending nodes) has a row of its own, the keys it sees in cache
        order. ``slots`` / ``key_pos`` the rows, flattened, then one unread slot (so that
        no row set is a single key); per token the ``offset`` of its row, the ``count`` of
        keys it sees and its own slot (``new_slots``, :attr:`slot_mapping`'s values).
        Built in plain Python, cheaper than :attr:`invariant_key_rows`, whose layout a
        target's bits depend on (a draft's do not)."""
        slots: list[int] = []
        key_pos: list[int] = []
        offset: list[int] = []
        count: list[int] = []
        new_slots: list[int] = []
        for s in self.seqs:
            n, keys = len(s.positions), s.start + len(s.positions)
            seq_slots = slot_ids(s.block_table, self.block_size, 0, keys)
            seq_pos = list(range(s.start)) + s.positions.tolist()
            new_slots += seq_slots[s.start:]
            if s.tree_mask is None and s.pending_mask is None:
                offset += [len(slots)] * n
                count += range(s.start + 1, keys + 1)
                slots += seq_slots
                key_pos += seq_pos
                continue
            m = s.pending_mask.shape[1] if s.pending_mask is not None else 0
            committed = s.start - m
            if m:
                seq_pos[committed:s.start] = s.pending_positions.tolist()
            pending = s.pending_mask.tolist() if m else [[]] * n
            for sees_pending, sees_new in zip(pending, self._tree(s).tolist()):
                cols = [committed + j for j, seen in enumerate(sees_pending) if seen]
                cols += [s.start + j for j, seen in enumerate(sees_new) if seen]
                offset.append(len(slots))
                count.append(committed + len(cols))
                slots += seq_slots[:committed] + [seq_slots[c] for c in cols]
                key_pos += seq_pos[:committed] + [seq_pos[c] for c in cols]
        slots.append(slots[0])
        key_pos.append(key_pos[0])
        out = {"slots": slots, "key_pos": key_pos, "offset": offset, "count": count, "new_slots": new_slots}
        return {k: long_tensor(v, self.device) for k, v in out.items()}

    # -- the Triton kernel's view ----------------------------------------------------

    @cached_property
    def invariant_key_rows(self) -> dict[str, torch.Tensor]:
        """The Triton batch-invariant attention's view of :attr:`invariant_rows`: every key
        row flattened into ``slots`` and ``key_pos``, and per packed token the ``offset``
        of its row there and the ``count`` of keys it sees (always the row's first ones)."""
        slots, key_pos = [], []
        offset = torch.zeros(self.num_tokens, dtype=torch.long, device=self.device)
        count = torch.zeros(self.num_tokens, dtype=torch.long, device=self.device)
        base = 0
        for g in self.invariant_rows:
            rows, width = g["slots"].shape
            m = g["queries"].shape[1]
            r, j = g["rows"] // m, g["rows"] % m
            offset[g["tokens"]] = base + r * width
            count[g["tokens"]] = (g["bias"] == 0).sum(-1)[r, j]
            slots.append(g["slots"].flatten())
            key_pos.append(g["key_pos"].flatten())
            base += rows * width
        return {"slots": torch.cat(slots), "key_pos": torch.cat(key_pos), "offset": offset, "count": count}

    @cached_property
    def kernel_tensors(self) -> dict[str, torch.Tensor]:
        """Per sequence: block table, committed tokens (``starts``), new tokens (``num_new``)
        and the packed index of its first new token (``first_token``); per token: its tree
        mask row over its sequence's new tokens (padded). With pending draft nodes, also
        per sequence their number (``num_pending``, the last cached tokens) and per token
        its pending mask row over them (``pending_mask``, padded)."""
        width = max(len(s.block_table) for s in self.seqs)
        max_new = max(len(s.positions) for s in self.seqs)
        tables = torch.zeros(len(self.seqs), width, dtype=torch.int32)
        trees = torch.zeros(self.num_tokens, max_new, dtype=torch.int8)
        pending = [s.pending_mask.shape[1] if s.pending_mask is not None else 0 for s in self.seqs]
        pending_rows = torch.zeros(self.num_tokens, max(pending), dtype=torch.int8) if self.has_pending else None
        for i, (s, row) in enumerate(zip(self.seqs, self.first_tokens)):
            n = len(s.positions)
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
            trees[row:row + n, :n] = self._tree(s).to(torch.int8)
            if pending[i]:
                pending_rows[row:row + n, :pending[i]] = s.pending_mask.cpu().to(torch.int8)
        to = lambda x: torch.tensor(x, dtype=torch.int32, device=self.device)  # noqa: E731
        out = {"block_tables": tables.to(self.device), "tree_mask": trees.to(self.device),
               "first_token": to(self.first_tokens), "starts": to([s.start for s in self.seqs]),
               "num_new": to([len(s.positions) for s in self.seqs])}
        if pending_rows is not None:
            out.update(pending_mask=pending_rows.to(self.device), num_pending=to(pending))
        return out
