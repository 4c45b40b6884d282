"""The specdec command line: each command run once as a user runs it, in a process of its
own; the rest through its ``main`` in the test's process."""

from helpers import specdec_cli as specdec
from helpers import specdec_main


def test_config_check_prints_resolved_config_and_fails_on_errors(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("speculative_config: {decoding_type: NGram, max_draft_len: 5}\n")
    result = specdec_main("config", "check", str(good))
    assert result.returncode == 0, result.stderr
    assert "decoding_type: ngram" in result.stdout and "max_matching_ngram_size: 3" in result.stdout
    assert "max_draft_len: 5" in result.stdout
    assert "# decoding_type ngram from specdec-plugin-ngram 0.1.0" in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("speculative_config: {decoding_type: ngram, max_draft_lenn: 5}\n")
    result = specdec_main("config", "check", str(bad))
    assert result.returncode == 2
    assert "speculative_config.max_draft_lenn: unknown key (did you mean max_draft_len?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_streams_text_and_prints_stats():
    result = specdec_main("generate", "--stats", "-d", "ngram", "-k", "4", "-n", "24", "-t", "0",
                     "--set", "engine.compile=false", "Repeat: one two three four. one two three four. one two")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tok/s" in result.stderr and "acceptance length" in result.stderr
    assert "per-position acceptance [" in result.stderr


def test_generate_reads_stdin_and_flags_override_yaml(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("engine: {compile: false}\nsampling: {temperature: 0, max_tokens: 50}\n")
    a = specdec("generate", "-c", str(cfg), "-n", "5", input="The capital of France is")
    assert a.returncode == 0, a.stderr
    b = specdec_main("generate", "-c", str(cfg), "-n", "5", "The capital of France is")
    assert a.stdout == b.stdout and 0 < len(a.stdout.split()) <= 6


def test_chat_one_shot():
    result = specdec("chat", "-n", "12", "-t", "0", "--dtype", "float32", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_errors_are_messages_not_tracebacks(tmp_path):
    result = specdec_main("generate", "-m", str(tmp_path / "missing"), "hi")
    assert result.returncode == 2 and "no such file or directory" in result.stderr
    assert "Traceback" not in result.stderr
    result = specdec_main("generate", "-d", "nosuch", "hi")
    assert result.returncode == 2 and "unknown decoding type 'nosuch'" in result.stderr
