"""Where batch variance enters a target forward: the first module whose output for a
token differs between a step shared with other requests and the same token's step alone.

    python scripts/find_batch_variance.py [--model M] [--dtype bfloat16] [--device cuda]
        [--batch 32] [--new 5] [--context 40] [--prefill 0] [--stock]

``--batch`` requests with ``--context`` cached tokens each run one step of ``--new``
tokens (a draft chain) together, then each request decodes the same tokens alone, one
per step, as plain decoding does; every module's output is recorded (forward hooks) and
compared bit for bit, row by row, in execution order (a module's children before it).
``--prefill N`` adds to the shared step another request's prompt chunk of N tokens, as
a server's steps mix prompts with decoding (its rows are not compared). With
the engine's batch-invariant mode (the default here; ``--stock`` turns it off) nothing
should differ; where something does, the table's first line names the operation to fix.
On this repository's CPU, ``--stock`` shows layer 0's bfloat16 MLP down projection first.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

import torch

from specdec import LLM
from specdec.executor.model_runner import ForwardMetadata
from specdec.kernels import AttentionLayout, SequenceSlice
from specdec.kvcache import PagedKVCache


def record_outputs(model: torch.nn.Module) -> tuple[OrderedDict, list]:
    """Hooks storing each module's first output tensor, flattened to ``[tokens, -1]``."""
    seen: OrderedDict[str, torch.Tensor] = OrderedDict()

    def hook(name):
        def store(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                rows = out.shape[1] if out.dim() == 3 and out.shape[0] == 1 else out.shape[0]
                seen[name] = out.detach().reshape(rows, -1).clone()
        return store

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    return seen, handles


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new", type=int, default=5, help="tokens per request in the step (1: decode)")
    p.add_argument("--context", type=int, default=40)
    p.add_argument("--prefill", type=int, default=0, help="a prompt chunk of this many tokens in the shared step")
    p.add_argument("--stock", action="store_true", help="stock numerics instead of the batch-invariant mode")
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              engine={"batch_invariant": not args.stock, "kv_cache_blocks": 1})
    target = llm.target
    block_size = 16
    length = max(args.context + args.new, args.prefill)
    per_seq = length // block_size + 1
    requests = args.batch + 1  # the last one holds the prompt chunk of --prefill
    cache = PagedKVCache(target.layer_shapes, per_seq * requests, block_size, target.dtype, target.device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(requests)]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (requests, length), generator=g).to(target.device)

    def forward(seqs: list[int], start: int, count: int, extra: tuple[int, int, int] | None = None) -> None:
        """``count`` tokens from ``start`` of each of ``seqs``; ``extra``: (request, start, count) after them."""
        parts = [(b, start, count) for b in seqs] + ([extra] if extra else [])
        slices = [SequenceSlice(block_table=tables[b], start=first, positions=torch.arange(first, first + n))
                  for b, first, n in parts]
        layout = AttentionLayout(slices, block_size, target.device)
        tokens = torch.cat([ids[b, first:first + n] for b, first, n in parts])
        positions = torch.cat([s.positions for s in slices]).to(target.device)
        meta = ForwardMetadata(cache=cache, layout=layout, batch_invariant=not args.stock)
        target.forward(tokens, positions, meta, torch.arange(len(tokens), device=target.device))

    for b in range(args.batch):  # every context prefilled alone, so the caches are the same for both runs
        forward([b], 0, args.context)
    seen, handles = record_outputs(target.model)
    forward(list(range(args.batch)), args.context, args.new, (args.batch, 0, args.prefill) if args.prefill else None)
    together = OrderedDict(seen)
    alone: dict[str, list[torch.Tensor]] = {}
    for b in range(args.batch):
        for i in range(args.new):  # plain decoding: one token per step
            seen.clear()
            forward([b], args.context + i, 1)
            for name, out in seen.items():
                alone.setdefault(name, []).append(out)
    for h in handles:
        h.remove()
    mode = "stock numerics" if args.stock else "batch-invariant mode"
    beside = f" beside a {args.prefill}-token prompt chunk" if args.prefill else ""
    print(f"# {target.name}, {target.dtype}, {target.device}, {mode}: {args.batch} requests x {args.new} tokens "
          f"in one step{beside} vs decoded alone one at a time, context {args.context}; first differing modules:")
    differing = compared = 0
    for name, out in together.items():
        if name not in alone or out.shape[0] != args.batch * args.new + args.prefill:
            continue
        compared += 1
        out = out[:args.batch * args.new]
        single = torch.cat(alone[name])
        rows = (out != single).reshape(out.shape[0], -1).any(dim=1)
        if rows.any():
            differing += 1
            if differing <= 15:
                diff = (out.float() - single.float()).abs().max().item()
                print(f"{name:<45} {int(rows.sum()):>4}/{len(rows)} rows differ, max |diff| {diff:.3e}")
    print(f"{differing} of {compared} modules give outputs that depend on the batch" if differing else
          f"each of {compared} modules gives every token the output it gives alone")


if __name__ == "__main__":
    main()
