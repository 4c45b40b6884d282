"""`specdec bench` end to end on the embedded model."""

import json
import os
import subprocess
import sys


def specdec(*args):
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def test_bench_builtin_sets_table_json_and_plots(tmp_path):
    out = tmp_path / "report.json"
    result = specdec("bench", "ngram", "--categories", "summarization", "chat", "--max-tokens", "24",
                     "--dtype", "float32", "--json", str(out), "--plots", str(tmp_path / "plots"))
    assert result.returncode == 0, result.stderr
    assert "speedup" in result.stdout and "ngram" in result.stdout
    assert "[##############################] 4/4" in result.stderr  # the progress bar finished
    report = json.loads(out.read_text())
    assert report["categories"] == ["summarization", "chat"]
    plain, ngram = report["results"]["plain"], report["results"]["ngram"]
    for cat in ("summarization", "chat", "all"):
        assert plain[cat]["speedup_vs_plain"] == 1.0
        assert abs(ngram[cat]["speedup_vs_plain"] - ngram[cat]["tokens_per_s"] / plain[cat]["tokens_per_s"]) < 1e-9
        assert ngram[cat]["time_to_first_token_s"] > 0 and ngram[cat]["time_per_output_token_s"] > 0
    assert ngram["summarization"]["acceptance_length"] > 1.0
    assert len(ngram["all"]["per_position_acceptance"]) == 12
    assert 0.0 <= ngram["all"]["draft_time_share"] < 1.0
    for name in ("speedup.png", "acceptance.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_user_jsonl_and_its_errors(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "Repeat: red green blue. red green blue.", "category": "repeat"}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Say hi."}]}) + "\n")
    out = tmp_path / "r.json"
    result = specdec("bench", "ngram", "--dataset", str(data), "--max-tokens", "8", "--dtype", "float32",
                     "--batch-size", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["categories"] == ["repeat", "custom"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    result = specdec("bench", "--dataset", str(bad))
    assert result.returncode == 2 and "bad.jsonl:1: expected" in result.stderr
    result = specdec("bench", "--categories", "poetry")
    assert result.returncode == 2 and "unknown categories ['poetry']" in result.stderr
