"""Where a target step's time goes: a decode step (1 new token) and a 16-token verification
step (a chain of 16 new tokens), each after a context of ``--context`` tokens, batch 1.

    .venv/bin/python scripts/profile_step.py [--model PATH] [--dtype bfloat16] [--quantization int4] [--compile]
                                             [--threads 2]

Prints the wall time per step (median of ``--steps`` forwards through specdec's model
runner and paged KV cache, the engine's own path), the bytes of weights one forward
streams and the time that takes at ``--bandwidth`` GB/s (the floor of a decode step), then
the torch profiler's split of one step: matrix products (linear layers, int4/int8 packed
kernels), attention, other tensor operations (with ``--compile``: the compiled graph's
fused kernels too), and what is left: Python and dispatch between the operations.
``--curve 1 2 4 8 16`` instead times steps of those token counts, interleaved round by
round: the shape of the step cost the adaptive planner fits (with ``--compile``, the jump
from the one-token graph to the dynamic one), and the LM head's share of each (the head
alone on as many rows, timed in the same rounds: on a large vocabulary it, not the layers,
sets what a verified token costs). A shape may be a batch, one width per
sequence: ``--curve 1,1,1,1,1,1,1,1 2,1,1,1,1,1,1,1 2,2,2,2,2,2,2,2`` times eight decoding
sequences, then one and all of them verifying a draft token; ``t16`` is a tree of 16
tokens (the root and 15 children of it: each node's own row in the batch-invariant
attention), ``t16,t16,1,1,1,1,1,1`` two of them in a batch of eight. ``--batch-invariant
--against-stock`` times every shape under both numerics, interleaved: the mode's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM
from specdec.config import QUANTIZATIONS
from specdec.kvcache import PagedKVCache
from specdec.kvcache.layout import AttentionLayout, SequenceSlice
from specdec.model.quantization import weight_bytes
from specdec.model.target import ForwardMetadata

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
          "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise")
ATTENTION = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
             "aten::softmax", "aten::_softmax", "aten::index_copy_", "aten::index_select")


def step_runner(llm: LLM, context: int, new: int | list[int], block_size: int = 16, batch_invariant: bool = False,
                trees: list[bool] | None = None):
    """A function running one forward of ``new`` tokens after ``context`` cached ones; with
    a list, one sequence per entry (its new tokens), each after its own ``context``, those
    that ``trees`` marks as a root and its children instead of a chain."""
    target = llm.target
    widths = new if isinstance(new, list) else [new]
    per_sequence = (context + max(widths)) // block_size + 2
    cache = PagedKVCache(target.layer_shapes, per_sequence * len(widths), block_size, target.dtype, target.device)
    tables = [list(range(i * per_sequence, (i + 1) * per_sequence)) for i in range(len(widths))]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, target.vocab_size, (context + n,), generator=g) for n in widths]

    def star(n: int) -> torch.Tensor:
        mask = torch.eye(n, dtype=torch.bool)
        mask[:, 0] = True
        return mask

    def layout(start: int, counts: list[int]) -> ForwardMetadata:
        slices = [SequenceSlice(block_table=table, start=start, positions=torch.arange(start, start + n))
                  if not tree else SequenceSlice(block_table=table, start=start, tree_mask=star(n),
                                                 positions=start + (torch.arange(n) > 0).long())
                  for table, n, tree in zip(tables, counts, trees or [False] * len(counts))]
        return ForwardMetadata(cache=cache, layout=AttentionLayout(slices, block_size, target.device),
                               batch_invariant=batch_invariant)

    for i, seq in enumerate(ids):  # each sequence's context, through its own block table
        target.forward(seq[:context], torch.arange(context), ForwardMetadata(
            cache=cache, layout=AttentionLayout([SequenceSlice(block_table=tables[i], start=0,
                                                               positions=torch.arange(context))],
                                                block_size, target.device), batch_invariant=batch_invariant),
            torch.tensor([context - 1]))
    step_ids = torch.cat([seq[context:] for seq in ids])
    rows = torch.arange(sum(widths))  # every new token's logits, as verification needs

    def run():
        meta = layout(context, widths)
        target.forward(step_ids, meta.layout.query_positions, meta, rows)

    return run


def time_step(run, steps: int) -> float:
    run()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_curve(llms: dict[bool, LLM], context: int, shapes: list[str], rounds: int) -> dict[tuple, float]:
    """Median seconds of a step of each shape (``16``: one sequence of 16 new tokens;
    ``2,1,1,1``: four sequences, the first verifying two tokens) under each numerics mode of
    ``llms`` (batch-invariant or not), and of the LM head alone on its rows (key ``(shape,
    "head")``), interleaved in every round."""
    runs = {(n, invariant): step_runner(llm, context, [int(w.lstrip("t")) for w in n.split(",")],
                                        batch_invariant=invariant, trees=[w.startswith("t") for w in n.split(",")])
            for n in shapes for invariant, llm in llms.items()}
    runs.update({(n, "head"): head_runner(next(iter(llms.values())), n) for n in shapes})
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    for _ in range(rounds + 1):  # the first round warms up
        for key, run in runs.items():
            started = time.perf_counter()
            run()
            times[key].append(time.perf_counter() - started)
    return {key: statistics.median(t[1:]) for key, t in times.items()}


def head_runner(llm: LLM, shape: str):
    """A function running the target's LM head alone on as many rows as ``shape`` has new tokens."""
    head = llm.target.model.get_output_embeddings()
    rows = sum(int(w.lstrip("t")) for w in shape.split(","))
    hidden = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(0)).to(llm.target.dtype)
    return lambda: head(hidden)


def profile_split(run, top: int = 0) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        run()
        wall = time.perf_counter() - started
    split = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        if event.key.startswith("## Call CompiledFxGraph"):  # engine.compile: the fused kernels run in its self time
            kind = "other ops"
        elif not event.key.startswith(("aten::", "mkldnn::")):
            continue
        else:
            kind = "matmul" if event.key in MATMUL else "attention" if event.key in ATTENTION else "other ops"
        split[kind] += event.self_cpu_time_total / 1e6
    split["python and dispatch"] = max(wall - sum(split.values()), 0.0)
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return {"profiled wall": wall, **split}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or model directory (default: the embedded model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=QUANTIZATIONS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-prepack", action="store_true", help="engine.prepack_weights off (stock F.linear)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="engine.batch_invariant true (else false, whatever its auto default would pick)")
    p.add_argument("--against-stock", action="store_true",
                   help="with --batch-invariant --curve: also time the stock numerics, interleaved, and print "
                        "the mode's cost per shape")
    p.add_argument("--compile", action="store_true", help="engine.compile on (the graphs compile first)")
    p.add_argument("--top", type=int, default=0, help="also print the N operations that took most time")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--curve", nargs="+", metavar="TOKENS",
                   help="time steps of these token counts (interleaved, --steps rounds) instead of profiling")
    p.add_argument("--bandwidth", type=float, default=12.0, help="memory bandwidth in GB/s for the floor")
    args = p.parse_args()
    if args.against_stock and not (args.batch_invariant and args.curve):
        p.error("--against-stock compares the batch-invariant mode's steps: give --batch-invariant and --curve")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    modes = [True, False] if args.against_stock else [args.batch_invariant]
    llms = {invariant: LLM(model=args.model, dtype=args.dtype,
                           engine={"quantization": args.quantization, "kv_cache_blocks": 1,
                                   "prepack_weights": not args.no_prepack, "batch_invariant": invariant,
                                   "compile": args.compile})
            for invariant in modes}
    llm = llms[args.batch_invariant]
    built = time.perf_counter() - started
    model = llm.target.model
    tensors = lambda m: [t for t in list(m.parameters()) + list(m.buffers()) if t is not None]  # noqa: E731
    head = {t.data_ptr() for t in tensors(model.get_output_embeddings())}
    # A forward reads a few rows of an embedding table, not all of it (unless the head shares it).
    streamed = weight_bytes(model) - sum(t.numel() * t.element_size() for t in tensors(model.get_input_embeddings())
                                         if t.data_ptr() not in head)
    floor = streamed / (args.bandwidth * 1e9)
    print(f"# {llm.target.name}, {args.dtype}{', ' + args.quantization if args.quantization else ''}, "
          f"{args.threads} threads, context {args.context}: weights streamed per forward "
          f"{streamed / 2**20:.0f} MiB, {floor * 1000:.1f} ms at {args.bandwidth:g} GB/s; "
          f"LLM built in {built:.0f} s{' (graphs compiled)' if args.compile else ''}")
    if args.curve:
        curve = time_curve(llms, args.context, args.curve, args.steps)
        print("tokens per step -> ms: " + ", ".join(f"{n}: {curve[n, args.batch_invariant] * 1000:.1f}"
                                                    for n in args.curve))
        print("LM head alone -> ms: " + ", ".join(
            f"{n}: {curve[n, 'head'] * 1000:.1f} ({curve[n, 'head'] / curve[n, args.batch_invariant]:.0%})"
            for n in args.curve))
        if len(llms) > 1:
            print("stock numerics -> ms: " + ", ".join(
                f"{n}: {curve[n, False] * 1000:.1f} (mode {curve[n, True] / curve[n, False]:.2f}x)"
                for n in args.curve))
        return
    for label, new in (("decode (1 token)", 1), ("verify (16 tokens)", 16)):
        run = step_runner(llm, args.context, new, batch_invariant=args.batch_invariant)
        wall = time_step(run, args.steps)
        split = profile_split(run, args.top)
        parts = ", ".join(f"{k} {v * 1000:.1f}" for k, v in split.items())
        print(f"{label:<20} {wall * 1000:6.1f} ms/step ({wall / floor:.2f}x the floor); profiled ms: {parts}")


if __name__ == "__main__":
    main()
