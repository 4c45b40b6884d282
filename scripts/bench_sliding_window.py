"""Sliding-window layers after a long prompt: the CPU attention kernel over one decode
token's key row with the window and without it, then (``--model``, a GGUF with sliding
layers such as Gemma 3) greedy decoding after a prompt of ``--context`` tokens, the model's
windows as they are or widened past the context (every key scored: what the kernel cost
before it skipped the blocks that left the window), or (``--against DIR``) as another
checkout of specdec runs it, with the KV memory each engine allocated and the context its
block tables hold. Each decoding run is a process of its own, alternated.

    .venv/bin/python scripts/bench_sliding_window.py [--model G] [--context 3000] [--rounds 2]
        [--against DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


def kernel(contexts: list[int], window: int) -> None:
    """Gemma 3 270M's attention shapes (4 query heads, 1 KV head of 256), bfloat16 pools."""
    from specdec.kernels import invariant_attention
    from specdec.kvcache.layout import AttentionLayout, SequenceSlice

    for context in contexts:
        gen, size = torch.Generator().manual_seed(0), 16
        blocks = -(-(context + 1) // size)
        layout = AttentionLayout([SequenceSlice(block_table=list(range(blocks)), start=context,
                                                positions=torch.tensor([context]))], size, torch.device("cpu"))
        keys, values = (torch.randn(blocks * size, 1, 256, generator=gen).bfloat16() for _ in range(2))
        query = torch.randn(1, 4, 256, generator=gen).bfloat16().transpose(0, 1)
        for w in (None, window):
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(100):
                    invariant_attention(query, keys, values, layout, 0.0625, w, None)
                best = min(best, (time.perf_counter() - started) / 100)
            print(f"kernel  context {context:>6}  window {str(w):>5}: {best * 1e6:8.0f} us a call")


def decode(model: str, context: int, widen: bool) -> str:
    """Greedy decode rate (tok/s, median of three 64-token answers) after ``context`` prompt
    tokens (the prompt then cached: only the decoding is timed), the KV pools' MB and the
    tokens the block tables hold."""
    if widen:
        from transformers.models.gemma3 import modeling_gemma3

        init = modeling_gemma3.Gemma3Attention.__init__

        def wide(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self.sliding_window:
                self.sliding_window = 10**9

        modeling_gemma3.Gemma3Attention.__init__ = wide
    from specdec import LLM, SamplingParams

    llm = LLM(model=model)
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    ids = llm.get_tokenizer()("Summarize this document:\n\n" + text, add_special_tokens=False).input_ids
    prompt = {"prompt_token_ids": (ids * (context // len(ids) + 1))[:context]}
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    rates = []
    for _ in range(3):
        started = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True))
        rates.append(64 / (time.perf_counter() - started))
    kv = llm.engine.kv
    pools = sum(t.numel() * t.element_size() for t in (*kv.cache.keys, *kv.cache.values))
    tables = kv.pool.num_blocks * kv.block_size
    return f"{statistics.median(rates):6.1f} tok/s  KV {pools / 2**20:7.1f} MB  tables {tables} tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF whose model has sliding-window layers (Gemma 3)")
    parser.add_argument("--context", type=int, default=3000)
    parser.add_argument("--window", type=int, default=512, help="the kernel's window")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--against", metavar="DIR", help="a checkout of specdec to alternate with (its core/ is "
                                                          "imported as specdec), instead of the widened windows")
    parser.add_argument("--one", choices=["window", "widened"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.one:
        print(decode(args.model, args.context, args.one == "widened"))
        return
    kernel([1024, args.context, 4 * args.context], args.window)
    if not args.model:
        return
    with tempfile.TemporaryDirectory() as other:
        runs = {"window": ("window", os.environ), "widened": ("widened", os.environ)}
        if args.against:
            os.symlink(Path(args.against).resolve() / "core", Path(other) / "specdec")
            runs = {"this tree": ("window", os.environ),
                    "against": ("window", {**os.environ, "PYTHONPATH": other})}
        for round_ in range(args.rounds):
            for name, (mode, env) in runs.items():
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--context",
                                      str(args.context), "--one", mode], check=True, capture_output=True, text=True,
                                     env=env)
                result = out.stdout.strip().splitlines()[-1]
                print(f"decode  round {round_}  context {args.context}  {name:>9}: {result}")


if __name__ == "__main__":
    main()
