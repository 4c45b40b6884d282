"""The draft-side runner: chains with rollback and trees expanded level by level, with the
drafted tree's K/V kept only along the accepted path, checked against no-cache forwards."""

import pytest
import torch

from conftest import stock_model
from specdec.drafting.runner import DraftInput, DraftRunner, causal_lm_forward


def _models(directory):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ref = stock_model(directory)
    runner = DraftRunner.for_module(causal_lm_forward(draft), num_blocks=32, block_size=4, dtype=torch.float32,
                                    device=torch.device("cpu"))
    return runner, ref


def _ref_last(ref, tokens):
    with torch.no_grad():
        return getattr(ref, ref.base_model_prefix)(torch.tensor([tokens])).last_hidden_state[0, -1]


def _tree_levels_then_accepted_path(runner, ref):
    prefix = [5, 17, 3, 9, 22, 41, 7, 13, 2, 30]  # longer than the tiny models' sliding windows
    a, b, c, d, e = 11, 12, 21, 22, 31
    with torch.inference_mode():
        seq = runner.sequence("r")
        (out,) = runner.forward([DraftInput(seq, prefix)])
        torch.testing.assert_close(out[0], _ref_last(ref, prefix), atol=1e-4, rtol=1e-4)
        # level 1: two children of the last prefix token; level 2: one child under each
        (lvl1,) = runner.forward([DraftInput(seq, [a, b], parents=[-1, -1], output_rows=[0, 1])])
        (lvl2,) = runner.forward([DraftInput(seq, [c, d], parents=[0, 1], output_rows=[0, 1])])
        torch.testing.assert_close(lvl1[1], _ref_last(ref, prefix + [b]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lvl2[0], _ref_last(ref, prefix + [a, c]), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lvl2[1], _ref_last(ref, prefix + [b, d]), atol=1e-4, rtol=1e-4)
        used = runner.kv.pool.num_free
        # the target accepted b then d: keep that path only, then extend the sequence causally
        runner.keep_path(seq, [1, 3], [b, d])
        assert seq.num_computed == len(prefix) + 2 and seq.token_ids == prefix + [b, d]
        assert runner.kv.pool.num_free >= used
        (after,) = runner.forward([DraftInput(seq, [e])])
        torch.testing.assert_close(after[0], _ref_last(ref, prefix + [b, d, e]), atol=1e-4, rtol=1e-4)
        runner.release("r")
    assert runner.kv.pool.num_free == runner.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "deepseek_v3"])
def test_tree_levels_then_accepted_path_match_a_no_cache_forward(tiny_models, arch):
    _tree_levels_then_accepted_path(*_models(tiny_models[arch]))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_compiled_runner_matches_a_no_cache_forward_on_its_two_graphs(tiny_models, arch):
    """Compiled (as beside a compiled target), the module attends over every token's own
    row of keys on the CPU kernel (sliding windows and soft-capping too, gemma2): tree
    levels over pending nodes, the accepted path, and a batch of a prompt, a chain token
    and a tree level, equal to no-cache forwards, on the graphs compiled up front."""
    from torch._dynamo.utils import counters

    runner, ref = _models(tiny_models[arch])
    before = counters["stats"]["unique_graphs"]
    runner.compile()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == before + 2, "the module did not compile its two graphs"
    _tree_levels_then_accepted_path(runner, ref)
    p1, p2, p3 = [4, 8, 15, 16, 23, 42, 7], [3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]
    with torch.inference_mode():
        s1, s2, s3 = (runner.sync(name, p) for name, p in (("a", p1), ("b", p2), ("c", p3)))
        runner.forward([DraftInput(s2, p2), DraftInput(s3, p3)])
        outs = runner.forward([DraftInput(s1, p1), DraftInput(s2, [9]),
                               DraftInput(s3, [5, 6], parents=[-1, -1], output_rows=[0, 1])])
    torch.testing.assert_close(outs[0][0], _ref_last(ref, p1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[1][0], _ref_last(ref, p2 + [9]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[2][1], _ref_last(ref, p3 + [6]), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_batched_requests_and_chain_rollback(tiny_models):
    runner, ref = _models(tiny_models["llama"])
    p1, p2 = [1, 2, 3, 4, 5, 6], [9, 8, 7]
    with torch.inference_mode():
        s1, s2 = runner.sync("a", p1), runner.sync("b", p2)
        outs = runner.forward([DraftInput(s1, s1.token_ids[s1.num_computed:]),
                               DraftInput(s2, s2.token_ids[s2.num_computed:], output_rows=[0, 1, 2])])
        assert outs[1].shape[0] == 3
        torch.testing.assert_close(outs[0][0], _ref_last(ref, p1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[1][1], _ref_last(ref, p2[:2]), atol=1e-4, rtol=1e-4)
        runner.forward([DraftInput(s1, [40]), DraftInput(s2, [41])])  # drafts, committed as drafted
        runner.forward([DraftInput(s1, [42])])
        # the target rejected the drafts: a sync rolls the draft cache back to the common prefix
        s1 = runner.sync("a", p1 + [40, 50])
        assert s1.num_computed == len(p1) + 1
        (out,) = runner.forward([DraftInput(s1, s1.token_ids[s1.num_computed:])])
        torch.testing.assert_close(out[0], _ref_last(ref, p1 + [40, 50]), atol=1e-4, rtol=1e-4)
        # the same tokens again: the last one is still run, so there is an output to draft from
        s1 = runner.sync("a", p1 + [40, 50])
        assert s1.num_computed == len(p1) + 1


def test_a_full_pool_skips_drafting_instead_of_failing(tiny_models):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    runner = DraftRunner.for_module(causal_lm_forward(model), num_blocks=2, block_size=4, dtype=torch.float32,
                                    device=torch.device("cpu"))
    with torch.inference_mode():
        seq = runner.sync("a", list(range(1, 20)))
        assert runner.forward([DraftInput(seq, seq.token_ids)]) is None
    assert runner.kv.pool.num_free == 2 and seq.num_computed == 0


def test_runner_works_for_a_module_with_features(tiny_models):
    """A draft module fed per-token features (EAGLE-style fused target states)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    base_forward = causal_lm_forward(model)
    fc = torch.nn.Linear(64, 64)
    seen = []

    def forward(input_ids, positions, meta, feature):
        seen.append(feature.shape)
        return fc(base_forward(input_ids, positions, meta)) + feature

    runner = DraftRunner.for_module(forward, 8, 4, torch.float32, torch.device("cpu"), feature=torch.zeros(1, 64))
    with torch.inference_mode():
        s1, s2 = runner.sequence("a"), runner.sequence("b")
        outs = runner.forward([DraftInput(s1, [1, 2], features={"feature": torch.ones(2, 64)}),
                               DraftInput(s2, [3], features={"feature": torch.zeros(1, 64)})])
    assert seen[-1] == (3, 64) and outs[0].shape == (1, 64)


def test_a_feature_queue_rolls_back_to_a_row_inside_a_block_or_chunk():
    """A recompute from a position the queue holds (a preempted request computed again)
    keeps the rows before it, fused blocks and unfused chunks cut where the position
    falls, tokens alike."""
    from specdec.drafting.feature_drafter import FeatureQueue

    rows = torch.arange(16.0).reshape(8, 2)
    queue = FeatureQueue(tokens=list(range(10, 18)), fused=[rows[:2], rows[2:3]],
                         chunks=[[rows[3:5], -rows[3:5]], [rows[5:8], -rows[5:8]]])
    queue.keep(6)
    assert queue.tokens == list(range(10, 16))
    assert [len(b) for b in queue.fused] == [2, 1] and [len(c[0]) for c in queue.chunks] == [2, 1]
    assert torch.equal(torch.cat(queue.fused + queue.unfused_rows(0)), rows[:6])
    assert torch.equal(torch.cat(queue.unfused_rows(1)), -rows[3:6])
    queue.keep(1)
    assert queue.tokens == [10] and torch.equal(torch.cat(queue.fused), rows[:1]) and queue.chunks == []
    queue.keep(0)
    assert queue.tokens == [] and queue.fused == [] and queue.chunks == []


def test_a_module_that_does_not_compile_drafts_eagerly(tiny_models, caplog, monkeypatch):
    """A draft module whose compilation fails costs its compiled speed, with a warning,
    never the drafter: the runner keeps running it eagerly, outputs unchanged."""
    runner, ref = _models(tiny_models["llama"])

    def failing_compile(fn, **options):
        def compiled(*args, **kwargs):
            raise RuntimeError("the backend failed")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    runner.compile()
    assert "did not compile" in caplog.text and runner.kv.pool.num_free == runner.kv.pool.num_blocks
    with torch.inference_mode():
        (out,) = runner.forward([DraftInput(runner.sequence("a"), [3, 1, 4, 1, 5])])
    torch.testing.assert_close(out[0], _ref_last(ref, [3, 1, 4, 1, 5]), atol=1e-4, rtol=1e-4)
