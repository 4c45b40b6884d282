"""Every trained method's drafter for the embedded model, end to end in one run: the GPU mode
of ``scripts/train_shipped.sh``, the same steps at any scale.

    python scripts/train_recipe.py --scale gpu --out "$OUT"     # one device call on a GPU machine
    python scripts/train_recipe.py --scale tiny --out /tmp/r    # the same steps at toy size, on a CPU

1. Requests the target writes itself (``make_self_instruct_prompts.py``, the Magpie
   recipe: none on a benchmark prompt's topic), beside the project's prompt sets and the
   public training sets given with ``--public`` (Alpaca- or ShareGPT-style files read
   where they lie, never copied into the repository; ``scripts/data_curve.py`` measures
   what they buy).
2. The target's greedy answers, once (``specdec train``'s cache); every method trains on
   them, and the methods that read target hidden states share one feature store.
3. Each method trained as ``train_shipped.sh`` trains it (its options, lr), for the scale's
   epochs.
4. Acceptance length on ``benchmarks/diverse.jsonl`` (prompts no drafter trained on), each
   method at its default depth with the adaptive planner off: the new drafter beside the
   shipped one, and whether their text equals plain decoding.
5. Into OUT: ``weights/<method>/`` (the files the method loads: ``speculative_model:``
   that directory; matrices as int8 rows + scales where the shipped drafter's are),
   ``report.json`` and ``report.md`` (per method: samples, answer tokens,
   steps, seconds, acceptance new and shipped).

Ship a new drafter only where it beats the shipped one on held-out data (the size rule:
docs/training.md).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

from make_self_instruct_prompts import write_requests  # scripts/, beside this one
from store_int8 import store_file

ROOT = Path(__file__).resolve().parent.parent

#: per scale: self-instruct requests, project prompt files, answer length, generation batch,
#: epochs (or optimizer steps), batch size, held-out prompts and tokens for the evaluation
SCALES = {
    "tiny": dict(self_instruct=4, prompt_files=[], max_new_tokens=16, gen_batch=8, epochs=1, max_steps=2,
                 batch_size=2, eval_prompts=2, eval_tokens=16, generation_batch=8),
    "cpu": dict(self_instruct=600, prompt_files=["train_prompts/prompts.jsonl"], max_new_tokens=160, gen_batch=24,
                epochs=1, max_steps=None, batch_size=8, eval_prompts=16, eval_tokens=96, generation_batch=48),
    "gpu": dict(self_instruct=20000, prompt_files=["train_prompts/prompts.jsonl", "train_prompts/self_instruct.jsonl",
                                                   "train_prompts/self_instruct_2.jsonl"],
                max_new_tokens=256, gen_batch=256, epochs=2, max_steps=None, batch_size=32, eval_prompts=16,
                eval_tokens=96, generation_batch=512),
}

#: method -> (trainer options, learning rate, where its features come from, whether its
#: matrices ship as int8 rows + scales), as train_shipped.sh
METHODS = {
    "draft_target": ({"draft_layers": 2, "draft_vocab_size": 8192}, 1e-3, None, True),
    "eagle3": ({"draft_vocab_size": 4096}, 1e-3, None, True),
    "eagle": ({}, 1e-3, "eagle3", False),
    "medusa": ({}, 1e-3, "eagle3", False),
    "redrafter": ({}, 1e-3, "eagle3", False),
    "mtp": ({}, 1e-3, None, True),
}

#: the evaluation's engines run eagerly: acceptance and text equal to plain decoding do not
#: depend on compiling, which costs each engine a minute or more on a CPU
EVAL_ENGINE = {"compile": False}

#: what a run directory holds besides the drafter itself
RUN_FILES = {"checkpoint.pt", "samples.jsonl", "train_report.json", "features"}


def write_prompts(run: Path, scale: dict, seed: int, public: list[str]) -> Path:
    """The training prompts: the scale's project files (without their last 16, held out),
    the requests the target writes, then the public sets' requests, shuffled together."""
    data = run / "prompts.jsonl"
    if data.exists():
        return data
    written = run / "self_instruct.jsonl"
    if not written.exists():
        write_requests(str(written), scale["self_instruct"], seed, scale["generation_batch"])
    lines = []
    for name in scale["prompt_files"]:
        rows = [line for line in (ROOT / name).read_text().splitlines() if line.strip()]
        lines += rows[:-16] if name == "train_prompts/prompts.jsonl" else rows
    lines += [line for line in written.read_text().splitlines() if line.strip()]
    if public:
        from specdec.training.data import public_prompts

        lines += [json.dumps({"prompt": p}) for p in public_prompts(public, max_chars=1500)]
        random.Random(seed).shuffle(lines)
    data.write_text("\n".join(lines) + "\n")
    return data


def train_method(method: str, run: Path, data: Path, scale: dict, device: str) -> dict:
    from specdec.training import TrainOptions, train

    options, lr, features_from, _ = METHODS[method]
    out = run / method
    out.mkdir(parents=True, exist_ok=True)
    first = run / "draft_target" / "samples.jsonl"
    if method != "draft_target" and first.exists() and not (out / "samples.jsonl").exists():
        shutil.copy(first, out / "samples.jsonl")
    if features_from and not (out / "features").exists():
        (out / "features").symlink_to(Path("..") / features_from / "features")
    report_path = out / "train_report.json"
    if report_path.exists():
        return json.loads(report_path.read_text())
    return train(TrainOptions(method=method, data=str(data), out=str(out), device=device, epochs=scale["epochs"],
                              max_steps=scale["max_steps"], batch_size=scale["batch_size"], lr=lr,
                              max_new_tokens=scale["max_new_tokens"], gen_batch_size=scale["gen_batch"],
                              eval_prompts=0, resume=(out / "checkpoint.pt").exists(), trainer_options=options),
                 progress=sys.stderr.isatty())


def acceptance(method: str, drafter: Path | None, prompts: list, params, plain: list, device: str) -> dict:
    """Acceptance length at the method's default depth (planner off) on ``prompts``, and how
    many answers equal ``plain`` decoding's."""
    from specdec import LLM

    spec = {"decoding_type": method, "adaptive": False}
    if drafter is not None:
        spec["speculative_model"] = str(drafter)
    outs = LLM(device=device, speculative_config=spec, engine=EVAL_ENGINE).chat(prompts, params)
    return {"acceptance_length": round(sum(len(o.token_ids) for o in outs) / sum(o.metrics.num_steps for o in outs),
                                       3),
            "same_as_plain": sum(o.token_ids == p for o, p in zip(outs, plain)), "prompts": len(outs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    parser.add_argument("--out", required=True, help="where the weights and the report go")
    parser.add_argument("--run", help="working directory (answers, features, checkpoints; default OUT/run)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--public", nargs="*", default=[], help="public training sets (Alpaca/ShareGPT JSON or JSONL)")
    args = parser.parse_args()
    scale = SCALES[args.scale]
    out = Path(args.out)
    run = Path(args.run) if args.run else out / "run"
    run.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data = write_prompts(run, scale, args.seed, args.public)
    held_out = [[{"role": "user", "content": json.loads(line)["prompt"]}]
                for line in (ROOT / "benchmarks/diverse.jsonl").read_text().splitlines()
                if line.strip()][:scale["eval_prompts"]]
    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=scale["eval_tokens"], temperature=0.0)
    plain = [o.token_ids for o in LLM(device=args.device, engine=EVAL_ENGINE).chat(held_out, params)]
    methods = ["draft_target"] + [m for m in args.methods if m != "draft_target"]  # its answers serve all
    report = {"scale": args.scale, "prompts": sum(1 for _ in data.open()), "methods": {}}
    for method in methods:
        trained = train_method(method, run, data, scale, args.device)
        weights = out / "weights" / method
        shutil.rmtree(weights, ignore_errors=True)
        shutil.copytree(run / method, weights, ignore=lambda _d, names: [n for n in names if n in RUN_FILES])
        if METHODS[method][3]:
            print(store_file(weights / "model.safetensors"))
        if method not in args.methods:
            continue
        report["methods"][method] = {
            **{k: trained.get(k) for k in ("samples", "answer_tokens", "steps", "device", "data_seconds",
                                           "train_seconds_this_run", "final_loss")},
            "new": acceptance(method, weights, held_out, params, plain, args.device),
            "shipped": acceptance(method, None, held_out, params, plain, args.device)}
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"# train_recipe.py --scale {args.scale}: {report['prompts']} prompts, {report['seconds']} s",
             "| method | samples | answer tokens | steps | train s | acceptance new | shipped | same text |",
             "|---|---|---|---|---|---|---|---|"]
    for method, r in report["methods"].items():
        lines.append(f"| {method} | {r['samples']} | {r['answer_tokens']} | {r['steps']} | "
                     f"{r['train_seconds_this_run']} | {r['new']['acceptance_length']} | "
                     f"{r['shipped']['acceptance_length']} | {r['new']['same_as_plain']}/{r['new']['prompts']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
