"""The head drafts at inference what it learnt in training: the draft runner's incremental
rows, tree levels and siblings give the same features as training's unrolled steps."""

import pytest
import torch
from transformers import LlamaConfig

from specdec.draft_runner import DraftInput, DraftRunner, draft_attention
from specdec_eagle.modules import Eagle1Head, Eagle3Head, unrolled_attention

CFG = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           vocab_size=128, rms_norm_eps=1e-6, max_position_embeddings=256)


def _head(generation: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG)
    head = Eagle1Head(cfg) if generation == 1 else Eagle3Head(cfg, 64, 3, 32, 128)
    head.embed_tokens = torch.nn.Embedding(128, 64)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head.eval()


def _unrolled(head, tokens_per_step, feature, length):
    """Training's computation: step j's rows read tokens_per_step[j] and step j-1's outputs."""
    attend, next_step = unrolled_attention(torch.ones(1, length, dtype=torch.bool))
    outs = []
    for j, tokens in enumerate(tokens_per_step):
        feature = head.step(head.embed_tokens(tokens)[None], feature, torch.arange(length) + j, attend)[0][None]
        next_step()
        outs.append(feature[0])
    return outs


@pytest.mark.parametrize("generation", [1, 3])
@torch.no_grad()
def test_runner_rows_and_tree_levels_match_training_steps(generation):
    head = _head(generation)
    length = 9
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (length,), generator=g)  # step 0 tokens
    a = torch.randint(0, 128, (length,), generator=g)  # a depth-1 draft token after each position
    b = torch.randint(0, 128, (length,), generator=g)  # its sibling
    c = torch.randint(0, 128, (length,), generator=g)  # a depth-2 token below a
    feats = torch.randn(1, length, 64, generator=g)
    step0, step1a, step2 = _unrolled(head, [x, a, c], feats, length)
    _, step1b = _unrolled(head, [x, b], feats, length)

    scale = 16 ** -0.5

    def forward(input_ids, positions, meta, feature):
        return head.step(head.embed_tokens(input_ids), feature, positions,
                         lambda m, q, k, v: draft_attention(m, q, k, v, meta, scale))

    runner = DraftRunner.for_module(forward, 16, 4, torch.float32, torch.device("cpu"), feature=torch.zeros(1, 64))
    seq = runner.sequence("r")
    k = 6
    out = runner.forward([DraftInput(seq, x[:k].tolist(), features={"feature": feats[0, :k]},
                                     output_rows=list(range(k)))])[0]
    torch.testing.assert_close(out, step0[:k], atol=1e-4, rtol=1e-4)
    # depth 1: two siblings after the last committed row; depth 2: a child of the first
    i = k - 1
    lvl1 = runner.forward([DraftInput(seq, [int(a[i]), int(b[i])], parents=[-1, -1],
                                      features={"feature": out[i:i + 1].expand(2, -1)}, output_rows=[0, 1])])[0]
    torch.testing.assert_close(lvl1[0], step1a[i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lvl1[1], step1b[i], atol=1e-4, rtol=1e-4)
    lvl2 = runner.forward([DraftInput(seq, [int(c[i])], parents=[0], features={"feature": lvl1[:1]})])[0]
    torch.testing.assert_close(lvl2[0], step2[i], atol=1e-4, rtol=1e-4)
    # the draft's guesses are dropped; the next committed rows continue as in training
    runner.drop_pending(seq)
    more = runner.forward([DraftInput(seq, x[k:].tolist(), features={"feature": feats[0, k:]},
                                      output_rows=list(range(length - k)))])[0]
    torch.testing.assert_close(more, step0[k:], atol=1e-4, rtol=1e-4)


def test_eagle3_draft_vocabulary_maps_back_to_target_ids():
    head = _head(3)
    ids = torch.tensor(sorted(torch.randperm(128)[:32].tolist()))
    head.set_draft_vocab(ids)
    assert head.draft_to_target.tolist() == ids.tolist()
    assert head.t2d.sum() == 32 and bool(head.t2d[ids].all())
