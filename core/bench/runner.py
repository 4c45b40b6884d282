"""``specdec bench``: what each method buys, measured side by side in one run.

Every method runs the same prompts (built-in sets by category, or the user's JSONL) at the
same settings; plain decoding always runs too, so each speedup is a ratio taken in the
same run. Optionally Hugging Face ``generate()`` runs as well (plain, prompt lookup, and a
layer-skip self-draft as assistant model), and llama.cpp on the GGUF file the target came
from: its Python bindings (plain, and their prompt-lookup drafting), or native
``llama-server`` (plain, and its own n-gram speculation) with ``llama-bench``'s figures.
Every system's token ids are compared with specdec plain decoding's ("same"). Results: a
terminal table, JSON, PNG plots.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import torch
import yaml

from ..api import LLM
from ..config import SpecdecConfig
from ..config_loading import config_from_dict, load_config, unstructure
from ..executor.metrics import RequestMetrics
from ..model.loading import gguf_file
from ..sampling_params import SamplingParams
from .llama_cpp_bindings import LlamaCppWorker, require_bindings
from .llama_cpp_native import LlamaServer, find_binaries, llama_bench
from .prompt_sets import PROMPTS, Turns, load_jsonl, messages

#: The warm-up request of every method: outside every measured set, so no drafter starts
#: a measurement knowing its answer.
WARMUP = [{"role": "user", "content": "Reply with one word: ready?"}]


@attrs.define
class CategoryResult:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = attrs.Factory(list)
    tpot: list[float] = attrs.Factory(list)
    latency: list[float] = attrs.Factory(list)
    metrics: RequestMetrics = attrs.Factory(RequestMetrics)
    outputs: list[list[int]] | None = None  # token ids of each request, in order (specdec methods)
    identical: int | None = None  # outputs equal to plain decoding's
    by_repetition: list[tuple[int, float]] = attrs.Factory(list)  # (tokens, seconds) of each repetition

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s_by_repetition(self) -> list[float]:
        return [t / s if s else 0.0 for t, s in self.by_repetition]

    def summary(self) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"tokens": self.tokens, "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_by_repetition": self.tokens_per_s_by_repetition,
                "time_to_first_token_s": mean(self.ttft), "time_per_output_token_s": mean(self.tpot),
                "request_latency_s": mean(self.latency),
                "identical_to_plain": None if self.identical is None else f"{self.identical}/{len(self.outputs)}",
                "acceptance_length": self.metrics.acceptance_length,
                "per_position_acceptance": self.metrics.per_position_acceptance,
                "draft_time_share": self.metrics.draft_time / self.seconds if self.seconds else 0.0,
                "grammar_ms_per_step": (1e3 * self.metrics.grammar_time / self.metrics.num_steps
                                        if self.metrics.num_steps else 0.0),
                "mean_draft_len": self.metrics.mean_draft_len,
                "speculation_off_share": (self.metrics.num_steps_speculation_off / self.metrics.num_steps
                                          if self.metrics.num_steps else 0.0),
                "drafter_faults": self.metrics.num_drafter_faults, "lossless": self.metrics.lossless,
                # prompt tokens found in the prefix cache (specdec's methods): a multi-turn set's earlier turns
                "prefix_cache_hit_rate": (self.metrics.num_cached_prompt_tokens / self.metrics.num_prompt_tokens
                                          if self.metrics.num_prompt_tokens else None)}


def method_config(base: SpecdecConfig, method: str) -> tuple[str, SpecdecConfig]:
    """``plain``, a decoding_type name, or a YAML file whose speculative_config is used,
    and the engine options it sets (over the run's: ``engine: {batch_invariant: true}``)."""
    if method == "plain":
        return "plain", attrs.evolve(base, speculative_config=None)
    if method.endswith((".yaml", ".yml")):
        own = load_config(method)
        engine = yaml.safe_load(Path(method).read_text()).get("engine") or {}
        engine = attrs.evolve(base.engine, **{key: getattr(own.engine, key) for key in engine})
        return Path(method).stem, attrs.evolve(base, speculative_config=own.speculative_config, engine=engine)
    data = unstructure(base)
    data["speculative_config"] = {"decoding_type": method}
    return method, config_from_dict(data)


def concurrent_requests(conversations: list, batch_size: int) -> list:
    """A category's requests at ``batch_size``: its prompts, and where it has fewer than
    ``batch_size`` of them, copies made distinct by a numbered prefix of the last user
    message ("(request 3) ..."), so a batch of N is N different requests."""
    out = list(conversations)
    for j in range(len(conversations), batch_size):
        conv = conversations[j % len(conversations)]
        if isinstance(conv, Turns):  # the first turn numbered, the rest answered as they come
            out.append(Turns([{**conv[0], "content": f"(request {j + 1}) {conv[0]['content']}"}, *conv[1:]]))
        else:
            out.append([*conv[:-1], {**conv[-1], "content": f"(request {j + 1}) {conv[-1]['content']}"}])
    return out


def run_llm(llm: LLM, conversations: list, params: SamplingParams, batch_size: int, res: CategoryResult) -> None:
    """One pass of a method over one category's requests, ``batch_size`` submitted
    together, added into ``res`` (throughput over the batch's wall time). Multi-turn
    conversations (:class:`Turns`) go turn by turn: each batch of next turns carries the
    turns before it with the method's own answers."""
    res.outputs = res.outputs if res.outputs is not None else []
    for i in range(0, len(conversations), batch_size):
        group = conversations[i:i + batch_size]
        turns = [c if isinstance(c, Turns) else [c] for c in group]  # a plain one: one turn of all it holds
        histories: list[list[dict]] = [[] for _ in group]
        for turn in range(max(len(t) for t in turns)):
            asked = [k for k, t in enumerate(turns) if turn < len(t)]
            for k in asked:
                histories[k] += [turns[k][turn]] if isinstance(group[k], Turns) else group[k]
            outs = _run_batch(llm, [llm.apply_chat_template(histories[k]) for k in asked], params, res)
            for k, out in zip(asked, outs):
                histories[k].append({"role": "assistant", "content": out.text})


def _run_batch(llm: LLM, prompts: list[str], params: SamplingParams, res: CategoryResult) -> list:
    """One batch generated together, its figures added into ``res``; its outputs."""
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    res.seconds += time.perf_counter() - started
    for out in outs:
        m = out.metrics
        res.tokens += len(out.token_ids)
        res.outputs.append(out.token_ids)
        res.metrics.merge(m)
        if m.time_to_first_token is not None:
            res.ttft.append(m.time_to_first_token)
        if m.finish_time:
            res.latency.append(m.finish_time - m.arrival_time)
        if len(out.token_ids) > 1 and m.finish_time and m.first_token_time:
            res.tpot.append((m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))
    return outs


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
            res.outputs = res.outputs if res.outputs is not None else []
            for conv in conversations:
                ids = torch.tensor([llm.apply_chat_template(conv)], device=device)
                started = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=llm.tokenizer.eos_token_id, **extra)
                res.seconds += time.perf_counter() - started
                res.tokens += out.shape[1] - ids.shape[1]
                res.outputs.append(out[0, ids.shape[1]:].tolist())
        return run

    return {"HF generate": system(), "HF prompt lookup": system(prompt_lookup_num_tokens=10),
            f"HF assistant ({assistant_layers} layers)": system(assistant_model=assistant)}


#: the bindings' plain decoding in a report
LLAMA_CPP_PLAIN = "llama.cpp"
#: llama-server's systems: its plain decoding and its own speculation types
LLAMA_SERVER_SYSTEMS = {"llama-server": (), "llama-server ngram-mod": ("--spec-type", "ngram-mod"),
                        "llama-server ngram-map-k": ("--spec-type", "ngram-map-k"),
                        "llama-server ngram-cache": ("--spec-type", "ngram-cache")}


def llama_cpp_systems(llm: LLM, gguf: Path, max_tokens: int, batch_size: int = 1) -> dict:
    """llama.cpp (``llama-cpp-python``) on ``gguf`` in a process of its own
    (:mod:`specdec.bench.llama_cpp_bindings`), as many threads as torch: plain greedy decoding
    (a batch's sequences decoded together where ``batch_size`` > 1) and its prompt-lookup
    drafting, one request at a time. The worker ends with the process."""
    require_bindings()
    worker = LlamaCppWorker(gguf, min(llm.target.max_model_len, 4096), torch.get_num_threads(), max_tokens,
                            llm.target.eos_token_ids, batch_size)

    def system(name: str):
        def run(conversations: list, res: CategoryResult) -> None:
            seconds, outputs = worker.run(name, [llm.apply_chat_template(conv) for conv in conversations])
            res.outputs = (res.outputs if res.outputs is not None else []) + outputs
            res.seconds += seconds
            res.tokens += sum(map(len, outputs))
        return run

    return {LLAMA_CPP_PLAIN: system("plain"), "llama.cpp prompt lookup": system("prompt lookup")}


def llama_cpp_native_systems(llm: LLM, gguf: Path, max_tokens: int, batch_size: int = 1,
                             bin_dir: str | None = None) -> tuple[dict, dict]:
    """Native llama.cpp on ``gguf`` (:mod:`specdec.bench.llama_cpp_native`), as many threads as
    torch: a ``llama-server`` per system of :data:`LLAMA_SERVER_SYSTEMS` with ``batch_size``
    parallel slots, each request timed at the client (a batch's requests sent together),
    and ``llama-bench``'s prefill and decode figures. The servers stop with the process."""
    found = find_binaries(bin_dir)
    threads = torch.get_num_threads()
    figures = llama_bench(found, gguf, threads)
    eos = llm.target.eos_token_ids
    n_ctx = min(llm.target.max_model_len, 4096)
    systems = {}
    for name, extra in LLAMA_SERVER_SYSTEMS.items():
        server = LlamaServer(found, gguf, threads, n_ctx, batch_size, extra)
        weakref.finalize(server, server.close)

        def run(conversations: list, res: CategoryResult, server=server) -> None:
            prompts = [llm.apply_chat_template(conv) for conv in conversations]
            started = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                outputs = list(pool.map(lambda ids: server.complete(ids, max_tokens), prompts))
            res.seconds += time.perf_counter() - started
            outputs = [out[:-1] if out and out[-1] in eos else out for out in outputs]
            res.outputs = (res.outputs if res.outputs is not None else []) + outputs
            res.tokens += sum(map(len, outputs))
        systems[name] = run
    return systems, figures


def is_llama_cpp(name: str) -> bool:
    return name.startswith(("llama.cpp", "llama-server"))


def llama_cpp_headline(report: dict) -> str | None:
    """With llama.cpp in the run: the fastest specdec system over all categories against
    the fastest llama.cpp configuration (None without llama.cpp)."""
    results, theirs = report["results"], report.get("llama_cpp_best")
    if theirs is None:
        return None
    ours = {name: r["all"] for name, r in results.items() if not is_llama_cpp(name) and "all" in r}
    best = max(ours, key=lambda name: ours[name]["tokens_per_s"])
    return (f"headline: {best} {ours[best]['tokens_per_s']:.1f} tok/s = "
            f"{ours[best]['speedup_vs_llama_cpp']:.2f}x {theirs} ({results[theirs]['all']['tokens_per_s']:.1f} "
            "tok/s), the fastest llama.cpp configuration in the run, over all categories")


def print_table(report: dict, file=None) -> None:
    """The report as a table on ``file`` (standard output as it is at the call): ``range``
    is the lowest and highest speedup over the repetitions; with llama.cpp in the run, a
    headline against its plain decoding first and a ``vs l.cpp`` column; a note follows
    where batched outputs differ from plain decoding's."""
    file = file or sys.stdout
    cats = report["categories"]
    headline = llama_cpp_headline(report)
    if headline:
        print(headline, file=file)
    print(f"{'method':<28}{'category':<18}{'tok/s':>8}{'speedup':>9}{'range':>11}"
          f"{'vs l.cpp' if headline else '':>9}{'TTFT ms':>9}{'TPOT ms':>9}"
          f"{'acc.len':>8}{'draft%':>8}{'k':>6}{'off%':>6}{'cache%':>7}{'faults':>7}{'same':>7}"
          "  per-position acceptance", file=file)
    differ = []
    for method, per_cat in report["results"].items():
        same = per_cat["all"].get("identical_to_plain")
        if same and same.split("/")[0] != same.split("/")[1]:
            differ.append(method)
        if not per_cat["all"].get("lossless", True):  # an opt-in lossy acceptance rule decided some tokens
            method = f"{method} (LOSSY)"
        for cat in cats + ["all"]:
            r = per_cat.get(cat)
            if r is None:
                continue
            ms = lambda x: f"{x * 1000:.0f}" if x is not None else "-"  # noqa: E731
            pos = " ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", [])[:8])
            reps = r.get("speedup_by_repetition") or []
            spread = f"{min(reps):.2f}-{max(reps):.2f}" if len(reps) > 1 else "-"
            versus = f"{r['speedup_vs_llama_cpp']:.2f}x" if headline else ""
            hits = r.get("prefix_cache_hit_rate")
            cached = f"{100 * hits:.0f}%" if hits is not None else "-"
            print(f"{method:<28}{cat:<18}{r['tokens_per_s']:>8.1f}{r['speedup_vs_plain']:>8.2f}x{spread:>11}{versus:>9}"
                  f"{ms(r.get('time_to_first_token_s')):>9}{ms(r.get('time_per_output_token_s')):>9}"
                  f"{r.get('acceptance_length', 0):>8.2f}{100 * r.get('draft_time_share', 0):>7.1f}%"
                  f"{r.get('mean_draft_len', 0):>6.1f}{100 * r.get('speculation_off_share', 0):>5.0f}%"
                  f"{cached:>7}{r.get('drafter_faults', 0):>7}{r.get('identical_to_plain') or '-':>7}  {pos}",
                  file=file)
    bench_figures = report.get("llama_bench")
    if bench_figures:
        print("llama-bench (native, same GGUF and threads): " + ", ".join(
            f"{kind} {f['tokens']} tokens {f['tokens_per_s']:.1f} +- {f['stddev']:.1f} tok/s"
            for kind, f in bench_figures.items()), file=file)
    if report.get("json_schema"):
        costs = ", ".join(f"{method} {per_cat['all'].get('grammar_ms_per_step', 0):.2f}"
                          for method, per_cat in report["results"].items())
        print(f"every answer follows --json-schema; grammar masks, ms per decode step: {costs}", file=file)
    if differ and report.get("batch_size", 1) > 1:
        print(f"note: outputs of {', '.join(differ)} differ from plain decoding's (a token's logits change in "
              "their last bits with what shares its forward, and near-ties flip), so at batch > 1 their throughput "
              "is taken over other texts and lengths; --set engine.batch_invariant=true compares identical work",
              file=file)


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
        total.latency += r.latency
        total.metrics.merge(r.metrics)
        if r.outputs is not None:
            total.outputs = (total.outputs or []) + r.outputs
            total.identical = (total.identical or 0) + (r.identical or 0)
        total.by_repetition = [(a + t, b + s) for (a, b), (t, s) in
                               zip(total.by_repetition or [(0, 0.0)] * len(r.by_repetition), r.by_repetition)]
    return {**per_cat, "all": total}


def _prompt_sets(dataset: str | None, categories: list[str] | None, batch_size: int) -> dict[str, list]:
    """Category -> its conversations (the user's JSONL or the built-in sets), repeated to
    fill whole batches of concurrent requests."""
    prompt_sets = load_jsonl(dataset) if dataset else {c: messages(c) for c in PROMPTS}
    if categories:
        unknown = sorted(set(categories) - set(prompt_sets))
        if unknown:
            raise ValueError(f"unknown categories {unknown}; available: {sorted(prompt_sets)}")
        prompt_sets = {c: prompt_sets[c] for c in categories}
    return {c: concurrent_requests(convs, batch_size) for c, convs in prompt_sets.items()}


def _check_comparisons(base: SpecdecConfig, prompt_sets: dict, compare_hf: bool, compare_llama_cpp: str | None,
                       json_schema: dict | None) -> Path | None:
    """Refuse comparisons the run cannot make fairly; the GGUF file llama.cpp runs, if asked."""
    gguf = gguf_file(base.model) if compare_llama_cpp else None
    if compare_llama_cpp and gguf is None:
        raise ValueError("--llama-cpp runs the GGUF file the target comes from: use the embedded model or "
                         "--model FILE.gguf")
    if compare_hf and base.engine.tensor_parallel_size > 1:
        raise ValueError("--hf runs transformers' generate() on the target, which is sharded under tensor "
                         "parallelism; leave out --hf or --tensor-parallel-size")
    if (compare_hf or compare_llama_cpp) and any(isinstance(c, Turns) for cs in prompt_sets.values() for c in cs):
        raise ValueError("multi-turn sets ({\"turns\": ...}) run on specdec's methods only: leave out --hf and "
                         "--llama-cpp")
    if json_schema is not None and (compare_hf or compare_llama_cpp):
        raise ValueError("--json-schema constrains specdec's methods only: leave out --hf and --llama-cpp")
    return gguf


def _comparison_systems(plain: LLM, compare_hf: bool, compare_llama_cpp: str | None, gguf: Path | None,
                        max_tokens: int, batch_size: int, assistant_layers: int,
                        llama_cpp_bin: str | None) -> tuple[dict, dict | None]:
    """The other systems' runners (transformers, llama.cpp) and llama-bench's figures."""
    systems = hf_systems(plain, max_tokens, assistant_layers) if compare_hf else {}
    bench_figures = None
    if compare_llama_cpp == "native":
        native, bench_figures = llama_cpp_native_systems(plain, gguf, max_tokens, batch_size, llama_cpp_bin)
        systems.update(native)
        try:
            require_bindings()
        except ValueError:
            return systems, bench_figures  # the bindings are one more row where installed
    if compare_llama_cpp:
        systems.update(llama_cpp_systems(plain, gguf, max_tokens, batch_size))
    return systems, bench_figures


def _summaries(raw: dict[str, dict[str, CategoryResult]]) -> tuple[dict, str | None]:
    """Each system's figures by category with its ratios to plain decoding and to the
    fastest llama.cpp configuration; that configuration's name."""
    for per_cat in raw.values():
        for cat, r in per_cat.items():
            if r.outputs is not None:
                r.identical = sum(a == b for a, b in zip(r.outputs, raw["plain"][cat].outputs))
    raw = {name: _with_all(per_cat) for name, per_cat in raw.items()}
    llama_cpp_best = max((name for name in raw if is_llama_cpp(name)), default=None,
                         key=lambda name: raw[name]["all"].tokens_per_s)
    results = {}
    for name, per_cat in raw.items():
        results[name] = {}
        for cat, r in per_cat.items():
            s = r.summary()
            plain_rate = raw["plain"][cat].tokens_per_s
            s["speedup_vs_plain"] = s["tokens_per_s"] / plain_rate if plain_rate else 0.0
            # the spread of a ratio over repetitions is the run's own measure of its noise
            s["speedup_by_repetition"] = [mine / theirs if theirs else 0.0 for mine, theirs in zip(
                s["tokens_per_s_by_repetition"], raw["plain"][cat].tokens_per_s_by_repetition)]
            if llama_cpp_best is not None:  # the CPU user's alternative: the ratio that matters most there
                theirs = raw[llama_cpp_best][cat].tokens_per_s
                s["speedup_vs_llama_cpp"] = s["tokens_per_s"] / theirs if theirs else 0.0
            results[name][cat] = s
    return results, llama_cpp_best


def run_bench(base: SpecdecConfig, methods: list[str], dataset: str | None, categories: list[str] | None,
              batch_size: int, temperature: float, max_tokens: int, repetitions: int, compare_hf: bool,
              assistant_layers: int = 6, compare_llama_cpp: str | None = None, json_schema: dict | None = None,
              llama_cpp_bin: str | None = None) -> dict:
    """``compare_llama_cpp``: ``bindings`` (llama-cpp-python) or ``native`` (llama-server and
    llama-bench, built once if needed, with the bindings too where installed). Requests
    sample as ``base.sampling`` says (``--top-p``, ``--top-k``, ``--seed`` and a config
    file's ``sampling``) at ``temperature``, for ``max_tokens``, with seed 0 where it gives
    none: a seeded method's output is then plain decoding's, which the table checks."""
    from tqdm import tqdm  # the progress bar `specdec train` uses too: rate and ETA

    prompt_sets = _prompt_sets(dataset, categories, batch_size)
    gguf = _check_comparisons(base, prompt_sets, compare_hf, compare_llama_cpp, json_schema)
    given = base.sampling
    params = attrs.evolve(given, max_tokens=max_tokens, temperature=temperature,
                          seed=given.seed if given.seed is not None else 0,
                          structured_outputs={"json": json_schema} if json_schema is not None else None)
    names = ["plain"] + [m for m in methods if m != "plain"]
    configs = dict(method_config(base, m) for m in names)

    def fresh_llms() -> dict[str, LLM]:
        """Every method with a fresh drafter (pools, draft caches), warmed up outside the sets."""
        llms = {label: LLM(config=cfg) for label, cfg in configs.items()}
        for llm in llms.values():
            llm.generate([llm.apply_chat_template(WARMUP)], SamplingParams(max_tokens=4, temperature=0.0))
        return llms

    llms = fresh_llms()
    systems, bench_figures = _comparison_systems(llms["plain"], compare_hf, compare_llama_cpp, gguf, max_tokens,
                                                 batch_size, assistant_layers, llama_cpp_bin)
    labels = list(llms) + list(systems)
    raw: dict[str, dict[str, CategoryResult]] = {name: {c: CategoryResult() for c in prompt_sets} for name in labels}
    # Interleaved batch by batch (a category's next ``batch_size`` requests), in an order that
    # rotates from one batch to the next: neither a machine that slows down mid-run nor a
    # system's place in the order biases a method, also on a one-category set.
    turns = [(category, conversations[i:i + batch_size]) for category, conversations in prompt_sets.items()
             for i in range(0, len(conversations), batch_size)]
    progress = tqdm(total=repetitions * len(turns) * len(labels), desc="bench", unit="batch", file=sys.stderr)

    def run_repetition(rep: int, llms: dict[str, LLM]) -> None:
        """Every system over every category once; the runners, which hold the engines, end
        with it."""
        runners = {label: (lambda convs, res, llm=llm: run_llm(llm, convs, params, batch_size, res))
                   for label, llm in llms.items()}
        runners.update(systems)
        order = list(runners.items())
        before = {(name, category): (raw[name][category].tokens, raw[name][category].seconds)
                  for name in runners for category in prompt_sets}
        for turn, (category, batch) in enumerate(turns, start=rep * len(turns)):
            shift = turn % len(order)
            for name, run in order[shift:] + order[:shift]:
                progress.set_postfix_str(f"{name}: {category}")
                run(batch, raw[name][category])
                progress.update(1)
        for (name, category), (tokens, seconds) in before.items():
            res = raw[name][category]
            res.by_repetition.append((res.tokens - tokens, res.seconds - seconds))

    for rep in range(repetitions):
        if rep:  # a repetition must not find the previous one's answers in a drafter's pool
            # The previous engines go before new ones are built (ten methods' engines twice
            # over ran a 23 GB machine out of memory).
            llms = None
            gc.collect()
            llms = fresh_llms()
        run_repetition(rep, llms)
    progress.close()
    results, llama_cpp_best = _summaries(raw)
    plain = llms["plain"]
    return {"model": plain.target.name, "dtype": str(plain.dtype).replace("torch.", ""), "device": str(plain.device),
            "quantization": plain.config.engine.quantization, "threads": torch.get_num_threads(),
            "batch_size": batch_size,
            "temperature": temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": params.seed,
            "max_tokens": max_tokens, "repetitions": repetitions,
            "json_schema": json_schema is not None,
            "categories": list(prompt_sets), "results": results, "llama_cpp_best": llama_cpp_best,
            "llama_bench": bench_figures,
            "batch_invariant": {label: llm.engine.batch_invariant for label, llm in llms.items()}}


def sampling_line(report: dict) -> str:
    """How the requests sampled, for the table's header: the settings that shape the
    distribution (top-p and top-k where they cut it) and the seed."""
    cuts = [f"top_p {report['top_p']}" if report["top_p"] < 1.0 else "",
            f"top_k {report['top_k']}" if report["top_k"] else ""]
    return ", ".join([f"temperature {report['temperature']}", *filter(None, cuts), f"seed {report['seed']}"])


def numerics_line(report: dict) -> str:
    """Which methods ran in the batch-invariant numerics mode (``engine.batch_invariant``,
    ``auto`` by default: on or off by machine and dtype), for the report's header."""
    modes = report["batch_invariant"]
    on = [label for label, mode in modes.items() if mode]
    if not on or len(on) == len(modes):
        return f"numerics: {'batch-invariant' if on else 'stock'}"
    return f"numerics: batch-invariant for {', '.join(on)}; stock for the rest"


def write_json(report: dict, path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=2))
