"""The compiled target forward (``engine.compile``): the eager forward's logits and hidden
states, two graphs compiled when the engine starts and none while it serves, drafts as
lossless as without it, on plain and int4 targets."""

import pytest
import torch
from torch._dynamo.utils import counters

from specdec import LLM, SamplingParams, testing
from specdec.errors import ConfigError
from specdec.executor.model_runner import ForwardMetadata, TargetModel
from specdec.kernels import AttentionLayout, SequenceSlice
from specdec.kvcache import PagedKVCache
from specdec.models import load_causal_lm


def _forwards(target: TargetModel) -> list[tuple[torch.Tensor, dict]]:
    """A 12-token prompt, a decode and a 5-token chain: logits and captured hidden states."""
    cache = PagedKVCache(target.layer_shapes, 4, 16, target.dtype, target.device)
    ids = torch.arange(3, 23) % 100
    out = []
    for start, count, rows in ((0, 12, [11]), (12, 1, [0]), (13, 5, [0, 1, 2, 3, 4])):
        positions = torch.arange(start, start + count)
        layout = AttentionLayout([SequenceSlice(block_table=[0, 1], start=start, positions=positions)], 16,
                                 target.device)
        logits, captured = target.forward(ids[start:start + count], positions,
                                          ForwardMetadata(cache=cache, layout=layout), torch.tensor(rows))
        out.append((logits, dict(captured)))
    return out


def test_the_compiled_forward_gives_the_eager_logits_and_hidden_states(tiny_models):
    results = []
    for compiled in (False, True):
        target = TargetModel(load_causal_lm(tiny_models["llama"], torch.float32, torch.device("cpu")), None, "tiny")
        target.capture_hidden_layers([0, -1])
        if compiled:
            target.compile()
        results.append(_forwards(target))
    for (eager, eager_states), (compiled, compiled_states) in zip(*results):
        assert compiled.shape == eager.shape
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
        assert sorted(compiled_states) == [-1, 0]
        for layer, state in eager_states.items():
            torch.testing.assert_close(compiled_states[layer], state, atol=1e-4, rtol=1e-4)


def test_the_one_token_graph_traces_its_attention_and_the_other_calls_the_operator(tiny_models):
    """A decode step's attention is part of the compiled graph (no call of the opaque
    operator); a step of several tokens calls the operator once per layer."""
    from torch.profiler import ProfilerActivity, profile

    target = TargetModel(load_causal_lm(tiny_models["llama"], torch.float32, torch.device("cpu")), None, "tiny")
    target.compile()
    _forwards(target)  # compiles both graphs
    calls = {}
    for start, count in ((12, 1), (13, 5)):
        cache = PagedKVCache(target.layer_shapes, 4, 16, target.dtype, target.device)
        positions = torch.arange(start, start + count)
        layout = AttentionLayout([SequenceSlice(block_table=[0, 1], start=start, positions=positions)], 16,
                                 target.device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            target.forward(torch.arange(count), positions, ForwardMetadata(cache=cache, layout=layout),
                           torch.tensor([count - 1]))
        calls[count] = sum(e.count for e in prof.key_averages() if e.key == "specdec::paged_attention")
    assert calls == {1: 0, 5: target.num_layers}


def test_two_graphs_compile_when_the_engine_starts_and_none_while_it_serves(tiny_models):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in (1, 7, 30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = LLM(model=str(tiny_models["llama"]), dtype="float32").generate(prompts, params)
    before = counters["stats"]["unique_graphs"]
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"compile": True})
    assert counters["stats"]["unique_graphs"] - before == 2
    alone = [llm.generate([p], params)[0] for p in prompts]  # decode at batch 1: the one-token graph
    batched = llm.generate(prompts, params)
    assert counters["stats"]["unique_graphs"] - before == 2
    for a, b, c in zip(eager, alone, batched):
        assert a.token_ids == b.token_ids == c.token_ids


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_drafts_on_a_compiled_target_are_lossless(tiny_models, quantization):
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["llama"],
                                  engine={"compile": True, "quantization": quantization}, device="cpu")


def test_compile_with_batch_invariant_is_a_config_error():
    with pytest.raises(ConfigError, match="compile.*batch_invariant"):
        LLM(engine={"compile": True, "batch_invariant": True})


def test_targets_compiled_in_one_process_keep_their_own_graphs(tiny_models):
    """Each target's graphs hold its own frozen weights: two models compiled side by side
    answer as they do eagerly (Gemma 2's soft-capping and sliding window go through the
    attention operator)."""
    prompts = [[5, 9, 11, 3, 7, 5, 9]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eager = {arch: LLM(model=str(tiny_models[arch]), dtype="float32").generate(prompts, params)[0].token_ids
             for arch in ("llama", "gemma2")}
    compiled = {arch: LLM(model=str(tiny_models[arch]), dtype="float32", engine={"compile": True})
                for arch in ("llama", "gemma2")}
    assert eager["llama"] != eager["gemma2"]
    for arch, llm in compiled.items():
        assert llm.generate(prompts, params)[0].token_ids == eager[arch]
