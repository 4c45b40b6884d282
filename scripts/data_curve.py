"""Held-out acceptance of a trained drafter against its training data: how much, how diverse,
and our trainer's settings against the reference recipe's, all at equal data.

    python scripts/data_curve.py --run /tmp/curve --public ~/data/roleplay.json ~/data/codegen.json

The target answers two pools of prompts once (greedy, bfloat16, 160 tokens):

- diverse: requests the target wrote itself (``train_prompts/self_instruct*.jsonl``) mixed with
  public instruction sets made for training, given with ``--public`` (Alpaca-style JSON or
  JSONL, read where they lie, never copied into the repository);
- templated: the project's templated prompts (``train_prompts/prompts.jsonl``, what the shipped
  drafters learnt from).

Then the method trains once per point, each run for ``--epochs`` over its own samples: the
first N diverse samples for each N of ``--points`` (runs share the answers and the target
features of the largest), the templated pool, the diverse pool cut at the templated pool's
answer tokens (diversity at equal tokens), and, for EAGLE-3, the reference recipe's
settings (SpecForge: 7 training-time-test steps, lr 1e-4, a 32,000-token draft vocabulary)
and ours with only the steps changed, on the same samples as ``--reference-point``; with
``--repeat N E``, the first N diverse samples for E epochs (repeats against new data at
equal steps).

Each drafter is measured at its default depth with the adaptive planner off, bfloat16,
greedy, on three held-out sets no run trained on: ``benchmarks/diverse.jsonl``, prompts of
the public sets kept out of the pool (``--public-held-out``), and the last 16 templated
prompts. ``RUN/curve.json`` and ``RUN/curve.md`` hold the table; a run trained or measured
in RUN by an earlier invocation is not trained or measured again.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELF_INSTRUCT = ["train_prompts/self_instruct.jsonl", "train_prompts/self_instruct_2.jsonl"]
TEMPLATED = "train_prompts/prompts.jsonl"
#: the reference recipe's settings (SpecForge's EAGLE-3 training) and ours
REFERENCE = ({"ttt_steps": 7, "draft_vocab_size": 32000}, 1e-4)
OURS = {"eagle3": ({"draft_vocab_size": 4096}, 1e-3), "eagle": ({}, 1e-3), "medusa": ({}, 1e-3),
        "redrafter": ({}, 1e-3), "mtp": ({}, 1e-3), "draft_target": ({"draft_layers": 2, "draft_vocab_size": 8192},
                                                                     1e-3)}


def write_pools(run: Path, public: list[str], held_out_public: int, seed: int) -> dict[str, Path]:
    """``diverse.jsonl``, ``templated.jsonl`` and the public held-out prompts in RUN (kept
    when present, so a resumed run trains on what it began with)."""
    pools = {name: run / f"{name}.jsonl" for name in ("diverse", "templated", "held_out_public")}
    if all(p.exists() for p in pools.values()):
        return pools
    rng = random.Random(seed)
    from specdec.training.data import public_prompts

    outside = public_prompts(public, max_chars=1500)
    rng.shuffle(outside)
    held, outside = outside[:held_out_public], outside[held_out_public:]
    written = [json.loads(line)["prompt"] for name in SELF_INSTRUCT
               for line in (ROOT / name).read_text().splitlines() if line.strip()]
    diverse = written + outside
    rng.shuffle(diverse)
    templated = [json.loads(line)["prompt"] for line in (ROOT / TEMPLATED).read_text().splitlines()
                 if line.strip()][:-16]
    for name, prompts in (("diverse", diverse), ("templated", templated), ("held_out_public", held)):
        pools[name].write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"pools: diverse {len(diverse)} ({len(written)} written by the target, {len(outside)} public), "
          f"templated {len(templated)}, public held out {len(held)}", file=sys.stderr)
    return pools


def train_point(method: str, out: Path, data: Path, samples: int, options: dict, lr: float, epochs: int,
                device: str, share: Path | None) -> dict:
    """One training run on the first ``samples`` items of ``data`` (answers and features
    taken from ``share``, a run on the same pool, where given)."""
    from specdec.training import TrainOptions, train

    report = out / "train_report.json"
    if report.exists():
        return json.loads(report.read_text())
    out.mkdir(parents=True, exist_ok=True)
    if share is not None:
        if not (out / "samples.jsonl").exists():
            shutil.copy(share / "samples.jsonl", out / "samples.jsonl")
        if not (out / "features").exists():
            (out / "features").symlink_to((share / "features").resolve())
    return train(TrainOptions(method=method, data=str(data), out=str(out), device=device, epochs=epochs,
                              batch_size=8, lr=lr, max_samples=samples, eval_prompts=0,
                              resume=(out / "checkpoint.pt").exists(), trainer_options=options),
                 progress=sys.stderr.isatty())


def answer_tokens(run: Path, samples: int | None = None) -> list[int]:
    """Answer tokens of each cached sample of a run."""
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    return [len(r["token_ids"]) - 1 - r["loss_start"] for r in rows[:samples]]


def held_out_sets(pools: dict[str, Path], count: int) -> dict[str, list]:
    def read(path: Path, last: bool = False) -> list:
        rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
        return [[{"role": "user", "content": p}] for p in (rows[-16:] if last else rows[:count])]

    return {"diverse.jsonl": read(ROOT / "benchmarks/diverse.jsonl"), "public": read(pools["held_out_public"]),
            "templated": read(ROOT / TEMPLATED, last=True)}


def measure(llm, prompts: list, params, plain: list) -> dict:
    outs = llm.chat(prompts, params)
    return {"acceptance_length": round(sum(len(o.token_ids) for o in outs) / sum(o.metrics.num_steps for o in outs),
                                       3),
            "same_as_plain": sum(o.token_ids == p for o, p in zip(outs, plain)), "prompts": len(outs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="working directory (pools, answers, features, drafters)")
    parser.add_argument("--public", nargs="*", default=[], help="public training sets (Alpaca-style JSON/JSONL)")
    parser.add_argument("--method", default="eagle3", choices=sorted(OURS))
    parser.add_argument("--points", nargs="+", type=int, default=[400, 800, 1600, 3200],
                        help="diverse samples per run")
    parser.add_argument("--templated", type=int, default=1600, help="templated samples (0: no templated runs)")
    parser.add_argument("--reference-point", type=int, default=1600,
                        help="samples of the reference-recipe runs (0: none; EAGLE-3 only)")
    parser.add_argument("--public-held-out", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeat", nargs=2, type=int, metavar=("SAMPLES", "EPOCHS"),
                        help="also the first SAMPLES diverse samples for EPOCHS epochs (new data against repeats)")
    parser.add_argument("--eval-tokens", type=int, default=96)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    pools = write_pools(run, args.public, args.public_held_out, args.seed)
    options, lr = OURS[args.method]
    largest = run / f"diverse-{max(args.points)}"
    epochs = args.epochs
    plan = [(largest.name, pools["diverse"], max(args.points), options, lr, epochs, None)]
    if args.templated:
        plan.append((f"templated-{args.templated}", pools["templated"], args.templated, options, lr, epochs, None))
    plan += [(f"diverse-{n}", pools["diverse"], n, options, lr, epochs, largest)
             for n in sorted(set(args.points))[:-1]]
    if args.reference_point and args.method == "eagle3":
        n = args.reference_point
        plan += [(f"reference-{n}", pools["diverse"], n, *REFERENCE, epochs, largest),
                 (f"ours-ttt7-{n}", pools["diverse"], n, {**options, "ttt_steps": 7}, lr, epochs, largest)]
    if args.repeat:
        n, times = args.repeat
        plan.append((f"diverse-{n}-x{times}", pools["diverse"], n, options, lr, times, largest))

    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.eval_tokens, temperature=0.0)
    sets = held_out_sets(pools, args.public_held_out)
    plain: dict[str, list] = {}
    done = json.loads((run / "curve.json").read_text())["runs"] if (run / "curve.json").exists() else []
    rows, started = [], time.perf_counter()

    def record(name: str, trained: dict, drafter: Path | None) -> None:
        rows.extend(r for r in done if r["run"] == name)  # measured by an earlier invocation
        if rows and rows[-1]["run"] == name:
            return
        if not plain:
            plain_llm = LLM(dtype="bfloat16", device=args.device)
            plain.update({s: [o.token_ids for o in plain_llm.chat(prompts, params)] for s, prompts in sets.items()})
        spec = {"decoding_type": args.method, "adaptive": False}
        if drafter is not None:
            spec["speculative_model"] = str(drafter)
        llm = LLM(dtype="bfloat16", device=args.device, speculative_config=spec)
        rows.append({"run": name, **{k: trained.get(k) for k in ("samples", "answer_tokens", "epochs_done", "steps",
                                                                 "lr", "train_seconds_this_run", "final_loss",
                                                                 "trainer_options")},
                     "held_out": {s: measure(llm, sets[s], params, plain[s]) for s in sets}})
        (run / "curve.json").write_text(json.dumps({"method": args.method, "runs": rows,
                                                    "seconds": round(time.perf_counter() - started)}, indent=2))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    record("shipped", {}, None)
    for i, (name, data, n, opts, rate, times, share) in enumerate(plan):
        trained = train_point(args.method, run / name, data, n, opts, rate, times, args.device, share)
        record(name, trained, run / name)
        if i == 1 and args.templated:  # diversity at equal tokens: the diverse prefix as long as the templated run
            goal, total, cut = sum(answer_tokens(run / name)), 0, 0
            for cut, tokens in enumerate(answer_tokens(largest), 1):
                total += tokens
                if total >= goal:
                    break
            if all(step[0] != f"diverse-{cut}" for step in plan):
                plan.insert(2, (f"diverse-{cut}", pools["diverse"], cut, options, lr, epochs, largest))
    lines = [f"# {args.method}: held-out acceptance length against training data (default depth, planner off, "
             f"bfloat16, greedy, {args.eval_tokens} tokens)", "",
             "| run | samples | answer tokens | epochs | steps | lr | ttt steps | draft vocabulary | diverse.jsonl | "
             "public held out | templated held out | same text |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h, o = r["held_out"], r.get("trainer_options") or {}
        same = sum(v["same_as_plain"] for v in h.values())
        total = sum(v["prompts"] for v in h.values())
        cells = [r["run"]] + [r.get(k) or "" for k in ("samples", "answer_tokens", "epochs_done", "steps", "lr")]
        cells += [o.get("ttt_steps", ""), o.get("draft_vocab_size", "")]
        cells += [h[k]["acceptance_length"] for k in ("diverse.jsonl", "public", "templated")] + [f"{same}/{total}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    (run / "curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
