"""``specdec bench``: what each method buys, measured side by side in one run.

Every method runs the same prompts (built-in sets by category, or the user's JSONL) at the
same settings; plain decoding always runs too, so each speedup is a ratio taken in the
same run. Optionally Hugging Face ``generate()`` runs as well (plain, prompt lookup, and a
layer-skip self-draft as assistant model). Results: a terminal table, JSON, PNG plots.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import attrs
import torch

from .api import LLM
from .config import SpecdecConfig, config_from_dict, load_config, unstructure
from .executor.metrics import RequestMetrics
from .prompt_sets import PROMPTS, load_jsonl, messages
from .sampling_params import SamplingParams


@attrs.define
class CategoryResult:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = attrs.Factory(list)
    tpot: list[float] = attrs.Factory(list)
    metrics: RequestMetrics = attrs.Factory(RequestMetrics)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "time_to_first_token_s": mean(self.ttft), "time_per_output_token_s": mean(self.tpot),
                "acceptance_length": self.metrics.acceptance_length,
                "per_position_acceptance": self.metrics.per_position_acceptance,
                "draft_time_share": self.metrics.draft_time / self.seconds if self.seconds else 0.0}


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def step(self, label: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<40}")
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def method_config(base: SpecdecConfig, method: str) -> tuple[str, SpecdecConfig]:
    """``plain``, a decoding_type name, or a YAML file whose speculative_config is used."""
    if method == "plain":
        return "plain", attrs.evolve(base, speculative_config=None)
    if method.endswith((".yaml", ".yml")):
        spec = load_config(method).speculative_config
        return Path(method).stem, attrs.evolve(base, speculative_config=spec)
    data = unstructure(base)
    data["speculative_config"] = {"decoding_type": method}
    return method, config_from_dict(data)


def run_llm(llm: LLM, conversations: list, params: SamplingParams, batch_size: int, res: CategoryResult) -> None:
    """One pass of a method over one category's prompts, added into ``res``."""
    for i in range(0, len(conversations), batch_size):
        batch = [llm.apply_chat_template(c) for c in conversations[i:i + batch_size]]
        started = time.perf_counter()
        outs = llm.generate(batch, params)
        res.seconds += time.perf_counter() - started
        for out in outs:
            m = out.metrics
            res.tokens += len(out.token_ids)
            res.metrics.merge(m)
            if m.time_to_first_token is not None:
                res.ttft.append(m.time_to_first_token)
            if len(out.token_ids) > 1 and m.finish_time and m.first_token_time:
                res.tpot.append((m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))


def hf_systems(llm: LLM, max_tokens: int, assistant_layers: int) -> dict:
    """HF generate() on the same weights: plain, prompt lookup, layer-skip assistant (greedy, batch 1)."""
    from transformers import AutoModelForCausalLM

    # Separate copies with the stock attention: the specdec one runs only inside engine steps.
    path, dtype, device = llm.target.model.config._name_or_path, llm.target.dtype, llm.target.device
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    assistant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                     num_hidden_layers=assistant_layers).to(device).eval()

    def system(**extra):
        def run(conversations: list, res: CategoryResult) -> None:
            for conv in conversations:
                ids = torch.tensor([llm.apply_chat_template(conv)], device=device)
                started = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=llm.tokenizer.eos_token_id, **extra)
                res.seconds += time.perf_counter() - started
                res.tokens += out.shape[1] - ids.shape[1]
        return run

    return {"HF generate": system(), "HF prompt lookup": system(prompt_lookup_num_tokens=10),
            f"HF assistant ({assistant_layers} layers)": system(assistant_model=assistant)}


def print_table(report: dict, file=sys.stdout) -> None:
    cats = report["categories"]
    print(f"{'method':<28}{'category':<18}{'tok/s':>8}{'speedup':>9}{'TTFT ms':>9}{'TPOT ms':>9}{'acc.len':>8}"
          f"{'draft%':>8}  per-position acceptance", file=file)
    for method, per_cat in report["results"].items():
        for cat in cats + ["all"]:
            r = per_cat.get(cat)
            if r is None:
                continue
            ms = lambda x: f"{x * 1000:.0f}" if x is not None else "-"  # noqa: E731
            pos = " ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", [])[:8])
            print(f"{method:<28}{cat:<18}{r['tokens_per_s']:>8.1f}{r['speedup_vs_plain']:>8.2f}x"
                  f"{ms(r.get('time_to_first_token_s')):>9}{ms(r.get('time_per_output_token_s')):>9}"
                  f"{r.get('acceptance_length', 0):>8.2f}{100 * r.get('draft_time_share', 0):>7.1f}%  {pos}", file=file)


def plot(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    methods = [m for m in report["results"] if m != "plain"]
    cats = report["categories"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cats)), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        vals = [report["results"][m].get(c, {}).get("speedup_vs_plain", 0) for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("speedup vs specdec plain (same run)")
    ax.legend()
    fig.tight_layout()
    speed = out_dir / "speedup.png"
    fig.savefig(speed, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        pos = report["results"][m].get("all", {}).get("per_position_acceptance", [])
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=m)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    acc = out_dir / "acceptance.png"
    fig.savefig(acc, dpi=110)
    plt.close(fig)
    return [speed, acc]


def _with_all(per_cat: dict[str, CategoryResult]) -> dict[str, CategoryResult]:
    total = CategoryResult()
    for r in per_cat.values():
        total.tokens += r.tokens
        total.seconds += r.seconds
        total.ttft += r.ttft
        total.tpot += r.tpot
        total.metrics.merge(r.metrics)
    return {**per_cat, "all": total}


def run_bench(base: SpecdecConfig, methods: list[str], dataset: str | None, categories: list[str] | None,
              batch_size: int, temperature: float, max_tokens: int, repetitions: int, compare_hf: bool,
              assistant_layers: int = 6) -> dict:
    prompt_sets = load_jsonl(dataset) if dataset else {c: messages(c) for c in PROMPTS}
    if categories:
        unknown = sorted(set(categories) - set(prompt_sets))
        if unknown:
            raise ValueError(f"unknown categories {unknown}; available: {sorted(prompt_sets)}")
        prompt_sets = {c: prompt_sets[c] for c in categories}
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
    names = ["plain"] + [m for m in methods if m != "plain"]
    llms = {}
    for label, cfg in (method_config(base, m) for m in names):
        llms[label] = LLM(config=cfg)
        llms[label].generate([llms[label].apply_chat_template(messages("chat")[0])],
                             SamplingParams(max_tokens=4, temperature=0.0))
    first_llm = llms["plain"]
    systems = hf_systems(first_llm, max_tokens, assistant_layers) if compare_hf else {}
    runners = {label: (lambda convs, res, llm=llm: run_llm(llm, convs, params, batch_size, res))
               for label, llm in llms.items()}
    runners.update(systems)
    raw: dict[str, dict[str, CategoryResult]] = {name: {c: CategoryResult() for c in prompt_sets} for name in runners}
    progress = Progress(repetitions * len(prompt_sets) * len(runners))
    # Interleaved, category by category, so a machine that slows down mid-run biases no method.
    for _ in range(repetitions):
        for category, conversations in prompt_sets.items():
            for name, run in runners.items():
                run(conversations, raw[name][category])
                progress.step(f"{name}: {category}")
    raw = {name: _with_all(per_cat) for name, per_cat in raw.items()}
    results = {}
    for name, per_cat in raw.items():
        results[name] = {}
        for cat, r in per_cat.items():
            s = r.summary()
            plain = raw["plain"][cat].tokens_per_s
            s["speedup_vs_plain"] = s["tokens_per_s"] / plain if plain else 0.0
            results[name][cat] = s
    return {"model": first_llm.target.name, "dtype": str(first_llm.dtype).replace("torch.", ""),
            "device": str(first_llm.device), "threads": torch.get_num_threads(), "batch_size": batch_size,
            "temperature": temperature, "max_tokens": max_tokens, "repetitions": repetitions,
            "categories": list(prompt_sets), "results": results}


def write_json(report: dict, path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=2))
