"""The head drafts at inference what it learnt in training: the draft runner's incremental
rows, tree levels and siblings give the same features as training's unrolled steps."""

import pytest
import torch
from specdec_eagle.modules import Eagle1Head, Eagle3Head
from transformers import LlamaConfig

from specdec import testing
from specdec.drafting.runner import draft_attention

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


@pytest.mark.parametrize("generation", [1, 3])
def test_runner_rows_and_tree_levels_match_training_steps(generation):
    head = _head(generation)
    scale = 16 ** -0.5

    def train_step(tokens, feature, positions, attend):
        return head.step(head.embed_tokens(tokens)[None], feature, positions, attend)

    def forward(input_ids, positions, meta, feature):
        return head.step(head.embed_tokens(input_ids), feature, positions,
                         lambda m, q, k, v: draft_attention(m, q, k, v, meta, scale))

    testing.check_rows_match_unrolled(train_step, forward, 64)


def test_eagle3_draft_vocabulary_maps_back_to_target_ids():
    head = _head(3)
    ids = torch.tensor(sorted(torch.randperm(128)[:32].tolist()))
    head.set_draft_vocab(ids)
    assert head.draft_to_target.tolist() == ids.tolist()
    assert head.t2d.sum() == 32 and bool(head.t2d[ids].all())
