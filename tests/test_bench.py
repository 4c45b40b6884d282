"""`specdec bench` end to end on the embedded model."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest
from helpers import specdec_cli as specdec
from helpers import specdec_main

from specdec import SamplingParams


def eager_default():
    """The default target eager (``compile: false``): the bench's behaviour is checked here,
    not the compiled graph, and it decodes four times as fast as float32."""
    from specdec.config_loading import config_from_dict

    return config_from_dict({"engine": {"compile": False}})


def test_bench_builtin_sets_table_json_and_plots(tmp_path):
    out = tmp_path / "report.json"
    ngram_file = tmp_path / "ngram.yaml"  # drafting every step: acceptance must not depend on the machine's load
    ngram_file.write_text("speculative_config: {decoding_type: ngram, adaptive: false}\n")
    result = specdec("bench", str(ngram_file), "--categories", "summarization", "chat", "--max-tokens", "24",
                     "--dtype", "float32", "--json", str(out), "--plots", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and "ngram" in result.stdout
    assert "bench: 100%" in result.stderr and "4/4" in result.stderr  # the progress bar finished
    report = json.loads(out.read_text())
    assert report["categories"] == ["summarization", "chat"]
    plain, ngram = report["results"]["plain"], report["results"]["ngram"]
    for cat in ("summarization", "chat", "all"):
        assert abs(ngram[cat]["speedup_vs_plain"] - ngram[cat]["tokens_per_s"] / plain[cat]["tokens_per_s"]) < 1e-9
        assert ngram[cat]["time_to_first_token_s"] > 0 and ngram[cat]["time_per_output_token_s"] > 0
    assert ngram["summarization"]["acceptance_length"] > 1.0
    assert len(ngram["all"]["per_position_acceptance"]) == 12
    assert 0.0 <= ngram["all"]["draft_time_share"] < 1.0
    # float32: speculative output is the plain output, and the report says so per method
    assert ngram["all"]["identical_to_plain"] == plain["all"]["identical_to_plain"] == "2/2"
    assert ngram["all"]["drafter_faults"] == 0 and ngram["all"]["request_latency_s"] > 0
    # float32: engine.batch_invariant's auto default leaves stock numerics, and the header says so
    assert report["batch_invariant"] == {"plain": False, "ngram": False} and "numerics: stock" in result.stdout
    for name in ("speedup.png", "acceptance.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_user_jsonl_and_its_errors(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Repeat: red green blue. red green blue.", "category": "repeat"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Say hi."}]}) + "\n")
    out = tmp_path / "r.json"
    result = specdec_main("bench", "ngram", "--dataset", str(data), "--max-tokens", "8",
                     "--set", "engine.compile=false", "--batch-size", "3", "--repetitions", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["categories"] == ["repeat", "custom"] and report["batch_size"] == 3
    # three distinct concurrent requests per category, in each of two repetitions
    assert report["results"]["ngram"]["repeat"]["identical_to_plain"] == "6/6"
    for cat in ("repeat", "custom", "all"):  # each repetition's own ratio: the run's noise
        ngram, plain = report["results"]["ngram"][cat], report["results"]["plain"][cat]
        assert plain["speedup_by_repetition"] == [1.0, 1.0]
        assert ngram["speedup_by_repetition"] == [
            a / b for a, b in zip(ngram["tokens_per_s_by_repetition"], plain["tokens_per_s_by_repetition"])]
        assert min(ngram["tokens_per_s_by_repetition"]) <= ngram["tokens_per_s"] <= max(
            ngram["tokens_per_s_by_repetition"])
    assert f"{min(ngram['speedup_by_repetition']):.2f}-{max(ngram['speedup_by_repetition']):.2f}" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    result = specdec_main("bench", "--dataset", str(bad))
    assert result.returncode == 2 and "bad.jsonl:1: expected" in result.stderr
    result = specdec_main("bench", "--categories", "poetry")
    assert result.returncode == 2 and "unknown categories ['poetry']" in result.stderr


def test_a_repetition_frees_the_engines_of_the_one_before(tmp_path, monkeypatch):
    import gc
    import weakref

    from specdec.bench import runner as bench

    alive, seen = weakref.WeakSet(), []

    class CountedLLM(bench.LLM):
        def __init__(self, *args, **kwargs):
            gc.collect()
            seen.append(len(alive))  # engines still alive as this one is built
            super().__init__(*args, **kwargs)
            alive.add(self)

    monkeypatch.setattr(bench, "LLM", CountedLLM)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    bench.run_bench(eager_default(), ["ngram"], str(data), None, batch_size=1,
                    temperature=0.0, max_tokens=4, repetitions=3, compare_hf=False)
    assert seen == [0, 1] * 3  # plain, then ngram, in each repetition: never the last one's engines


def test_systems_take_turns_batch_by_batch_in_a_rotating_order(tmp_path, monkeypatch):
    from specdec.bench import runner as bench

    calls = []
    run_llm = bench.run_llm

    def recorded(llm, conversations, params, batch_size, res):
        name = "plain" if llm.config.speculative_config is None else "ngram"
        calls.append((name, conversations[0][-1]["content"]))
        run_llm(llm, conversations, params, batch_size, res)

    monkeypatch.setattr(bench, "run_llm", recorded)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {word}."}) + "\n" for word in ("one", "two", "three", "four")))
    report = bench.run_bench(eager_default(), ["ngram"], str(data), None, batch_size=2,
                             temperature=0.0, max_tokens=2, repetitions=2, compare_hf=False)
    # one category of two batches: every batch is a turn, and each turn starts one system later
    assert calls == [("plain", "Say one."), ("ngram", "Say one."), ("ngram", "Say three."), ("plain", "Say three."),
                     ("plain", "Say one."), ("ngram", "Say one."), ("ngram", "Say three."), ("plain", "Say three.")]
    plain = report["results"]["plain"]["custom"]
    assert len(plain["tokens_per_s_by_repetition"]) == 2 and plain["tokens"] == 2 * 4 * 2


def test_requests_sample_as_the_command_line_and_config_say(tmp_path, monkeypatch):
    """``--top-p``, ``--top-k`` and ``--seed`` reach every request (seed 0 where none is
    given, so that seeded speculative output can be compared with plain decoding's), and
    the header says how the run sampled."""
    from specdec.bench import runner as bench
    from specdec.cli import _resolve_config, build_parser

    seen = []
    monkeypatch.setattr(bench, "run_llm", lambda llm, conversations, params, batch_size, res: seen.append(params))
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Say one."}) + "\n")
    for flags, want in ((["--top-p", "0.9", "--top-k", "40", "--seed", "7"], (0.9, 40, 7)), ([], (1.0, 0, 0))):
        seen.clear()
        args = build_parser().parse_args(["bench", "--dataset", str(data), "--set", "engine.compile=false", *flags])
        report = bench.run_bench(_resolve_config(args), [], str(data), None, batch_size=1, temperature=0.7,
                                 max_tokens=2, repetitions=1, compare_hf=False)
        assert {(p.top_p, p.top_k, p.seed, p.temperature, p.max_tokens) for p in seen} == {(*want, 0.7, 2)}
        assert (report["top_p"], report["top_k"], report["seed"]) == want
    assert bench.sampling_line(report) == "temperature 0.7, seed 0"
    assert bench.sampling_line({**report, "top_p": 0.9, "top_k": 40}) == "temperature 0.7, top_p 0.9, top_k 40, seed 0"


def test_a_multi_turn_set_answers_each_turn_with_the_answers_before_it(tmp_path, monkeypatch):
    """``{"turns": [...]}`` lines: each turn goes out with the earlier turns and the method's
    own answers to them, turn by turn across the batch; single-turn lines beside them."""
    from specdec import LLM
    from specdec.bench import runner as bench
    from specdec.bench.prompt_sets import Turns, load_jsonl

    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps({"turns": ["Say one.", "Say two.", "Say three."], "category": "agent"}) + "\n"
                    + json.dumps({"prompt": "Say hi.", "category": "agent"}) + "\n")
    (agent,) = load_jsonl(str(data)).values()
    assert isinstance(agent[0], Turns) and len(agent[0]) == 3
    sent = []
    generate = LLM.generate

    def recorded(llm, prompts, params):
        sent.append(list(prompts))
        return generate(llm, prompts, params)

    monkeypatch.setattr(LLM, "generate", recorded)
    report = bench.run_bench(eager_default(), ["ngram"], str(data), None, batch_size=2,
                             temperature=0.0, max_tokens=3, repetitions=1, compare_hf=False)
    plain = sent[2:5]  # after the two engines' warm-ups: plain's three turns
    assert [len(batch) for batch in plain] == [2, 1, 1]  # the single-turn line answered with the first turn
    first, second, third = plain[0][0], plain[1][0], plain[2][0]
    assert second[:len(first)] == first and third[:len(second)] == second and len(third) > len(second) > len(first)
    assert report["results"]["ngram"]["agent"]["identical_to_plain"] == "4/4"
    # the earlier turns come from the prefix cache, as much under speculation as without
    hits = {name: report["results"][name]["agent"]["prefix_cache_hit_rate"] for name in ("plain", "ngram")}
    assert hits["plain"] > 0.3 and hits["ngram"] == hits["plain"], hits
    with pytest.raises(ValueError, match="multi-turn"):
        bench.run_bench(eager_default(), [], str(data), None, batch_size=1,
                        temperature=0.0, max_tokens=2, repetitions=1, compare_hf=True)


def test_concurrent_requests_are_distinct():
    from specdec.bench.runner import concurrent_requests

    convs = [[{"role": "user", "content": "Say hi."}]]
    batch = concurrent_requests(convs, 3)
    assert [c[-1]["content"] for c in batch] == ["Say hi.", "(request 2) Say hi.", "(request 3) Say hi."]
    assert concurrent_requests(convs * 4, 2) == convs * 4


def test_a_method_file_sets_engine_options_over_the_runs_own(tmp_path):
    from specdec.bench.runner import method_config
    from specdec.config_loading import config_from_dict

    base = config_from_dict({"engine": {"max_batch_size": 4, "batch_invariant": False}})
    path = tmp_path / "ngram_invariant.yaml"
    path.write_text("speculative_config: {decoding_type: ngram}\nengine: {batch_invariant: true}\n")
    label, cfg = method_config(base, str(path))
    assert label == "ngram_invariant" and cfg.speculative_config.decoding_type == "ngram"
    assert cfg.engine.batch_invariant is True and cfg.engine.max_batch_size == 4  # the run's, not the default 8
    path.write_text("speculative_config: {decoding_type: ngram}\n")
    assert method_config(base, str(path))[1].engine == base.engine


def test_each_repetition_starts_from_fresh_drafters_warmed_up_outside_the_sets(monkeypatch):
    """Issue 10: with ngram's public pool, a second repetition used to copy the first one's
    answers, and the warm-up ran the measured chat prompt."""
    from specdec.bench import runner as bench

    built, prompts_seen = [], []

    class Spy(bench.LLM):
        def __init__(self, **kw):
            super().__init__(**kw)
            built.append(self)

        def generate(self, prompts, params=None):
            prompts_seen.extend(self.decode(p) for p in prompts)
            return super().generate(prompts, params)

    monkeypatch.setattr(bench, "LLM", Spy)
    report = bench.run_bench(eager_default(), ["ngram"], None, ["chat"],
                             batch_size=1, temperature=0.0, max_tokens=4, repetitions=2, compare_hf=False)
    assert len(built) == 4  # plain and ngram, built again for the second repetition
    measured = bench.messages("chat")[0][0]["content"]
    warmups = [p for p in prompts_seen if "ready?" in p]
    assert len(warmups) == 4 and not any(measured in w for w in warmups)
    assert report["results"]["ngram"]["chat"]["identical_to_plain"] == "2/2"


def test_table_labels_methods_whose_output_a_lossy_rule_decided():
    import io

    from specdec.bench.runner import CategoryResult, print_table

    exact, lossy = CategoryResult(tokens=10, seconds=1.0), CategoryResult(tokens=12, seconds=1.0)
    lossy.metrics.lossless = False
    rows = {name: {"c": r.summary() | {"speedup_vs_plain": 1.0}, "all": r.summary() | {"speedup_vs_plain": 1.0}}
            for name, r in (("plain", exact), ("mtp_relaxed", lossy))}
    table = io.StringIO()
    print_table({"categories": ["c"], "results": rows}, file=table)
    lines = table.getvalue().splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["plain", "plain", "mtp_relaxed", "mtp_relaxed"]
    assert [line.split()[1] == "(LOSSY)" for line in lines] == [False, False, True, True]


def test_table_notes_batched_outputs_that_differ_from_plain():
    import io

    from specdec.bench.runner import print_table

    def row(same):
        return {"tokens_per_s": 1.0, "speedup_vs_plain": 1.0, "identical_to_plain": same}

    for batch_size, same, noted in ((8, "5/16", True), (8, "16/16", False), (1, "5/16", False)):
        rows = {"plain": {"c": row("16/16"), "all": row("16/16")}, "ngram": {"c": row(same), "all": row(same)}}
        table = io.StringIO()
        print_table({"categories": ["c"], "results": rows, "batch_size": batch_size}, file=table)
        assert ("note: outputs of ngram differ" in table.getvalue()) == noted


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed: pip install 'specdec[llama-cpp]'")
def test_bench_llama_cpp_beside_an_int4_target(tmp_path):
    """llama.cpp runs the GGUF file the embedded model comes from, in the same interleaved run."""
    out = tmp_path / "r.json"
    result = specdec("bench", "plain", "--llama-cpp", "--quantization", "int4", "--device", "cpu",
                     "--categories", "chat",
                     "--max-tokens", "16", "--dtype", "float32", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "(int4 weights)" in result.stdout and "llama.cpp prompt lookup" in result.stdout
    report = json.loads(out.read_text())
    assert report["quantization"] == "int4"
    for name in ("llama.cpp", "llama.cpp prompt lookup"):
        chat = report["results"][name]["chat"]
        assert 0 < chat["tokens"] <= 16 and chat["tokens_per_s"] > 0
        assert chat["identical_to_plain"] in ("0/1", "1/1")
    # greedy either way: llama.cpp's own prompt lookup emits llama.cpp's plain text
    assert report["results"]["llama.cpp"]["chat"]["tokens"] == report["results"]["llama.cpp prompt lookup"]["chat"][
        "tokens"]
    # at batch 3 llama.cpp decodes the three sequences together, each to its end
    result = specdec("bench", "plain", "--llama-cpp", "--device", "cpu", "--categories", "chat", "--batch-size", "3",
                     "--max-tokens", "12", "--json", str(out))
    assert result.returncode == 0, result.stderr
    chat = json.loads(out.read_text())["results"]["llama.cpp"]["chat"]
    assert 3 <= chat["tokens"] <= 36 and chat["identical_to_plain"].endswith("/3")


def test_llama_cpp_errors_name_the_fix(tmp_path, monkeypatch, tiny_models):
    from specdec import LLM
    from specdec.bench.runner import llama_cpp_systems
    from specdec.model.loading import embedded_gguf_path

    result = specdec_main("bench", "plain", "--llama-cpp", "--model", str(tiny_models["llama"]), "--max-tokens", "4")
    assert result.returncode == 2 and "GGUF file the target comes from" in result.stderr
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if the extra were not installed
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32")
    try:
        llama_cpp_systems(llm, embedded_gguf_path(), 4)
    except ValueError as exc:
        assert "pip install 'specdec[llama-cpp]'" in str(exc)
    else:
        raise AssertionError("no error without llama-cpp-python")


def test_the_header_names_the_numerics_each_method_ran_in():
    from specdec.bench.runner import numerics_line

    assert numerics_line({"batch_invariant": {"plain": True, "ngram": True}}) == "numerics: batch-invariant"
    assert numerics_line({"batch_invariant": {"plain": False, "ngram": False}}) == "numerics: stock"
    assert (numerics_line({"batch_invariant": {"plain": False, "ngram_invariant": True}})
            == "numerics: batch-invariant for ngram_invariant; stock for the rest")


def test_bench_json_schema_workload(tmp_path):
    """--json-schema: every request constrained by the schema, ngram's answers identical to
    plain decoding's and drafts accepted, and the grammar masks' time per step reported."""
    out = tmp_path / "r.json"
    benchmarks = Path(__file__).parents[1] / "benchmarks"
    ngram_file = tmp_path / "ngram.yaml"  # drafting every step: acceptance must not depend on the machine's load
    ngram_file.write_text("speculative_config: {decoding_type: ngram, adaptive: false}\n")
    result = specdec_main("bench", str(ngram_file), "--dataset", str(benchmarks / "json_events.jsonl"), "--json-schema",
                     str(benchmarks / "json_event.schema.json"), "--categories", "generation", "--max-tokens", "48",
                     "--set", "engine.compile=false", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "every answer follows --json-schema; grammar masks, ms per decode step: plain" in result.stdout
    report = json.loads(out.read_text())
    assert report["json_schema"] and report["categories"] == ["generation"]
    ngram = report["results"]["ngram"]["all"]
    assert ngram["identical_to_plain"] == "4/4" and ngram["grammar_ms_per_step"] > 0
    assert ngram["acceptance_length"] > 1.2
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = specdec_main("bench", "--json-schema", str(bad))
    assert result.returncode == 2 and "--json-schema" in result.stderr


def test_with_llama_cpp_every_system_has_its_ratio_to_the_fastest_llama_cpp_and_the_table_leads_with_it(
        monkeypatch):
    """The ratio to the fastest llama.cpp configuration per system and category, and the
    headline naming the fastest specdec system against it (llama.cpp stood in for by fixed
    rates, so the check needs no llama-cpp-python)."""
    import io

    from specdec.bench import runner as bench

    def fake(rate):
        def run(conversations, res):
            res.outputs = (res.outputs or []) + [[1]] * len(conversations)
            res.tokens += rate * len(conversations)
            res.seconds += len(conversations)
        return run

    monkeypatch.setattr(bench, "llama_cpp_systems", lambda llm, gguf, max_tokens, batch_size: {
        "llama.cpp": fake(20), "llama.cpp prompt lookup": fake(10)})
    report = bench.run_bench(eager_default(), ["ngram"], None, ["chat"],
                             batch_size=1, temperature=0.0, max_tokens=8, repetitions=1, compare_hf=False,
                             compare_llama_cpp="bindings")
    results = report["results"]
    for name in ("plain", "ngram", "llama.cpp prompt lookup"):
        for cat in ("chat", "all"):
            r = results[name][cat]
            assert r["speedup_vs_llama_cpp"] == pytest.approx(r["tokens_per_s"] / 20.0)
    assert results["llama.cpp prompt lookup"]["all"]["speedup_vs_llama_cpp"] == pytest.approx(0.5)
    table = io.StringIO()
    bench.print_table(report, file=table)
    first, header = table.getvalue().splitlines()[:2]
    best = max(("plain", "ngram"), key=lambda name: results[name]["all"]["tokens_per_s"])
    assert report["llama_cpp_best"] == "llama.cpp"
    assert first.startswith(f"headline: {best} ") and "x llama.cpp (20.0 tok/s), the fastest llama.cpp" in first
    assert "vs l.cpp" in header


def test_native_llama_cpp_is_found_or_built_and_its_server_answers_timed(tmp_path):
    """`specdec bench --llama-cpp native`'s pieces on the embedded GGUF: llama-server and
    llama-bench found (PATH, the user cache) or built from the vendored llama.cpp source;
    llama-bench's figures; a llama-server request answered with the greedy tokens specdec's
    own plain decoding gives (the same 4-bit blocks: the first tokens agree), timed at the
    client; its n-gram speculation answers too. Building them takes 10-17 minutes on two
    cores, more than CI's budget: the test builds them with SPECDEC_TEST_BUILD_LLAMA_CPP=1
    (run it so after a change to that path), and is skipped where they are not found and
    not built (or no compiler can build them)."""
    import shutil

    from specdec import LLM
    from specdec.bench.llama_cpp_native import LlamaServer, find_binaries, llama_bench
    from specdec.model.loading import embedded_gguf_path

    build = os.environ.get("SPECDEC_TEST_BUILD_LLAMA_CPP") == "1"
    if build and not all(shutil.which(tool) for tool in ("cmake", "c++")):
        pytest.skip("no cmake or C++ compiler here to build llama.cpp's llama-server and llama-bench")
    try:
        found = find_binaries(build=build)
    except ValueError as exc:
        pytest.skip(f"{exc}; SPECDEC_TEST_BUILD_LLAMA_CPP=1 builds them (10-17 minutes on two cores)")
    gguf = embedded_gguf_path()
    figures = llama_bench(found, gguf, threads=2, prompt_tokens=32, decode_tokens=8, repetitions=1)
    assert figures["decode"]["tokens"] == 8 and figures["decode"]["tokens_per_s"] > 0
    assert figures["prefill"]["tokens"] == 32 and figures["prefill"]["tokens_per_s"] > 0
    llm = LLM(engine={"compile": False})
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name three primary colors."}])
    ours = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
    for extra in ((), ("--spec-type", "ngram-mod")):
        server = LlamaServer(found, gguf, threads=2, n_ctx=512, extra=extra)
        try:
            started = time.perf_counter()
            theirs = server.complete(prompt, 8)
            assert 0 < time.perf_counter() - started < 60
        finally:
            server.close()
        assert len(theirs) == 8 and theirs[:3] == ours[:3], (theirs, ours)
