"""The main job: the embedded model generates without and with speculation, side by side.

Runs the input-grounded built-in prompts (summarize a text, edit given code, answer from
a given text) through plain decoding and through prompt lookup (ngram), checks that the
greedy outputs are identical, and prints the tokens/s of both and the speedup.

    .venv/bin/python scripts/demo.py [--model PATH] [--dtype auto] [--quantization auto] [--max-tokens 192]
                                     [--threads 2] [--batch-invariant auto|true|false] [--compile auto|true|false]

``--model`` takes a GGUF file or a model directory (default: the embedded model); a model
without a chat template reads each prompt as plain text. By default the target is what a
CPU user gets without asking: the GGUF's own blocks on the integer-dot kernels
(``quantization: auto``), the forward compiled
(``compile: auto``; the first run on a machine compiles for about two minutes, a progress
bar shows it); ``--quantization none`` runs the dequantized bfloat16 weights,
``--compile false`` the eager forward.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.prompt_sets import INPUT_GROUNDED, messages
from specdec.config import QUANTIZATIONS
from specdec.testing import first_divergence, near_tie_at

#: A top-2 logit gap at or below this is a near-tie: float32 rounding, or one bfloat16 step
#: at the size of SmolLM2's logits (about 30, where bfloat16 values are 0.125 apart).
TIE_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.125}


def rounding_shift(reference: dict, ids: list[int], top2: torch.Tensor) -> float:
    """How far bfloat16 rounding moves the gap between the tokens ``top2`` after ``ids``: the
    gap in the stock bfloat16 model against the float32 one (``E``). Plain and speculative
    decoding each round by about that much, and so does this reference: if the exact gap
    is within ``E``, as a divergence from rounding needs, the reference's is within ``2E``.
    A larger reference gap is not rounding."""
    if "float32" not in reference:
        reference["float32"] = copy.deepcopy(reference["model"]).float()
    with torch.no_grad():
        logits = {name: reference[name](torch.tensor([ids])).logits[0, -1, top2].float()
                  for name in ("model", "float32")}
    return abs(float((logits["model"][0] - logits["model"][1]) - (logits["float32"][0] - logits["float32"][1])))


def compare(base, fast, dtype: str, reference: dict, model: str | None = None) -> str:
    """'identical', or where the outputs part and whether the target's top two logits
    there are a near-tie (checked with the stock transformers model, not assumed)."""
    i = first_divergence(base.token_ids, fast.token_ids)
    if i is None:
        return "identical"
    if "model" not in reference:
        from transformers import AutoModelForCausalLM

        from specdec.model.loading import resolve_model_dir

        reference["model"] = AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=getattr(torch, dtype))
    ids = base.prompt_token_ids + base.token_ids[:i]
    tie, gap = near_tie_at(reference["model"], base.prompt_token_ids, base.token_ids, i, TIE_TOLERANCE[dtype])
    shift = ""
    if not tie and dtype == "bfloat16":
        moved = rounding_shift(reference, ids, torch.tensor([base.token_ids[i], fast.token_ids[i]]))
        tie = gap <= 2 * moved
        shift = f" ({'within' if tie else 'over'} twice the {moved:.3g} that bfloat16 rounding moves it by here)"
    verdict = "a near-tie" if tie else "NOT a near-tie: please report this"
    return f"differs from token {i}: top-2 logit gap {gap:.3g} in {dtype}{shift}, {verdict}"


def timed(llm: LLM, conversation, params: SamplingParams):
    started = time.perf_counter()
    out = llm.chat(conversation, params)[0]
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a .gguf file or model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-draft-len", type=int, help="default: the ngram plugin's own")
    parser.add_argument("--batch-invariant", default="auto", choices=["auto", "true", "false"],
                        help="engine.batch_invariant (default auto: on where it costs nothing)")
    parser.add_argument("--compile", default="auto", choices=["auto", "true", "false"],
                        help="engine.compile (default auto: on for the integer-dot kernels)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    choice = {"true": True, "false": False}
    engine = {"batch_invariant": choice.get(args.batch_invariant, "auto"), "compile": choice.get(args.compile, "auto"),
              "quantization": args.quantization}
    plain = LLM(model=args.model, dtype=args.dtype, engine=engine)
    ngram = {"decoding_type": "ngram"}
    if args.max_draft_len:
        ngram["max_draft_len"] = args.max_draft_len
    spec = LLM(model=args.model, dtype=args.dtype, speculative_config=ngram, engine=engine)
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    plain.chat(messages("chat")[0], warm)
    spec.chat(messages("chat")[0], warm)

    totals = {"plain": [0, 0.0], "ngram": [0, 0.0]}
    reference: dict = {}
    for category in INPUT_GROUNDED:
        for conversation in messages(category):
            base, t_base = timed(plain, conversation, params)
            fast, t_fast = timed(spec, conversation, params)
            totals["plain"][0] += len(base.token_ids)
            totals["plain"][1] += t_base
            totals["ngram"][0] += len(fast.token_ids)
            totals["ngram"][1] += t_fast
            same = compare(base, fast, "float32" if args.dtype == "float32" else "bfloat16", reference, args.model)
            m = fast.metrics
            print(f"=== {category} ===\n{fast.text.strip()}\n")
            print(f"plain: {len(base.token_ids) / t_base:6.1f} tok/s   ngram: {len(fast.token_ids) / t_fast:6.1f} tok/s"
                  f"   speedup {t_base / t_fast * len(fast.token_ids) / max(len(base.token_ids), 1):.2f}x   "
                  f"acceptance length {m.acceptance_length:.2f}   output {same}\n")
    plain_tps = totals["plain"][0] / totals["plain"][1]
    spec_tps = totals["ngram"][0] / totals["ngram"][1]
    numerics = "batch-invariant" if plain.engine.batch_invariant else "stock"
    weights = plain.config.engine.quantization or "unquantized"
    dtype = str(plain.dtype).removeprefix("torch.")
    forward = "compiled" if plain.engine.compiled else "eager"
    print(f"overall ({dtype}, {weights}, {forward}, {args.threads} threads, {numerics} numerics): "
          f"plain {plain_tps:.1f} tok/s, ngram {spec_tps:.1f} tok/s, {spec_tps / plain_tps:.2f}x")


if __name__ == "__main__":
    main()
