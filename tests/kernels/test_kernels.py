"""Triton kernels against their torch references on random inputs (TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch
from helpers import random_layout

from specdec import DraftProposal
from specdec.kernels import chain_rejection_torch, greedy_tree_verify_torch
from specdec.kernels.attention import paged_attention_torch
from specdec.kernels.kv_copy import copy_kv_slots_torch
from specdec.kvcache.layout import AttentionLayout, SequenceSlice, slot_ids
from specdec.sampler import verify_greedy

triton_kernels = pytest.importorskip("specdec.kernels.triton_kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


CASES = [  # heads, kv_heads, dim, block size, sequences, window, softcap
    (4, 4, 16, 4, [(7, 1, False)], None, None),
    (4, 2, 16, 4, [(5, 3, False), (0, 6, False), (9, 1, False)], None, None),
    (9, 3, 64, 16, [(33, 5, True), (17, 1, False)], None, None),
    (8, 2, 24, 8, [(20, 6, True), (3, 4, True)], None, None),
    (4, 1, 32, 4, [(30, 4, True), (12, 1, False)], 8, None),
    (4, 2, 16, 4, [(11, 3, False), (6, 5, True)], None, 30.0),
    # contexts long enough for the kernel to cut the keys in splits and combine them
    (8, 2, 32, 32, [(700, 1, False), (300, 6, True), (5, 2, False)], None, None),
    (4, 1, 32, 32, [(600, 3, True), (40, 1, False)], 100, None),
    (4, 2, 16, 32, [(520, 5, True), (3, 1, False)], None, 30.0),
    # short contexts: the torch reference pads decodes, a chain and two trees in one group
    (4, 2, 16, 8, [(30, 1, False), (31, 1, False), (12, 1, False), (29, 2, False), (25, 3, True), (40, 9, True)],
     None, None),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_matches_reference(case):
    heads, kv_heads, dim, bs, shapes, window, softcap = CASES[case]
    gen = torch.Generator().manual_seed(case)
    layout = random_layout(gen, bs, 64, shapes, DEVICE)
    keys = torch.randn(64 * bs, kv_heads, dim, generator=gen).to(DEVICE)
    values = torch.randn(64 * bs, kv_heads, dim, generator=gen).to(DEVICE)
    query = torch.randn(heads, layout.num_tokens, dim, generator=gen).to(DEVICE)
    want = paged_attention_torch(query, keys, values, layout, dim ** -0.5, window, softcap)
    got = triton_kernels.paged_attention_triton(query, keys, values, layout, dim ** -0.5, window, softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


PENDING_CASES = [  # heads, kv_heads, dim, block size, sequences: (cached, of them pending, new)
    (4, 2, 16, 4, [(9, 3, 2)]),
    (4, 2, 16, 8, [(12, 4, 3), (7, 0, 1), (20, 6, 4)]),
    (8, 2, 32, 32, [(700, 5, 3), (300, 2, 2), (40, 0, 1)]),  # long enough for key splits
]


@pytest.mark.parametrize("case", range(len(PENDING_CASES)))
def test_paged_attention_with_pending_tree_nodes_matches_reference(case):
    """A draft tree expanded level by level: each new node sees the committed tokens, the
    pending nodes of earlier levels its mask names (the last cached ones) and its own
    ancestors among the new nodes."""
    heads, kv_heads, dim, bs, shapes = PENDING_CASES[case]
    gen = torch.Generator().manual_seed(case)
    free = torch.randperm(256, generator=gen).tolist()
    seqs = []
    for cached, pending, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // bs))]
        tree = torch.tril(torch.rand(new, new, generator=gen) < 0.5) | torch.eye(new, dtype=torch.bool)
        sees = torch.rand(new, pending, generator=gen) < 0.5 if pending else None
        positions = cached - pending + torch.randint(0, 4, (new,), generator=gen)
        seqs.append(SequenceSlice(block_table=table, start=cached, positions=positions, tree_mask=tree,
                                  pending_mask=sees,
                                  pending_positions=cached - pending + torch.arange(pending) if pending else None))
    layout = AttentionLayout(seqs, bs, torch.device(DEVICE))
    assert layout.has_pending
    keys = torch.randn(256 * bs, kv_heads, dim, generator=gen).to(DEVICE)
    values = torch.randn(256 * bs, kv_heads, dim, generator=gen).to(DEVICE)
    query = torch.randn(heads, layout.num_tokens, dim, generator=gen).to(DEVICE)
    want = paged_attention_torch(query, keys, values, layout, dim ** -0.5)
    got = triton_kernels.paged_attention_triton(query, keys, values, layout, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def naive_attention(query, keys, values, layout, scale):
    """Each sequence alone, in float64: its queries over its own cached and new keys."""
    heads, kv_heads = query.shape[0], keys.shape[1]
    out, row = [], 0
    for s in layout.seqs:
        n = len(s.positions)
        slots = slot_ids(s.block_table, layout.block_size, 0, s.start + n)
        k = keys[slots].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = values[slots].double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        scores = query[:, row:row + n].double() @ k.transpose(1, 2) * scale
        visible = torch.ones(n, s.start + n, dtype=torch.bool)
        visible[:, s.start:] = layout._tree(s)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("case", [1, 2, 3, 6, 9])
def test_batched_reference_attends_each_sequence_over_its_own_keys(case):
    heads, kv_heads, dim, bs, shapes, _, _ = CASES[case]
    gen = torch.Generator().manual_seed(case)
    layout = random_layout(gen, bs, 64, shapes)
    keys = torch.randn(64 * bs, kv_heads, dim, generator=gen)
    values = torch.randn(64 * bs, kv_heads, dim, generator=gen)
    query = torch.randn(heads, layout.num_tokens, dim, generator=gen)
    got = paged_attention_torch(query, keys, values, layout, dim ** -0.5)
    torch.testing.assert_close(got.double(), naive_attention(query, keys, values, layout, dim ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_paged_attention_bfloat16_cache():
    gen = torch.Generator().manual_seed(9)
    layout = random_layout(gen, 8, 32, [(19, 4, True), (5, 1, False)], DEVICE)
    keys = torch.randn(256, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    values = torch.randn(256, 2, 32, generator=gen).to(DEVICE, torch.bfloat16)
    query = torch.randn(6, layout.num_tokens, 32, generator=gen).to(DEVICE, torch.bfloat16)
    want = paged_attention_torch(query.float(), keys.float(), values.float(), layout, 32 ** -0.5)
    got = triton_kernels.paged_attention_triton(query, keys, values, layout, 32 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("row", [(2, 16), (3, 64), (1, 24)])
def test_copy_kv_slots_matches_reference_on_an_overlapping_path(row):
    kv_heads, dim = row
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(40, kv_heads, dim, generator=gen).to(DEVICE)
    values = torch.randn(40, kv_heads, dim, generator=gen).to(DEVICE)
    # an accepted tree path in order: node slots move down onto consecutive slots
    src = torch.tensor([13, 16, 21], device=DEVICE)
    dst = torch.tensor([11, 13, 14], device=DEVICE)  # slot 13 is read before it is written
    k_ref, v_ref = keys.clone(), values.clone()
    copy_kv_slots_torch(k_ref, v_ref, src, dst)
    triton_kernels.copy_rows_triton(keys, src, dst)
    triton_kernels.copy_rows_triton(values, src, dst)
    assert torch.equal(keys, k_ref) and torch.equal(values, v_ref)


def random_trees(gen, batch, vocab):
    proposals, target = [], []
    for _ in range(batch):
        n = int(torch.randint(1, 9, (), generator=gen))
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        rows = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        for i, p in enumerate(parents):  # make some paths match the target
            if torch.rand((), generator=gen) < 0.6:
                tokens[i] = rows[p + 1]
        proposals.append(DraftProposal(token_ids=tokens, parents=parents))
        target += rows
    return proposals, target


def packed(proposals):
    node_start, row_start, n0, r0 = [], [], 0, 0
    for p in proposals:
        node_start.append(n0)
        row_start.append(r0)
        n0 += len(p.token_ids)
        r0 += len(p.token_ids) + 1
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return (t([x for p in proposals for x in p.token_ids]), t([x for p in proposals for x in p.parents]),
            t(row_start), t(node_start), t([len(p.token_ids) for p in proposals]))


def test_greedy_tree_verification_kernel_matches_reference_and_sampler():
    gen = torch.Generator().manual_seed(3)
    proposals, target = random_trees(gen, 12, 6)
    args = packed(proposals)
    max_depth = max(max(p.depths()) for p in proposals)
    target_t = torch.tensor(target, dtype=torch.int64, device=DEVICE)
    want = greedy_tree_verify_torch(target_t.cpu(), *[a.cpu() for a in args], 8, max_depth)
    got = triton_kernels.greedy_tree_verify_triton(target_t, *args, 8, max_depth)
    for w, g in zip(want, got):
        assert torch.equal(w.cpu().to(torch.int64), g.cpu().to(torch.int64))
    r = 0
    for b, prop in enumerate(proposals):  # and both agree with the sampler's own greedy walk
        verdict = verify_greedy(target[r:r + len(prop.token_ids) + 1], prop)
        assert verdict.accepted_nodes == want[0][b, :want[1][b]].tolist()
        assert verdict.tokens[-1] == int(want[2][b])
        r += len(prop.token_ids) + 1


@pytest.mark.parametrize("vocab", [7, 50, 1500])
def test_chain_rejection_kernel_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    lengths = [3, 1, 5, 4, 2, 6]
    batch = len(lengths)
    logits = torch.randn(sum(lengths) + batch, vocab, generator=gen) * 3
    p = torch.softmax(logits, -1)
    parent_row = torch.cat([torch.arange(n) + sum(lengths[:b]) + b for b, n in enumerate(lengths)])
    q = torch.softmax(logits[parent_row] + torch.randn(sum(lengths), vocab, generator=gen), -1)  # a close draft
    tokens = torch.multinomial(q, 1, generator=gen).flatten().to(torch.int32)
    u_accept = torch.rand(sum(lengths), generator=gen)
    u_sample = torch.rand(batch, generator=gen)
    node_start = torch.tensor([sum(lengths[:b]) for b in range(batch)], dtype=torch.int32)
    row_start = node_start + torch.arange(batch, dtype=torch.int32)
    num = torch.tensor(lengths, dtype=torch.int32)
    one_hot = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.int32)
    args = (p, q, tokens, u_accept, u_sample, row_start, node_start, num, one_hot, max(lengths))
    want = chain_rejection_torch(*args)
    got = triton_kernels.chain_rejection_triton(*[a.to(DEVICE) if torch.is_tensor(a) else a for a in args])
    assert torch.equal(want[0], got[0].cpu())
    assert torch.equal(want[1], got[1].cpu())
    assert (want[0] < num).any() and (want[0] > 0).any()  # both rejections and acceptances were exercised


def test_a_failing_kernel_falls_back_to_its_reference_once(monkeypatch, caplog):
    import specdec.kernels as kernels

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("cannot compile for this GPU")

    monkeypatch.setattr(kernels, "use_triton", lambda tensor, name="": name not in kernels._failed)
    monkeypatch.setattr(kernels._triton(), "copy_rows_triton", broken)
    monkeypatch.setattr(kernels, "_failed", set())
    keys, values = torch.zeros(4, 1, 2), torch.zeros(4, 1, 2)
    keys[2] = 7
    src, dst = torch.tensor([2]), torch.tensor([0])
    with caplog.at_level("WARNING"):
        kernels.copy_kv_slots(keys, values, src, dst)
        kernels.copy_kv_slots(keys, values, src, dst)
    assert keys[0].tolist() == [[7.0, 7.0]]
    assert calls == [1] and "copy_kv_slots_triton failed" in caplog.text


def test_a_kernel_failing_after_a_partial_write_fails_loudly(monkeypatch):
    """Issue 10: the K/V copy moved the keys, then the values launch failed: rerunning the
    reference on the moved keys would read overwritten rows, so the step must fail."""
    import specdec.kernels as kernels

    real = kernels._triton().copy_rows_triton
    launches = []

    def keys_only(pool, src, dst):
        launches.append(pool)
        if len(launches) == 2:
            raise RuntimeError("launch failed")
        real(pool, src, dst)

    monkeypatch.setattr(kernels, "use_triton", lambda tensor, name="": name not in kernels._failed)
    monkeypatch.setattr(kernels._triton(), "copy_rows_triton", keys_only)
    monkeypatch.setattr(kernels, "_failed", set())
    keys = torch.arange(8.0, device=DEVICE).view(4, 1, 2)
    values = torch.arange(8.0, device=DEVICE).view(4, 1, 2)
    src, dst = torch.tensor([2, 3], device=DEVICE), torch.tensor([1, 2], device=DEVICE)  # slot 2 read, then written
    with pytest.raises(kernels.KernelError, match="after moving the keys"):
        kernels.copy_kv_slots(keys, values, src, dst)
    assert keys[1:3].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]  # the keys moved once, not twice
    kernels.copy_kv_slots(keys, values, src, dst)  # later calls: the reference, no kernel
    assert len(launches) == 2 and values[1:3].flatten().tolist() == [4.0, 5.0, 6.0, 7.0]


def test_argmax_rows_gives_torchs_argmax_on_ties_nans_infinities_and_views():
    """The numpy path for CPU float rows answers as torch.argmax does: the first maximum,
    the first NaN, all -inf rows at 0, strided views, one row or many; other dtypes fall
    back to torch."""
    from specdec.kernels import argmax_rows

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 49152, generator=g)
    rows[1, 7] = rows[1, 900] = rows[1].max() + 1  # a tie: the first
    rows[2, 3000] = float("nan")
    rows[2, 4000] = float("nan")
    rows[3] = float("-inf")
    rows[4, :10] = float("inf")
    for x in (rows, rows[:, ::3], rows[2], rows.double(), rows[:0], rows.t()):
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    for x in (rows.bfloat16(), rows.half(), rows.to(torch.int32), rows.clone().requires_grad_()):
        assert torch.equal(argmax_rows(x), x.argmax(-1))
