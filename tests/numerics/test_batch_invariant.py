"""The batch-invariant numerics mode (engine.batch_invariant): a token's result depends on
its own sequence only, so greedy output is bit-identical between plain and speculative
decoding, alone and batched, in bfloat16 too."""

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import random_layout
from specdec_test_support.served import running_server, stream_chat

from specdec import LLM, SamplingParams, kernels, testing
from specdec.config import EngineConfig
from specdec.kernels import cpu, invariant_attention_is_kernel
from specdec.kernels.attention import paged_attention_torch
from specdec.kernels.cpu import invariant_attention_cpu, kernel_available
from specdec.kernels.invariant_attention import invariant_attention_torch
from specdec.kernels.prepacked import can_prepack
from specdec.kernels.triton_kernels import invariant_attention_triton
from specdec.kvcache.layout import AttentionLayout, SequenceSlice, slot_ids
from specdec.numerics import invariant
from specdec.numerics.auto import resolve_batch_invariant
from specdec.numerics.invariant import (
    LinearPlan,
    make_linear_invariant,
    mode_costs_nothing,
    plan_weight,
    planned_linear,
)

#: the implementations of the mode's attention (CUDA uses the Triton one, which CPU tests run
#: under the Triton interpreter; the CPU the C++ kernel, or the torch version without a compiler)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATTENTION = {"torch": invariant_attention_torch, "triton": invariant_attention_triton,
             **({"cpu": invariant_attention_cpu} if DEVICE == "cpu" else {})}
#: the implementation the mode uses here, and on CPU the other one too: the torch version's
#: invariance holds on CPU only (on an H100 a packed token's result differed from its own
#: decoding alone), which is why CUDA has the kernel
INVARIANT = ["triton"] if DEVICE == "cuda" else sorted(ATTENTION)

CASES = [  # heads, kv_heads, dim, block size, (committed, new, tree?) per sequence, window, softcap
    (9, 3, 64, 16, [(60, 9, False), (0, 70, False), (130, 1, False), (61, 6, True)], None, None),
    (4, 2, 16, 4, [(5, 3, False), (33, 5, True), (64, 1, False)], None, None),
    (4, 1, 32, 4, [(70, 4, True), (12, 1, False), (0, 20, False)], 8, None),
    (4, 2, 16, 4, [(11, 3, False), (60, 7, True)], None, 30.0),
    # trees past a context block of their own: the torch attention shares those blocks across a tree's nodes
    (9, 3, 64, 16, [(150, 8, True), (140, 1, False), (70, 5, True)], None, None),
    # trees of one batch with 0, 1 and 2 context-only blocks and different node counts
    (9, 3, 64, 16, [(10, 3, True), (150, 8, True), (200, 1, False), (70, 5, True), (130, 16, True)], None, None),
    (4, 1, 32, 4, [(140, 6, True), (3, 2, True), (64, 4, True), (30, 2, False)], 40, None),
    # more than 16 blocks of keys, where the order of the blocks' sums matters
    (9, 3, 64, 16, [(1100, 4, True), (126, 6, True), (5, 2, False)], None, None),
]
#: cache blocks of a case's pool
NUM_BLOCKS = 96
#: the cases of the torch attention's shared tree blocks (4 and 5), which the Triton kernel
#: does not have: under the interpreter (seconds a launch) they prove nothing more of it
TORCH_TREE_CASES = {4, 5}


def cases_for(impl: str) -> list[int]:
    """The cases ``impl`` is checked on here."""
    interpreted = impl == "triton" and DEVICE == "cpu"
    return [case for case in range(len(CASES)) if not (interpreted and case in TORCH_TREE_CASES)]


def case_inputs(case: int, dtype: torch.dtype):
    heads, kv_heads, dim, bs, shapes, window, softcap = CASES[case]
    gen = torch.Generator().manual_seed(case)
    layout = random_layout(gen, bs, NUM_BLOCKS, shapes, device=DEVICE)
    keys = torch.randn(NUM_BLOCKS * bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    values = torch.randn(NUM_BLOCKS * bs, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    # [tokens, heads, dim] transposed, as the model's attention hands it over (not contiguous)
    query = torch.randn(layout.num_tokens, heads, dim, generator=gen).to(DEVICE, dtype).transpose(0, 1)
    return layout, keys, values, query, dim ** -0.5, window, softcap


@pytest.mark.parametrize(("case", "impl"), [(case, impl) for impl in sorted(ATTENTION) for case in cases_for(impl)])
def test_invariant_attention_matches_the_reference(case, impl):
    layout, keys, values, query, scale, window, softcap = case_inputs(case, torch.float32)
    got = ATTENTION[impl](query, keys, values, layout, scale, window, softcap)
    want = paged_attention_torch(query, keys, values, layout, scale, window, softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def visible_slots(layout: AttentionLayout, token: int) -> tuple[list[int], int]:
    """The cache slots a packed token sees, in position order, and its position."""
    first = 0
    for s in layout.seqs:
        n = len(s.positions)
        if token < first + n:
            i = token - first
            new = slot_ids(s.block_table, layout.block_size, s.start, n)
            mask = layout._tree(s)[i]
            context = slot_ids(s.block_table, layout.block_size, 0, s.start)
            return context + [new[j] for j in range(n) if mask[j]], int(s.positions[i])
        first += n
    raise IndexError(token)


def checked_tokens(layout: AttentionLayout, sample: bool) -> list[int]:
    """Every token of the step, or (``sample``) each sequence's first and last token and two
    others drawn with a fixed seed."""
    if not sample:
        return list(range(layout.num_tokens))
    gen, tokens, first = torch.Generator().manual_seed(0), [], 0
    for s in layout.seqs:
        n = len(s.positions)
        inner = (torch.randperm(n - 2, generator=gen)[:2] + 1).tolist() if n > 2 else []
        tokens += sorted({first, first + n - 1, *(first + i for i in inner)})
        first += n
    return tokens


#: (impl, dtype) pairs checked for invariance: under the Triton interpreter (the CUDA kernel
#: on a CPU) float32 only, since the interpreter emulates bfloat16 and proves nothing of the
#: device's rounding, which the CUDA run of this test checks in both dtypes
INVARIANT_DTYPES = [(impl, dtype) for impl in INVARIANT for dtype in (torch.bfloat16, torch.float32)
                    if not (impl == "triton" and DEVICE == "cpu" and dtype == torch.bfloat16)]


@pytest.mark.parametrize(("case", "impl", "dtype"),
                         [(case, impl, dtype) for impl, dtype in INVARIANT_DTYPES for case in cases_for(impl)])
def test_a_token_attends_as_if_it_were_decoded_alone(case, dtype, impl):
    """Each token of a packed step (prompt chunks, chains, tree nodes, several sequences)
    gets bit for bit what plain decoding of that token alone gets: its keys copied into a
    fresh cache in position order, one query, one sequence. Under the Triton interpreter
    (the CUDA kernel on a CPU, a launch costing a second or so) each sequence's first, last
    and two other tokens are checked; on its device and for the other kernels every token."""
    layout, keys, values, query, scale, window, softcap = case_inputs(case, dtype)
    attend = ATTENTION[impl]
    packed = attend(query, keys, values, layout, scale, window, softcap)
    bs = layout.block_size
    for token in checked_tokens(layout, sample=impl == "triton" and DEVICE == "cpu"):
        slots, position = visible_slots(layout, token)
        assert len(slots) == position + 1
        k_alone, v_alone = torch.zeros_like(keys), torch.zeros_like(values)
        k_alone[:len(slots)], v_alone[:len(slots)] = keys[slots], values[slots]
        alone = AttentionLayout([SequenceSlice(block_table=list(range(-(-len(slots) // bs))), start=position,
                                               positions=torch.tensor([position]))], bs, torch.device(DEVICE))
        got = attend(query[:, token:token + 1], k_alone, v_alone, alone, scale, window, softcap)
        assert torch.equal(got[0], packed[token]), f"token {token} (position {position}) differs"


@pytest.mark.skipif(DEVICE != "cpu" or shutil.which("c++") is None, reason="the C++ kernel is the CPU's")
def test_the_mode_runs_the_cpu_kernel_where_a_compiler_is_found(monkeypatch):
    """The kernel builds here and the mode's attention dispatches to it; a head dimension it
    cannot take (not whole 16-float vectors) goes to the torch version, still right."""
    assert kernel_available() and invariant_attention_is_kernel("cpu")
    layout, keys, values, query, scale, window, softcap = case_inputs(0, torch.bfloat16)
    calls = []
    monkeypatch.setattr(kernels, "invariant_attention_cpu", lambda *a: calls.append(a) or invariant_attention_cpu(*a))
    assert torch.equal(kernels.invariant_attention(query, keys, values, layout, scale),
                       invariant_attention_cpu(query, keys, values, layout, scale))
    assert len(calls) == 1
    narrow = [t[..., :8] for t in (query, keys, values)]
    got = kernels.invariant_attention(*narrow, layout, scale)
    assert len(calls) == 1
    torch.testing.assert_close(got, paged_attention_torch(*narrow, layout, scale), atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(DEVICE != "cpu" or shutil.which("c++") is None, reason="the C++ kernel is the CPU's")
@pytest.mark.parametrize("window", [None, 40, 300])
def test_a_token_gets_its_answer_alone_however_its_row_is_shared_out(window):
    """A compiled decode step runs its token twice: both copies get, bit for bit, what the
    token gets alone, whether the copies are a tile of their own or sit among other tokens
    of the same key row (a prompt chunk's, whose row the kernel widens once). Rows longer
    than a chunk of keys are split across threads where the work items are few (4 threads)
    and not at all on one thread: the same bits either way."""
    assert kernel_available()
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1000, 2, 64, generator=gen).bfloat16() for _ in range(2))
    slots, key_pos = torch.randperm(1000, generator=gen)[:800], torch.arange(800)
    query = torch.randn(4, 3, 64, generator=gen).bfloat16()  # heads, three distinct tokens, dim
    counts = (800, 650, 120)

    def attend(tokens: list[int]) -> torch.Tensor:
        count, offset = torch.tensor([counts[t] for t in tokens]), torch.zeros(len(tokens), dtype=torch.long)
        return cpu.attend_key_rows(query[:, tokens], keys, values, slots, key_pos, offset, count, count - 1, 0.125,
                                   window, None)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [attend([t])[0] for t in range(3)]
        for n in (1, 4):
            torch.set_num_threads(n)
            for tokens in ([0], [0, 0], [2, 1, 1, 0, 0], [2, 1, 0] * 6 + [0]):
                for row, token in zip(attend(tokens), tokens):
                    assert torch.equal(row, alone[token]), f"{n} threads, token {token} of {tokens}"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (576, 576), (576, 4096)])
def test_invariant_linear_gives_a_row_the_same_result_in_any_batch(shape, dtype):
    """The embedded model's linear shapes (1536 -> 576 is its MLP down projection, which
    the stock bfloat16 kernel computes differently from 5 rows on, on this repository's CPU)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(*shape, bias=True).to(DEVICE, dtype)
    make_linear_invariant(layer)
    x = torch.randn(150, shape[0]).to(DEVICE, dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 13, 16, 33, 40, 65, 100, 150):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
    assert torch.equal(layer(x[None, :7])[0], alone[:7])  # [batch, tokens, features] inputs too
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", [True, False])
def test_the_draft_planner_prices_the_modes_attention_as_it_runs(tiny_models, monkeypatch, kernel):
    """Where a kernel runs the mode's attention (C++ on the CPU, Triton on CUDA) every query
    is priced over its own keys and trees cost no batch of their own; the torch version pads
    groups of rows and runs a step's trees as a batch of their own."""
    from specdec.executor import engine as engine_module

    monkeypatch.setattr(engine_module, "invariant_attention_is_kernel", lambda device: kernel)
    llm = LLM(str(tiny_models["llama"]), dtype="float32", engine={"batch_invariant": True},
              speculative_config={"decoding_type": "ngram"})
    assert (llm.engine.planner.padded_attention, llm.engine.planner.tree_batch) == (not kernel, not kernel)


@pytest.mark.skipif(DEVICE != "cpu" or not can_prepack(torch.zeros(576, 768, dtype=torch.bfloat16)),
                    reason="prepacked weight slices are a CPU bfloat16 path, where the packed product is exact")
@pytest.mark.parametrize("parts", [2, 3])
def test_a_plan_in_parts_multiplies_prepacked_slices_as_the_bmm_of_unpacked_ones(parts):
    """A plan that cuts the input (for shapes that padding rows does not make invariant)
    multiplies each slice by its own prepacked weight: the numbers of the batched ``bmm``
    over the unpacked slices, close to the stock product."""
    torch.manual_seed(0)
    weight = (torch.randn(576, 1536) * 1536 ** -0.5).to(torch.bfloat16)
    bias = torch.randn(576).to(torch.bfloat16)
    plan = LinearPlan(1, parts)
    slices = plan_weight(weight, plan)
    assert isinstance(slices, tuple) and all(w.is_mkldnn for w in slices)
    unpacked = weight.view(576, parts, -1).permute(1, 2, 0).contiguous()
    for rows in (1, 5, 16, 150):
        x = torch.randn(rows, 1536).to(torch.bfloat16)
        got = planned_linear(x, slices, bias, plan)
        assert torch.equal(got, planned_linear(x, unpacked, bias, plan)), f"{rows} rows"
        torch.testing.assert_close(got, x @ weight.t() + bias, atol=2e-2, rtol=2e-2)


# -- the embedded model, bfloat16 -----------------------------------------------------------

FRUITS = [f"Name {n} fruits." for n in range(2, 7)]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0)


@pytest.fixture(scope="module")
def bf16_ngram():
    return LLM(dtype="bfloat16", engine={"batch_invariant": True, "max_batch_size": 24},
               speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False})


def answer(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], GREEDY)]


def test_bfloat16_answers_alone_and_in_a_batch_of_24_are_identical(bf16_ngram):
    """The issue's reproduction: without the mode, 11 of these 24 answers differed from the
    same prompt run alone (float32: 0)."""
    alone = {p: answer(bf16_ngram, [p])[0] for p in FRUITS}
    batch = [FRUITS[i % len(FRUITS)] for i in range(24)]
    outs = bf16_ngram.chat([[{"role": "user", "content": p}] for p in batch], GREEDY)
    assert [o.token_ids for o in outs] == [alone[p] for p in batch]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


PROMPTS = ["Write a haiku about autumn rain.", "What is 17 times 23? Think step by step.",
           "Translate into French: The library opens at nine.", "Give three tips for sleeping better."]


@pytest.mark.parametrize("method", [{"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False},
                                    {"decoding_type": "eagle3", "adaptive": False},
                                    {"decoding_type": "draft_target", "adaptive": False},
                                    {"decoding_type": "medusa", "adaptive": False}],
                         ids=["ngram", "eagle3", "draft_target", "medusa trees"])
def test_bfloat16_speculative_greedy_equals_plain_greedy(method):
    """Four requests at once: chains, and Medusa's trees, whose attention runs for all
    trees of a step in one batch."""
    plain = LLM(dtype="bfloat16", engine={"batch_invariant": True})
    spec = LLM(dtype="bfloat16", engine={"batch_invariant": True}, speculative_config=method)
    want = answer(plain, PROMPTS)
    outs = spec.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, "nothing was accepted: the check proves nothing"


@pytest.mark.slow
def test_bfloat16_answers_through_the_server_under_32_streams_equal_answers_alone(tmp_path, bf16_ngram):
    """The server's batches change with the streams' timing; every answer is the one the
    offline engine gives in a fixed batch of all 32, which is each prompt's answer alone
    (:func:`test_bfloat16_answers_alone_and_in_a_batch_of_24_are_identical`)."""
    from openai import OpenAI

    config = ("dtype: bfloat16\nspeculative_config: {decoding_type: ngram, max_draft_len: 4}\n"
              "engine: {max_batch_size: 32, batch_invariant: true}\nsampling: {temperature: 0, max_tokens: 24}\n")
    prompts = [f"Describe a {c} {t} in one sentence." for c in ("red", "green", "blue", "amber")
               for t in ("boat", "kite", "lamp", "chair", "tower", "garden", "river", "clock")]
    with running_server(config, tmp_path) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused")
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: stream_chat(client, p), prompts))
    offline = bf16_ngram.chat([[{"role": "user", "content": p}] for p in prompts],
                              SamplingParams(max_tokens=24, temperature=0.0))
    for prompt, text, want in zip(prompts, texts, offline):
        assert text == want.text, prompt


# -- engine.batch_invariant: auto -----------------------------------------------------------

needs_cpu_kernels = pytest.mark.skipif(
    DEVICE != "cpu" or not (kernel_available() and cpu.linear_kernel_available()),
    reason="auto turns the mode on where specdec's CPU kernels take every layer; they are not built here")
#: the tiny architectures whose every product is a linear layer (deepseek_v3's experts are not)
DENSE = sorted(a for a in testing.TINY_ARCHITECTURES if a != "deepseek_v3")


#: whether this CPU has bfloat16 instructions (oneDNN's products serve the mode there)
NATIVE_BF16 = DEVICE == "cpu" and cpu.native_bfloat16()


@needs_cpu_kernels
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE_BF16, reason="this CPU has no bfloat16 instructions"))], ids=["linear_kernel", "onednn"])
@pytest.mark.parametrize("arch", DENSE)
def test_auto_runs_the_mode_where_it_costs_nothing(tiny_models, monkeypatch, arch, native):
    """A bfloat16 target of each dense architecture gets the mode by default on a CPU without
    bfloat16 instructions (the linear kernel; forced here, so that AVX-512 machines check it
    too) and on one with them (oneDNN's products, rows padded), and its greedy output is then
    the same alone, batched, and batched with drafts the target accepts (windows, softcaps
    and q/k norms included)."""
    monkeypatch.setattr(cpu, "native_bfloat16", lambda: native)
    model = str(tiny_models[arch])
    plain = LLM(model, dtype="bfloat16")
    spec = LLM(model, dtype="bfloat16",  # the target itself as the draft: its drafts are mostly right
               speculative_config={"decoding_type": "draft_target", "speculative_model": model,
                                   "max_draft_len": 4, "adaptive": False})
    assert plain.engine.batch_invariant and spec.engine.batch_invariant
    prompts = [[(5 * i + 3 * j) % 120 + 4 for j in range(6 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = [plain.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in plain.generate(prompts, params)] == alone
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, "nothing was accepted: the check proves nothing"


@needs_cpu_kernels
def test_auto_keeps_stock_numerics_where_the_mode_was_not_measured(tiny_models, smol, monkeypatch):
    """``auto`` is on only for what was measured to cost nothing (a bfloat16 CPU target, not
    compiled, unquantized or on the integer-dot kernels, whose attention the C++ kernel takes
    and whose every product runs on the linear kernel or on a plan that only pads rows);
    ``true`` and ``false`` decide it everywhere."""
    monkeypatch.setattr(cpu, "native_bfloat16", lambda: False)
    target = LLM(dtype="bfloat16").target
    assert resolve_batch_invariant(EngineConfig(), target, False) is True
    assert resolve_batch_invariant(EngineConfig(batch_invariant=False), target, False) is False
    assert resolve_batch_invariant(EngineConfig(compile=True), target, True) is False
    int4 = LLM(dtype="bfloat16", engine={"quantization": "int4"}).target  # torch's packed kernels: not measured
    assert resolve_batch_invariant(EngineConfig(quantization="int4"), int4, False) is False
    w4a8 = LLM(dtype="bfloat16", engine={"quantization": "w4a8", "compile": False}).target  # measured 0.94-0.98x
    assert resolve_batch_invariant(EngineConfig(quantization="w4a8"), w4a8, False) is True
    assert resolve_batch_invariant(EngineConfig(quantization="w4a8"), w4a8, True) is True  # one invariant graph
    assert resolve_batch_invariant(EngineConfig(), smol.target, False) is False  # float32
    assert resolve_batch_invariant(EngineConfig(batch_invariant=True), smol.target, False) is True
    # head dimensions the attention kernel does not take; an MoE's fused expert tensors
    assert not mode_costs_nothing(target.model, [(3, 8, 8)] * len(target.layer_shapes))
    assert LLM(str(tiny_models["deepseek_v3"]), dtype="bfloat16").engine.batch_invariant is False
    monkeypatch.setattr(cpu, "kernel_available", lambda: False)  # no compiler: the torch version's cost
    assert resolve_batch_invariant(EngineConfig(), target) is False
    monkeypatch.undo()
    if NATIVE_BF16:  # this CPU's own plans for the embedded model: on where none cuts or caps
        plans = {invariant.linear_plan(m.weight, m.bias) for m in target.model.modules()
                 if isinstance(m, torch.nn.Linear)}
        assert resolve_batch_invariant(EngineConfig(), target) is all(p.parts == 1 and not p.chunk for p in plans)
    # with bfloat16 instructions: on where every product's plan at most pads rows (the
    # embedded model's on an AVX-512 Xeon), off where one cuts its input dimension in parts
    # (a product per part: the MLP's down projection here) or where no invariant plan exists
    monkeypatch.setattr(cpu, "native_bfloat16", lambda: True)
    monkeypatch.setattr(invariant, "linear_plan", lambda w, bias=None: LinearPlan(4, 1))
    assert resolve_batch_invariant(EngineConfig(), target) is True
    monkeypatch.setattr(invariant, "linear_plan",
                        lambda w, bias=None: LinearPlan(4, 2) if tuple(w.shape) == (576, 1536) else LinearPlan(4, 1))
    assert resolve_batch_invariant(EngineConfig(), target) is False
    head = target.model.get_output_embeddings().weight  # tied to the input embedding: still a product
    assert head is target.model.get_input_embeddings().weight
    monkeypatch.setattr(invariant, "linear_plan",
                        lambda w, bias=None: LinearPlan(4, 2) if w is head else LinearPlan(4, 1))
    assert resolve_batch_invariant(EngineConfig(), target) is False

    def no_plan(weight, bias=None):
        raise RuntimeError("no batch-invariant way")
    monkeypatch.setattr(invariant, "linear_plan", no_plan)
    assert resolve_batch_invariant(EngineConfig(), target) is False
