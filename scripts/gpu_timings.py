"""GPU timings on a random-weight model of a real size (timing does not depend on the
weights, acceptance does: see ``eagle3`` below).

    python scripts/gpu_timings.py [--shape llama-8b] [--parts generate,steps,attention,eagle3] [--json FILE]

Parts, each printed as a table:

* ``generate``: Hugging Face ``generate()`` (greedy, sdpa, its dynamic cache) against
  specdec's plain decoding through ``LLM.generate``, the same model object and the same
  prompts, interleaved, at batch 1, 8 and 32: tokens per second over prefill and decode.
  With ``--cuda-graphs`` a second specdec engine replays CUDA graphs
  (``engine.cuda_graphs``) in the same interleaved run.
* ``steps``: one target forward of specdec's engine over its paged KV cache: a
  decode step (1 new token per request) and a 16-token tree verification (a 16-node tree
  per request), at batch 1, 8 and 32, after ``--context`` cached tokens; wall time per
  step, the GPU's busy time in it (the profiler's kernel time: what CUDA graphs could not
  remove) split into matmul, attention and other kernels with the heaviest kernels
  listed, and the weight-streaming floor at ``--bandwidth``; with ``--cuda-graphs`` the
  same steps replayed through :class:`specdec.executor.cuda_graphs.CudaGraphs` too.
* ``attention``: the paged attention alone, Triton kernel against the torch path, for
  decode (1 query per sequence) and a 16-node tree: per call (``do_bench``: host launch
  included) and on the device (20 calls in a CUDA graph, replayed), against the floor of
  reading every cached key and value once at ``--bandwidth``; ``--min-splits 64,128,256``
  repeats it for each shortest key split the kernel's plan may cut.
* ``eagle3``: plain against EAGLE-3 (a random head in the published layout, chain of
  ``max_draft_len`` 3, drafting every step) at batch 1 and 8; random heads accept
  nothing, so the figure is each step's cost: the speedup at a mean acceptance length
  ``tau`` is ``tau * plain_step / eagle3_step``. With ``--cuda-graphs`` both engines
  replay graphs of the target forward (the drafts run eagerly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # the shapes of published models; weights drawn at random
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=8192),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
}
DRAFT_PARENTS = [-1, -1, -1, 0, 0, 1, 1, 2, 3, 3, 4, 5, 7, 8, 10]  # 15 draft nodes under the root: 16 tokens


DEVICE = torch.device("cuda")  # --device cpu: a dry run of the script (with --shape tiny)
KV_CACHE_MB = 12288


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def random_model(shape: str, directory: Path, dtype: torch.dtype):
    """A Llama of ``shape`` with random weights on the GPU, and a directory holding its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with DEVICE:
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(previous)
    for p in model.parameters():  # keep activations in range: N(0, 0.02) everywhere, norms 1
        if p.dim() > 1:
            p.data.normal_(0, 0.02)
    config.save_pretrained(directory)
    return model


def build_llm(model, directory: Path, speculative_config=None, **engine):
    """specdec's LLM over the model object already on the GPU (its loader patched to hand it over)."""
    import specdec.api as api

    original = api.load_causal_lm
    api.load_causal_lm = lambda path, dtype, device: model
    try:
        return api.LLM(str(directory), dtype="bfloat16", device=DEVICE.type, speculative_config=speculative_config,
                       engine={"kv_cache_memory_mb": KV_CACHE_MB, "max_num_tokens": 8192, **engine})
    finally:
        api.load_causal_lm = original


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


# -- generate ---------------------------------------------------------------------------


def hf_generate(model, ids: list[list[int]], new: int) -> float:
    from specdec.model.target import ATTENTION_NAME

    model.set_attn_implementation("sdpa")
    try:
        x = torch.tensor(ids, device=DEVICE)
        sync()
        started = time.perf_counter()
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync()
        elapsed = time.perf_counter() - started
        assert out.shape[1] == x.shape[1] + new
        return len(ids) * new / elapsed
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def specdec_generate(llm, ids: list[list[int]], new: int) -> float:
    from specdec import SamplingParams

    sync()
    started = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    sync()
    elapsed = time.perf_counter() - started
    assert all(len(o.token_ids) == new for o in outs)
    return len(ids) * new / elapsed


def part_generate(model, directory, args) -> list[dict]:
    engines = {"specdec": build_llm(model, directory, max_batch_size=max(args.batches))}
    if args.cuda_graphs:
        engines["graphs"] = build_llm(model, directory, max_batch_size=max(args.batches), cuda_graphs=True)
    rows = []
    for batch in args.batches:
        ids = prompts(batch, args.prompt_len, model.config.vocab_size, batch)
        hf_generate(model, ids, 8)  # warm-up: kernels compiled, graphs captured, allocator primed
        for llm in engines.values():
            specdec_generate(llm, ids, 8)
        rates: dict[str, list[float]] = {"hf": [], **{name: [] for name in engines}}
        for _ in range(args.repeats):
            rates["hf"].append(hf_generate(model, ids, args.new_tokens))
            for name, llm in engines.items():
                rates[name].append(specdec_generate(llm, ids, args.new_tokens))
        row = {"batch": batch, "hf_tok_s": statistics.median(rates["hf"])}
        for name in engines:
            row[f"{name}_tok_s"] = statistics.median(rates[name])
            row[f"{name}_ratio"] = statistics.median(s / h for s, h in zip(rates[name], rates["hf"]))
        rows.append(row)
        print(f"generate batch {batch}: HF {row['hf_tok_s']:.1f} tok/s, " + ", ".join(
            f"{name} {row[f'{name}_tok_s']:.1f} tok/s (ratio {row[f'{name}_ratio']:.2f})" for name in engines),
            flush=True)
    del engines
    return rows


# -- one forward ------------------------------------------------------------------------


def step_runner(target, batch: int, context: int, tree: bool, block_size: int = 16, graphs: bool = False):
    """One forward of ``batch`` requests, each with ``context`` cached tokens and 1 new token
    (decode) or a 16-node tree (verification); through CUDA graphs if ``graphs``."""
    from specdec.drafting.interface import node_depths
    from specdec.drafting.tree import ancestor_mask
    from specdec.executor.cuda_graphs import CudaGraphs
    from specdec.kvcache import PagedKVCache
    from specdec.kvcache.layout import AttentionLayout, SequenceSlice
    from specdec.model.target import ForwardMetadata

    per_seq = context // block_size + 2
    cache = PagedKVCache(target.layer_shapes, per_seq * batch, block_size, target.dtype, target.device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    g = torch.Generator().manual_seed(0)
    new = len(DRAFT_PARENTS) + 1 if tree else 1
    mask = ancestor_mask(DRAFT_PARENTS) if tree else None
    offsets = torch.tensor([0] + node_depths(DRAFT_PARENTS)) if tree else torch.zeros(1, dtype=torch.long)
    # prefill every sequence's context
    for b in range(batch):
        ids = torch.randint(0, target.vocab_size, (context,), generator=g, device="cpu").to(target.device)
        layout = AttentionLayout([SequenceSlice(block_table=tables[b], start=0, positions=torch.arange(context))],
                                 block_size, target.device)
        target.forward(ids, torch.arange(context, device=target.device), ForwardMetadata(cache=cache, layout=layout),
                       torch.tensor([context - 1], device=target.device))
    seqs = [SequenceSlice(block_table=tables[b], start=context, positions=context + offsets, tree_mask=mask)
            for b in range(batch)]
    ids = torch.randint(0, target.vocab_size, (batch * new,), generator=g).to(target.device)
    positions = torch.cat([s.positions for s in seqs]).to(target.device)
    rows = torch.arange(batch * new, device=target.device)  # verification reads every token's logits
    forward = (CudaGraphs(target, cache, block_size, context + 64, batch).forward if graphs else target.forward)

    def run():
        # the layout is rebuilt each step, as the engine does
        layout = AttentionLayout(seqs, block_size, target.device)
        forward(ids, positions, ForwardMetadata(cache=cache, layout=layout), rows)

    return run


def wall_ms(run, steps: int) -> float:
    run()
    sync()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def kernel_ms(fn) -> float:
    """Median time of ``fn`` (triton's do_bench on CUDA: device events, the L2 flushed between runs)."""
    if DEVICE.type != "cuda":
        return wall_ms(fn, 3)
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def graph_ms(fn, calls: int = 20) -> float:
    """Device time of one call of ``fn`` with the host out of the way: ``calls`` calls
    captured in a CUDA graph, the graph's replay timed with events (median of 10)."""
    if DEVICE.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compiled, cached layout tensors built
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as exc:  # a path that syncs with the host cannot be captured
        print(f"  (not capturable: {str(exc).splitlines()[0][:100]})")
        return float("nan")
    times = []
    for _ in range(10):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        sync()
        times.append(begin.elapsed_time(end) / calls)
    return statistics.median(times)


MATMUL_KERNELS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")
ATTENTION_KERNELS = ("attention", "attn", "paged", "combine")


def kernel_group(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ATTENTION_KERNELS):
        return "attention"
    return "matmul" if any(k in lowered for k in MATMUL_KERNELS) else "other"


def gpu_busy_ms(run) -> tuple[float, dict]:
    """The GPU kernels' own time in one step (what remains if launch gaps vanished), and
    that time by kernel: ``{"groups": {matmul, attention, other: ms}, "top": [[name, ms,
    calls], ...]}``, the profile that says what a verification adds to a decode."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE.type != "cuda":
        return float("nan"), {}
    run()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    kernels = [(e.key, e.self_device_time_total / 1000, e.count) for e in prof.key_averages()
               if e.self_device_time_total > 0]
    groups: dict[str, float] = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, ms, _ in kernels:
        groups[kernel_group(name)] += ms
    top = sorted(kernels, key=lambda k: -k[1])[:12]
    return sum(ms for _, ms, _ in kernels), {"groups": groups, "top": [[n[:90], ms, c] for n, ms, c in top]}


def part_steps(model, directory, args) -> list[dict]:
    llm = build_llm(model, directory, max_batch_size=max(args.batches))
    target = llm.target
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    floor = weights / (args.bandwidth * 1e9) * 1000
    print(f"weights streamed per forward {weights / 2**30:.2f} GiB: {floor:.2f} ms at {args.bandwidth:g} GB/s",
          flush=True)
    rows = []
    for batch in args.batches:
        row = {"batch": batch, "context": args.context, "floor_ms": floor}
        for label, tree in (("decode", False), ("verify16", True)):
            run = step_runner(target, batch, args.context, tree)
            row[f"{label}_ms"] = wall_ms(run, args.steps)
            row[f"{label}_gpu_ms"], row[f"{label}_kernels"] = gpu_busy_ms(run)
            if row[f"{label}_kernels"]:
                groups = row[f"{label}_kernels"]["groups"]
                print(f"steps batch {batch} {label} GPU busy by kernel: " + ", ".join(
                    f"{g} {ms:.2f} ms" for g, ms in groups.items()), flush=True)
                for name, ms, calls in row[f"{label}_kernels"]["top"][:6]:
                    print(f"#   {ms:7.3f} ms {calls:5d}x {name}", flush=True)
            del run
            if args.cuda_graphs:
                run = step_runner(target, batch, args.context, tree, graphs=True)
                row[f"{label}_graph_ms"] = wall_ms(run, args.steps)
                del run
            torch.cuda.empty_cache()
        row["verify_over_decode"] = row["verify16_ms"] / row["decode_ms"]
        graphed = ""
        if args.cuda_graphs:
            row["graph_verify_over_decode"] = row["verify16_graph_ms"] / row["decode_graph_ms"]
            graphed = (f"; CUDA graphs: decode {row['decode_graph_ms']:.2f} ms, verify16 {row['verify16_graph_ms']:.2f}"
                       f" ms, verify/decode {row['graph_verify_over_decode']:.2f}")
        rows.append(row)
        print(f"steps batch {batch}: decode {row['decode_ms']:.2f} ms (GPU busy {row['decode_gpu_ms']:.2f}), "
              f"verify16 {row['verify16_ms']:.2f} ms (GPU busy {row['verify16_gpu_ms']:.2f}), "
              f"verify/decode {row['verify_over_decode']:.2f}, floor {floor:.2f} ms{graphed}", flush=True)
    del llm
    return rows


# -- attention alone --------------------------------------------------------------------


def attention_case(heads: int, kv_heads: int, dim: int, context: int, batch: int, tree: bool, bandwidth: float,
                   block_size: int = 16) -> dict:
    """Time the paged attention of ``batch`` sequences of ``context`` cached tokens, each
    with one new token (decode) or a 16-node tree, both paths, against the floor."""
    from specdec.drafting.interface import node_depths
    from specdec.drafting.tree import ancestor_mask
    from specdec.kernels.attention import paged_attention_torch
    from specdec.kernels.triton_kernels import paged_attention_triton
    from specdec.kvcache.layout import AttentionLayout, SequenceSlice

    new = len(DRAFT_PARENTS) + 1 if tree else 1
    per_seq = (context + new) // block_size + 1
    slots = per_seq * batch * block_size
    keys = torch.randn(slots, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    values = torch.randn(slots, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    perm = torch.randperm(per_seq * batch).tolist()  # blocks scattered over the pool
    mask = ancestor_mask(DRAFT_PARENTS) if tree else None
    offsets = torch.tensor([0] + node_depths(DRAFT_PARENTS)) if tree else torch.zeros(1, dtype=torch.long)
    seqs = [SequenceSlice(block_table=perm[b * per_seq:(b + 1) * per_seq], start=context,
                          positions=context + offsets, tree_mask=mask) for b in range(batch)]
    layout = AttentionLayout(seqs, block_size, DEVICE)
    query = torch.randn(heads, batch * new, dim, device=DEVICE, dtype=torch.bfloat16)
    scale = dim ** -0.5
    ref = paged_attention_torch(query, keys, values, layout, scale).float()
    got = paged_attention_triton(query, keys, values, layout, scale).float()
    triton_call = lambda: paged_attention_triton(query, keys, values, layout, scale)  # noqa: E731
    torch_call = lambda: paged_attention_torch(query, keys, values, layout, scale)  # noqa: E731
    moved = batch * (context + new) * kv_heads * dim * 2 * 2 + 2 * query.numel() * 2
    g_triton = graph_ms(triton_call)
    floor = moved / (bandwidth * 1e9) * 1000
    return {"context": context, "batch": batch, "kind": "tree16" if tree else "decode",
            "triton_ms": kernel_ms(triton_call), "torch_ms": kernel_ms(torch_call), "triton_graph_ms": g_triton,
            "torch_graph_ms": graph_ms(torch_call), "floor_ms": floor, "triton_of_floor": floor / g_triton,
            "rel_err": float((got - ref).norm() / ref.norm())}


def part_attention(model, args) -> list[dict]:
    """Every case once per ``--min-splits`` value: the shortest key split the kernel's plan
    cuts (``triton_kernels._MIN_SPLIT``), the knob that sets how many programs a step of few
    sequences gets."""
    from specdec.kernels import triton_kernels

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    rows = []
    shipped = triton_kernels._MIN_SPLIT
    for min_split in args.min_splits or [shipped]:
        triton_kernels._MIN_SPLIT = min_split
        for context in args.attention_contexts:
            for batch in args.batches:
                for tree in (False, True):
                    r = attention_case(heads, kv_heads, cfg.hidden_size // heads, context, batch, tree,
                                       args.bandwidth)
                    r["min_split"] = min_split
                    rows.append(r)
                    print(f"attention min split {min_split} {r['kind']} ctx {context} batch {batch}: call triton "
                          f"{r['triton_ms'] * 1000:.1f} us, "
                          f"torch {r['torch_ms'] * 1000:.1f} us; device triton {r['triton_graph_ms'] * 1000:.1f} us, "
                          f"torch {r['torch_graph_ms'] * 1000:.1f} us; floor {r['floor_ms'] * 1000:.1f} us (triton at "
                          f"{r['triton_of_floor']:.0%} of it), rel err {r['rel_err']:.1e}", flush=True)
    triton_kernels._MIN_SPLIT = shipped
    return rows


# -- EAGLE-3 step costs -----------------------------------------------------------------


def random_eagle3_head(model, directory: Path) -> Path:
    from specdec_eagle.checkpoint import default_capture_layers, head_config, save_head
    from specdec_eagle.modules import Eagle3Head

    cfg = model.config
    draft_vocab = min(32000, cfg.vocab_size // 2)  # the reference drafts over 32k of Llama-3's 128k
    head = Eagle3Head(head_config(cfg), cfg.hidden_size, 3, draft_vocab, cfg.vocab_size)
    for p in head.parameters():
        if p.dim() > 1:
            p.data.normal_(0, 0.02)
    head.set_draft_vocab(torch.arange(draft_vocab))
    out = directory / "eagle3"
    save_head(head, out, {}, default_capture_layers(cfg.num_hidden_layers))
    return out


def part_eagle3(model, directory, args) -> list[dict]:
    head = random_eagle3_head(model, directory)
    plain = build_llm(model, directory, max_batch_size=8, cuda_graphs=args.cuda_graphs)
    spec = build_llm(model, directory, {"decoding_type": "eagle3", "speculative_model": str(head),
                                        "max_draft_len": 3, "adaptive": False}, max_batch_size=8,
                     cuda_graphs=args.cuda_graphs)
    rows = []
    for batch in (1, 8):
        ids = prompts(batch, args.prompt_len, model.config.vocab_size, 100 + batch)
        specdec_generate(plain, ids, 8)
        specdec_generate(spec, ids, 8)
        p_rates, s_rates = [], []
        for _ in range(args.repeats):
            p_rates.append(specdec_generate(plain, ids, args.new_tokens))
            s_rates.append(specdec_generate(spec, ids, args.new_tokens))
        plain_step = batch / statistics.median(p_rates)  # seconds per token per request = per step
        spec_step = batch / statistics.median(s_rates)
        rows.append({"batch": batch, "plain_tok_s": statistics.median(p_rates),
                     "eagle3_tok_s_no_acceptance": statistics.median(s_rates),
                     "plain_step_ms": plain_step * 1000, "eagle3_step_ms": spec_step * 1000,
                     "breakeven_tau": spec_step / plain_step})
        print(f"eagle3 batch {batch}{' (CUDA graphs)' if args.cuda_graphs else ''}: plain {plain_step * 1000:.2f} "
              f"ms/step, eagle3 chain-3 step "
              f"{spec_step * 1000:.2f} ms (draft 3 + verify 4, random head: nothing accepted); speedup at tau = "
              f"tau / {spec_step / plain_step:.2f}", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--parts", default="generate,steps,attention,eagle3")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--attention-contexts", default="1024,4096")
    p.add_argument("--min-splits", help="attention: shortest key splits to compare (default: the kernel's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bandwidth", type=float, default=3000.0, help="GB/s for the floors (measured copy rate)")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--kv-cache-mb", type=int, default=12288, help="each engine's KV cache")
    p.add_argument("--cuda-graphs", action="store_true", help="time engine.cuda_graphs beside the eager forward")
    args = p.parse_args()
    global DEVICE, KV_CACHE_MB
    DEVICE = torch.device(args.device)
    KV_CACHE_MB = args.kv_cache_mb
    args.batches = [int(b) for b in args.batches.split(",")]
    args.attention_contexts = [int(c) for c in args.attention_contexts.split(",")]
    args.min_splits = [int(c) for c in args.min_splits.split(",")] if args.min_splits else None
    parts = args.parts.split(",")
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}, shape {args.shape}, bfloat16", flush=True)
    results: dict = {"device": name, "shape": args.shape, "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model = random_model(args.shape, directory, torch.bfloat16)
        for part in parts:
            if part == "generate":
                results["generate"] = part_generate(model, directory, args)
            elif part == "steps":
                results["steps"] = part_steps(model, directory, args)
            elif part == "attention":
                results["attention"] = part_attention(model, args)
            elif part == "eagle3":
                results["eagle3"] = part_eagle3(model, directory, args)
            else:
                raise SystemExit(f"unknown part {part!r}")
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
