"""Tensor parallelism on one machine: N ranks of T/N threads against one rank of T threads,
on the same work, interleaved, and what the ranks add to a step (rank 0's sends of each
operation, the forward's all-reduces).

    python scripts/bench_tensor_parallel.py [--model DIR] [--size 2] [--threads 2] [--rounds 3]

Without ``--model`` the target is a random Llama of a realistic shape (hidden 1024, 16
heads, 8 KV heads, 12 layers, MLP 2816, vocabulary 32000: about 220 M parameters), saved once
in a temporary directory; its prompts are token ids (a random sequence said twice, which
ngram drafts from). Greedy, bfloat16, batch 1 and 4; the last column counts the sequences
equal to plain decoding at one rank (in bfloat16 the ranks' partial sums round differently
from one rank's whole products, so a near-tie may flip; float32 decodes as one rank does).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams

SHAPE = dict(model_type="llama", hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048,
             tie_word_embeddings=False)


def random_llama(directory: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (directory / "config.json").exists():
        options = dict(SHAPE)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(options.pop("model_type"), **options),
                                                 dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.08)
        model.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: a random Llama, see above)")
    parser.add_argument("--size", type=int, default=2, help="ranks of the tensor-parallel configurations")
    parser.add_argument("--threads", type=int, default=2, help="threads in all, shared out over the ranks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(random_llama(Path(tempfile.gettempdir()) / "specdec-bench-tp-llama"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (24,), generator=g).tolist() * 2 for _ in range(4)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ngram = {"decoding_type": "ngram", "max_draft_len": 4}
    systems, threads = {}, {}
    per_rank = max(1, args.threads // args.size)
    for label, spec in (("plain", None), ("ngram", ngram)):
        name = f"{label}, 1 rank x {args.threads} threads"
        systems[name], threads[name] = LLM(model, dtype="bfloat16", speculative_config=spec,
                                           engine={"num_threads": args.threads}), args.threads
        name = f"{label}, {args.size} ranks x {per_rank} thread(s)"
        systems[name], threads[name] = LLM(model, dtype="bfloat16", speculative_config=spec,
                                           tensor_parallel_size=args.size, engine={"num_threads": per_rank}), per_rank
    results = {(name, batch): [0, 0.0, 0, 0.0, 0.0] for name in systems for batch in (1, 4)}
    outputs = {}
    for llm in systems.values():  # warm up outside the measurement
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
    for _ in range(args.rounds):
        for batch in (1, 4):
            for name, llm in systems.items():
                torch.set_num_threads(threads[name])  # one process: rank 0's threads are set per system
                group = llm.group
                before = (group.send_seconds, group.collective_seconds) if group is not None else (0.0, 0.0)
                started = time.perf_counter()
                outs = (llm.generate(prompts[:batch], params) if batch > 1
                        else [llm.generate([p], params)[0] for p in prompts])
                seconds = time.perf_counter() - started
                row = results[name, batch]
                row[0] += sum(len(o.token_ids) for o in outs)
                row[1] += seconds
                row[2] += max(o.metrics.num_steps for o in outs) if batch > 1 else sum(o.metrics.num_steps
                                                                                      for o in outs)
                if group is not None:
                    row[3] += group.send_seconds - before[0]
                    row[4] += group.collective_seconds - before[1]
                outputs[name, batch] = [o.token_ids for o in outs]
    print(f"# {model}: bfloat16, greedy, {args.max_tokens} tokens, {args.rounds} rounds")
    print("| system | batch | tok/s | ms/step | send ms/step | all-reduce ms/step | output as plain at 1 rank |")
    print("|---|---|---|---|---|---|---|")
    one_rank = next(iter(systems))
    for (name, batch), (tokens, seconds, steps, sends, reduces) in results.items():
        same = sum(a == b for a, b in zip(outputs[name, batch], outputs[one_rank, batch]))
        print(f"| {name} | {batch} | {tokens / seconds:.1f} | {seconds / steps * 1000:.1f} | "
              f"{sends / steps * 1000:.2f} | {reduces / steps * 1000:.2f} | {same} of {len(outputs[name, batch])} |")
    for llm in systems.values():
        llm.close()


if __name__ == "__main__":
    main()
