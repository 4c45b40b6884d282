"""CUDA graphs of the target forward (``engine.cuda_graphs``): how a step is padded into a
graph's bucket (on any machine), and on a GPU the graphed steps' logits and hidden states
against the eager forward's, and greedy output, plain and with drafts, equal to eager."""

import pytest
import torch

from specdec import LLM, SamplingParams, testing
from specdec.errors import ConfigError
from specdec.executor.cuda_graphs import CudaGraphs, batch_buckets, pad_step
from specdec.kvcache import PagedKVCache
from specdec.kvcache.layout import AttentionLayout, SequenceSlice
from specdec.model.loading import load_causal_lm
from specdec.model.target import ForwardMetadata, TargetModel

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_a_step_is_padded_to_its_bucket():
    """Three sequences (a 2-token chain after 5 cached tokens, a 3-node tree after 2, a
    one-token prompt) in a bucket of 4 sequences x 4 tokens: each token on its sequence's
    rows, padding rows writing to the scratch slot and seeing only themselves, padding
    sequences empty."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    seqs = [SequenceSlice(block_table=[3, 7], start=5, positions=torch.tensor([5, 6])),
            SequenceSlice(block_table=[1, 2], start=2, positions=torch.tensor([2, 3, 3]), tree_mask=tree),
            SequenceSlice(block_table=[6], start=0, positions=torch.tensor([0]))]
    step = pad_step(seqs, batch=4, width=4, block_size=4, scratch_slot=99)
    assert step.index.tolist() == [0, 1, 4, 5, 6, 8]
    assert step.slots.tolist() == [29, 30, 99, 99, 6, 7, 8, 99, 24, 99, 99, 99] + [99] * 4
    assert step.tables.tolist() == [[3, 7], [1, 2], [6, 0], [0, 0]]
    assert step.starts.tolist() == [5, 2, 0, 0]
    eye = torch.eye(4, dtype=torch.int8)
    want = [eye.clone() for _ in range(4)]
    want[0][:2, :2] = torch.tensor([[1, 0], [1, 1]])
    want[1][:3, :3] = tree.to(torch.int8)
    assert torch.equal(step.tree, torch.cat(want))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(10) == [1, 2, 4, 8, 10]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]


def test_cuda_graphs_beside_compile_or_invariant_mode_or_on_a_cpu_are_errors(tiny_models):
    with pytest.raises(ConfigError, match="cuda_graphs.*compile"):
        LLM(engine={"cuda_graphs": True, "compile": True})
    with pytest.raises(ConfigError, match="cuda_graphs.*batch_invariant"):
        LLM(engine={"cuda_graphs": True, "batch_invariant": True})
    with pytest.raises(ConfigError, match="engine.cuda_graphs: the target runs on cpu.*device: cuda"):
        LLM(model=str(tiny_models["llama"]), dtype="float32", device="cpu", engine={"cuda_graphs": True})


def test_steps_no_graph_holds_run_eagerly_and_show_in_metrics(tiny_models):
    """Where the paged attention is not the Triton kernel (here, a CPU), every step runs
    the eager forward and is counted so in /metrics; output is the eager engine's."""
    from specdec.serving.async_engine import engine_stats
    from specdec.serving.metrics import ServerMetrics

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = LLM(model=str(tiny_models["llama"]), dtype="float32", device="cpu").generate([[5, 6, 7]], params)
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", device="cpu")
    engine = llm.engine
    engine.forward.cuda_graphs = CudaGraphs(engine.target, engine.kv.cache, 16, max_model_len=256, max_batch=8,
                                            hidden_layers=engine.forward.hidden_layers)
    got = llm.generate([[5, 6, 7]], params)
    assert got[0].token_ids == want[0].token_ids
    assert engine.cuda_graphs.eager_steps == got[0].metrics.num_steps + 1 > 1  # the prompt's step, then decodes
    exposed = ServerMetrics().render(engine_stats(engine), 0).decode()
    assert f'specdec_cuda_graph_steps_total{{path="eager"}} {float(engine.cuda_graphs.eager_steps)}' in exposed
    assert 'specdec_cuda_graph_steps_total{path="replayed"} 0.0' in exposed
    assert "specdec_cuda_graphs 0.0" in exposed


def _step(cache_blocks: list[list[int]], seqs: list[tuple[int, list[int], torch.Tensor | None]]) -> list:
    """SequenceSlices of ``(start, positions, tree_mask)`` over each sequence's blocks."""
    return [SequenceSlice(block_table=blocks, start=start, positions=torch.tensor(positions), tree_mask=mask)
            for blocks, (start, positions, mask) in zip(cache_blocks, seqs)]


@needs_cuda
def test_graphed_steps_give_the_eager_logits_and_hidden_states(tiny_models):
    """The same steps through the eager forward and through graphs, each on its own cache:
    three prompts (a bucket of 4 sequences x 48 tokens), a decode of three (4 x 1), chains
    of 3 and 5 tokens beside a decode (4 x 6), and a tree beside a chain (2 x 4)."""
    device = torch.device("cuda")
    target = TargetModel(load_causal_lm(tiny_models["llama"], torch.float32, device), None, "tiny")
    target.capture_hidden_layers([0, -1])
    caches = [PagedKVCache(target.layer_shapes, 16, 16, target.dtype, device) for _ in range(2)]
    graphs = CudaGraphs(target, caches[1], 16, max_model_len=256, max_batch=4, hidden_layers=frozenset({0, -1}))
    blocks = [[0, 1, 2], [5, 4, 3], [9, 8, 10]]
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [
        [(0, list(range(20)), None), (0, list(range(9)), None), (0, list(range(33)), None)],  # prompts
        [(20, [20], None), (9, [9], None), (33, [33], None)],
        [(21, [21, 22, 23], None), (10, [10], None), (34, [34, 35, 36, 37, 38], None)],
        [(24, [24, 25, 25, 26], tree), (11, [11, 12], None)],
    ]
    g = torch.Generator().manual_seed(0)
    for step in steps:
        seqs = _step(blocks, step)
        tokens = sum(len(p) for _, p, _ in step)
        ids = torch.randint(0, 100, (tokens,), generator=g).to(device)
        rows = torch.arange(tokens, device=device)
        results = []
        for cache, forward in zip(caches, (target.forward, graphs.forward)):
            layout = AttentionLayout(seqs, 16, device)
            meta = ForwardMetadata(cache=cache, layout=layout, hidden_layers=frozenset({0, -1}))
            logits, hidden = forward(ids, layout.query_positions, meta, rows)
            results.append((logits, dict(hidden)))
        (eager, eager_hidden), (graphed, graphed_hidden) = results
        torch.testing.assert_close(graphed, eager, atol=1e-4, rtol=1e-4)
        assert sorted(graphed_hidden) == [-1, 0]
        for layer, state in eager_hidden.items():
            torch.testing.assert_close(graphed_hidden[layer], state, atol=1e-4, rtol=1e-4)
    assert graphs.replays == 4 and graphs.num_graphs == 4  # 4 x 48 (the prompts), 4 x 1, 4 x 6, 2 x 4


@needs_cuda
def test_greedy_output_with_cuda_graphs_equals_eager(tiny_models):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (1, 7, 30)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    eager = LLM(model=str(tiny_models["llama"]), dtype="float32", device="cuda").generate(prompts, params)
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", device="cuda", engine={"cuda_graphs": True})
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    assert llm.engine.cuda_graphs.replays >= 15 and llm.engine.cuda_graphs.num_graphs >= 1


@needs_cuda
def test_drafts_through_cuda_graphs_are_lossless(tiny_models):
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["llama"],
                                  engine={"cuda_graphs": True}, device="cuda")
