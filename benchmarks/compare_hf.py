"""specdec against Hugging Face generate(), side by side in one run, on the embedded model.

Systems (each on the same prompts, interleaved prompt by prompt to share the machine's noise):
  specdec plain, specdec ngram (prompt lookup), HF generate plain, HF prompt lookup
  (prompt_lookup_num_tokens), HF assisted generation with a layer-skip self-draft (the
  target's first N layers).

    .venv/bin/python benchmarks/compare_hf.py --dtype bfloat16 --max-tokens 192 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specdec import LLM, SamplingParams
from specdec.models import resolve_model_dir
from specdec.prompt_sets import INPUT_GROUNDED, PROMPTS, messages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-draft-len", type=int, default=12)
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    ap.add_argument("--assistant-layers", type=int, default=6)
    ap.add_argument("--categories", nargs="*", default=list(PROMPTS))
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    path = resolve_model_dir(None)
    plain = LLM(dtype=args.dtype)
    ngram = LLM(dtype=args.dtype, speculative_config={"decoding_type": "ngram", "max_draft_len": args.max_draft_len})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    assistant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     num_hidden_layers=args.assistant_layers).eval()
    tok = plain.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def hf_run(ids, **kw):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                              pad_token_id=tok.eos_token_id, **kw)
        return out.shape[1] - len(ids)

    systems = {
        "specdec plain": lambda ids: len(plain.generate([ids], params)[0].token_ids),
        "specdec ngram": lambda ids: len(ngram.generate([ids], params)[0].token_ids),
        "HF generate": lambda ids: hf_run(ids),
        "HF prompt lookup": lambda ids: hf_run(ids, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens),
        f"HF assistant ({args.assistant_layers}-layer self-draft)": lambda ids: hf_run(ids, assistant_model=assistant),
    }
    warm = plain.apply_chat_template(messages("chat")[0])[:32]
    for run in systems.values():
        run(warm)

    results = {name: {} for name in systems}
    for category in args.categories:
        for conversation in messages(category):
            ids = plain.apply_chat_template(conversation)
            for name, run in systems.items():
                started = time.perf_counter()
                n = run(ids)
                spent = time.perf_counter() - started
                tokens, seconds = results[name].get(category, (0, 0.0))
                results[name][category] = (tokens + n, seconds + spent)

    def tps(name, cats):
        tokens = sum(results[name][c][0] for c in cats)
        return tokens / sum(results[name][c][1] for c in cats)

    groups = {"input-grounded": [c for c in args.categories if c in INPUT_GROUNDED],
              "open-ended": [c for c in args.categories if c not in INPUT_GROUNDED]}
    groups = {g: cats for g, cats in groups.items() if cats}
    print(f"embedded SmolLM2-135M-Instruct, {args.dtype}, {args.threads} threads, batch 1, greedy, "
          f"max {args.max_tokens} tokens, {platform.processor() or platform.machine()}")
    header = f"{'system':<38}" + "".join(f"{g + ' tok/s':>22}{'vs HF':>8}{'vs plain':>10}" for g in groups)
    print(header)
    table = {}
    for name in systems:
        row = f"{name:<38}"
        for g, cats in groups.items():
            value = tps(name, cats)
            table.setdefault(name, {})[g] = value
            row += f"{value:>22.1f}{value / tps('HF generate', cats):>7.2f}x{value / tps('specdec plain', cats):>9.2f}x"
        print(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "tokens_per_s": table,
                       "raw": {n: {c: list(v) for c, v in r.items()} for n, r in results.items()}}, fh, indent=2)


if __name__ == "__main__":
    main()
