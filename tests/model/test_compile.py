"""The compiled target forward (``engine.compile``): the eager forward's logits and hidden
states, three graphs compiled when the engine starts and none while it serves, drafts as
lossless as without it, on plain and int4 targets; on the integer-dot kernels one
batch-invariant graph, on by default; engines sharing a target share its graphs. Graphs
are counted from no kept target (:mod:`specdec.model.kept`), or for a model no other test
compiled."""

from types import SimpleNamespace

import pytest
import torch
from helpers import LastStateWatcher, StateWatcher
from torch._dynamo.utils import counters

from specdec import LLM, SamplingParams, testing
from specdec.errors import ConfigError
from specdec.kernels import int8_dot
from specdec.kvcache import PagedKVCache
from specdec.kvcache.layout import AttentionLayout, SequenceSlice
from specdec.model.kept import release_kept_targets
from specdec.model.loading import load_causal_lm
from specdec.model.target import ForwardMetadata, TargetModel


def _forwards(target: TargetModel) -> list[tuple[torch.Tensor, dict]]:
    """A 12-token prompt, a decode, a 5-token chain and a 4-node tree (a root and three
    children): logits and captured hidden states."""
    cache = PagedKVCache(target.layer_shapes, 4, 16, target.dtype, target.device)
    ids = torch.arange(3, 25) % 100
    tree = torch.eye(4, dtype=torch.bool)
    tree[:, 0] = True
    out = []
    for start, count, rows, mask in ((0, 12, [11], None), (12, 1, [0], None), (13, 5, [0, 1, 2, 3, 4], None),
                                     (18, 4, [0, 1, 2, 3], tree)):
        positions = torch.arange(start, start + count) if mask is None else start + (torch.arange(count) > 0)
        layout = AttentionLayout([SequenceSlice(block_table=[0, 1], start=start, positions=positions,
                                                tree_mask=mask)], 16, target.device)
        logits, captured = target.forward(ids[start:start + count], positions,
                                          ForwardMetadata(cache=cache, layout=layout, hidden_layers=frozenset({0, -1})),
                                          torch.tensor(rows))
        out.append((logits, dict(captured)))
    return out


def _tiny_target(tiny_models) -> TargetModel:
    """The tiny Llama's target, eager, capturing the first layer's and the final norm's states."""
    target = TargetModel(load_causal_lm(tiny_models["llama"], torch.float32, torch.device("cpu")), None, "tiny")
    target.capture_hidden_layers([0, -1])
    return target


PROMPT_LENGTHS = (1, 7, 30)
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llms(tiny_models) -> SimpleNamespace:
    """The tiny Llama in float32, from no kept target: an eager ``LLM`` and its answers to
    prompts of 1, 7 and 30 tokens, then a compiled one (``plain``) and one whose drafter
    reads the first layer's state (``reader``), with the graphs each compiled when it
    started. The tests that need compiled graphs share these: a frozen graph is compiled
    anew in every process and every test (its packed weights keep it out of inductor's
    cache)."""
    model = str(tiny_models["llama"])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 100, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    release_kept_targets()
    eager = LLM(model=model, dtype="float32")
    want = [o.token_ids for o in eager.generate(prompts, PARAMS)]
    before = counters["stats"]["unique_graphs"]
    plain = LLM(model=model, dtype="float32", engine={"compile": True})
    plain_graphs = counters["stats"]["unique_graphs"] - before
    reader = LLM(model=model, dtype="float32", engine={"compile": True},
                 speculative_config={"decoding_type": "user", "drafter": StateWatcher})
    return SimpleNamespace(model=model, prompts=prompts, eager=eager, want=want, plain=plain, reader=reader,
                           plain_graphs=plain_graphs,
                           reader_graphs=counters["stats"]["unique_graphs"] - before - plain_graphs)


@pytest.fixture(scope="module")
def compiled_tiny(tiny_llms) -> TargetModel:
    """The compiled tiny Llama target keeping the first layer's and the final norm's states
    (``tiny_llms.reader``'s)."""
    return tiny_llms.reader.target


@pytest.mark.slow
def test_the_compiled_forward_gives_the_eager_logits_and_hidden_states(tiny_models, compiled_tiny):
    for (eager, eager_states), (compiled, compiled_states) in zip(_forwards(_tiny_target(tiny_models)),
                                                                  _forwards(compiled_tiny)):
        assert compiled.shape == eager.shape
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
        assert sorted(compiled_states) == [-1, 0]
        for layer, state in eager_states.items():
            torch.testing.assert_close(compiled_states[layer], state, atol=1e-4, rtol=1e-4)


def test_steps_of_one_sequence_trace_their_attention_and_batches_call_the_operator(compiled_tiny):
    """The attention of a decode step and of a chain or tree of one sequence is part of
    the compiled graph (no call of the opaque operator); a step of several sequences calls
    the operator once per layer."""
    from torch.profiler import ProfilerActivity, profile

    target = compiled_tiny
    tree = torch.eye(4, dtype=torch.bool)
    tree[:, 0] = True
    steps = {"decode": [(12, 1, None)], "chain": [(13, 5, None)], "tree": [(13, 4, tree)],
             "batch": [(12, 1, None), (7, 2, None)]}
    calls = {}
    for name, seqs in steps.items():
        cache = PagedKVCache(target.layer_shapes, 4 * len(seqs), 16, target.dtype, target.device)
        slices = [SequenceSlice(block_table=[2 * i, 2 * i + 1], start=start, tree_mask=mask,
                                positions=torch.arange(start, start + count))
                  for i, (start, count, mask) in enumerate(seqs)]
        layout = AttentionLayout(slices, 16, target.device)
        args = (torch.arange(layout.num_tokens), layout.query_positions,
                ForwardMetadata(cache=cache, layout=layout, hidden_layers=frozenset({0, -1})),
                torch.tensor([layout.num_tokens - 1]))
        target.forward(*args)  # compiles the step's graph where no test has
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            target.forward(*args)
        calls[name] = sum(e.count for e in prof.key_averages() if e.key == "specdec::paged_attention")
    assert calls == {"decode": 0, "chain": 0, "tree": 0, "batch": target.num_layers}


def test_targets_compiled_in_one_process_keep_their_own_graphs(tiny_models, tiny_llms):
    """Each target's graphs hold its own frozen weights: a model compiled beside another
    (Gemma 2, whose soft-capping and sliding window go through the attention operator)
    and that one answer as they do eagerly. An engine of one request at a time compiles no
    graph for a step of several sequences: two graphs."""
    prompts = [[5, 9, 11, 3, 7, 5, 9]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    gemma = str(tiny_models["gemma2"])
    eager = {"llama": tiny_llms.eager.generate(prompts, params)[0].token_ids,
             "gemma2": LLM(model=gemma, dtype="float32").generate(prompts, params)[0].token_ids}
    before = counters["stats"]["unique_graphs"]
    compiled = {"gemma2": LLM(model=gemma, dtype="float32", engine={"compile": True, "max_batch_size": 1}),
                "llama": tiny_llms.plain}
    assert counters["stats"]["unique_graphs"] - before == 2
    assert eager["llama"] != eager["gemma2"]
    for arch, llm in compiled.items():
        assert llm.generate(prompts, params)[0].token_ids == eager[arch]
    assert counters["stats"]["unique_graphs"] - before == 2


def test_llms_asking_for_one_target_share_it_and_compile_a_graph_per_set_of_states(tiny_llms):
    """Three graphs compile when an engine starts (one token of one sequence, several, a
    step of several sequences) and none while it serves, alone or batched. A second LLM
    asking for the same weights, numerics and compilation gets the first one's target, its
    graphs compiled: no load, no new graph (a setting given by value matches an ``auto``
    that resolved to it). One whose drafter reads the final norm's state alone shares the
    plain graphs too (they keep that state), as prompt lookup does, its drafts lossless;
    one that reads another layer's gets graphs of its own. Used in turn, each answers as
    the eager target does."""
    t = tiny_llms
    assert t.plain.target is not t.eager.target and t.plain_graphs == 3
    assert t.reader.target is t.plain.target and t.reader_graphs == 3
    assert set(t.plain.target._compiled) == {frozenset({-1}), frozenset({0, -1})}
    before = counters["stats"]["unique_graphs"]
    assert [t.plain.generate([p], PARAMS)[0].token_ids for p in t.prompts] == t.want  # a decode at batch 1
    again = LLM(model=t.model, dtype="float32", engine={"compile": True, "max_batch_size": 2})
    last = LLM(model=t.model, dtype="float32", engine={"compile": True},
               speculative_config={"decoding_type": "user", "drafter": LastStateWatcher})
    assert again.target is last.target is t.plain.target
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, t.model, engine={"compile": True})
    LastStateWatcher.seen.clear()
    StateWatcher.seen.clear()
    for llm in (t.plain, t.reader, last, again, t.reader, t.plain):
        assert [o.token_ids for o in llm.generate(t.prompts, PARAMS)] == t.want
    assert counters["stats"]["unique_graphs"] == before
    assert StateWatcher.seen and all(sorted(r.hidden_states) == [-1, 0] for r in StateWatcher.seen)
    assert LastStateWatcher.seen and all(list(r.hidden_states) == [-1] for r in LastStateWatcher.seen)
    # asked by value, the numerics ``auto`` resolved to for it (stock at float32)
    assert LLM(model=t.model, dtype="float32", engine={"compile": True, "batch_invariant": False}).target \
        is t.plain.target


def test_the_last_target_stays_after_its_llms_are_gone_until_released(tiny_models):
    import gc
    import weakref

    model = str(tiny_models["llama"])
    llm = LLM(model=model, dtype="float32", engine={"max_model_len": 64})
    assert LLM(model=model, dtype="float32", engine={"max_model_len": 64}).target is llm.target
    target = weakref.ref(llm.target)
    del llm
    gc.collect()
    assert target() is not None
    release_kept_targets()
    gc.collect()
    assert target() is None


@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_drafts_on_a_compiled_quantized_target_are_lossless(tiny_models, quantization):
    testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["llama"],
                                  engine={"compile": True, "quantization": quantization}, device="cpu")


def test_compile_with_batch_invariant_is_refused_where_the_graph_would_not_be_invariant(tiny_models):
    with pytest.raises(ConfigError, match="batch_invariant: true cannot be combined with compile: true.*w4a8"):
        LLM(model=str(tiny_models["llama"]), dtype="bfloat16", engine={"compile": True, "batch_invariant": True})


def _step(target: TargetModel, cache: PagedKVCache, seqs: list[tuple[list[int], int, torch.Tensor]]) -> torch.Tensor:
    """One forward of ``seqs`` (block table, committed tokens, new token ids): every new token's logits."""
    slices = [SequenceSlice(block_table=table, start=start, positions=torch.arange(start, start + len(ids)))
              for table, start, ids in seqs]
    layout = AttentionLayout(slices, 16, target.device)
    logits, _ = target.forward(torch.cat([ids for *_, ids in seqs]), layout.query_positions,
                               ForwardMetadata(cache=cache, layout=layout), torch.arange(layout.num_tokens))
    return logits


@pytest.mark.skipif(not int8_dot.kernel_available(), reason="the integer-dot kernels are not built here")
def test_an_integer_dot_target_compiles_one_graph_whose_tokens_ignore_their_neighbours(tiny_models):
    """``compile: auto`` on a bfloat16 target on the integer-dot kernels: one graph serves
    every step (a token alone runs twice through it), and a token's logits are the same bits
    decoded alone, in a chunk of its sequence and beside another sequence's tokens; served
    alone or batched, with drafts or without, the answers are the same."""
    release_kept_targets()
    before = counters["stats"]["unique_graphs"]
    llm = LLM(model=str(tiny_models["llama"]), dtype="bfloat16", device="cpu", engine={"quantization": "w4a8"})
    assert llm.engine.compiled and llm.engine.batch_invariant
    target = llm.target
    cache = llm.engine.kv.cache  # its blocks, no request holding any yet
    ids = (torch.arange(3, 15) * 7) % 100
    chunk = _step(target, cache, [([0], 0, ids)])
    alone = torch.cat([_step(target, cache, [([1], i, ids[i:i + 1])]) for i in range(len(ids))])
    beside = torch.cat([_step(target, cache, [([2], i, ids[i:i + 1]), ([3, 4, 5], 3 * i, ids[:3] + i)])[:1]
                        for i in range(len(ids))])
    assert torch.equal(chunk, alone) and torch.equal(chunk, beside)
    prompts = [[5, 9, 11, 3, 7, 5, 9, 11, 3, 7], [2, 4, 6, 8, 2, 4, 6, 8, 2], [1, 2, 3]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    assert counters["stats"]["unique_graphs"] - before == 1
    spec = testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["llama"],
                                         prompts=prompts, max_tokens=12, dtype="bfloat16", device="cpu",
                                         engine={"quantization": "w4a8"})
    assert alone == batched == [o.token_ids for o in spec]


def test_pools_of_one_size_bring_one_size_symbol_into_a_compiled_graph():
    """Each KV pool is marked dynamic on its own; traced as the target's graph traces them,
    the pools of one size share one size symbol, so the compiled graph takes one integer for
    them (each integer is converted to a tensor at every call), and a pool of another size
    (a sliding-window layer's) keeps its own."""
    from collections import namedtuple

    from specdec.model.target import _one_size_symbol_per_pool_size, _pools_dynamic

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def symbols(check_sizes: bool) -> int:
        pools = namedtuple("Pools", "keys values")([torch.zeros(n, 2, 4) for n in (40, 24, 40, 40)],
                                                   [torch.zeros(n, 2, 4) for n in (40, 24, 40, 40)])
        _pools_dynamic(pools.keys, pools.values)

        def read(step):
            if check_sizes:
                _one_size_symbol_per_pool_size(step)
            return sum(pool.reshape(-1)[: pool.shape[0]].sum() for pool in (*step.keys, *step.values))

        read.__code__ = read.__code__.replace()  # graphs of its own
        torch.compile(read, backend=backend, fullgraph=True)(pools)
        return len({str(node.meta["example_value"]) for node in graphs[-1].graph.nodes
                    if node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.SymInt)})

    assert symbols(check_sizes=False) == 8
    assert symbols(check_sizes=True) == 2
