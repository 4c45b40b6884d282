"""Tensor parallelism over real torch.distributed process groups (gloo, one thread per rank):
greedy output equal to one rank's, every method lossless with drafts accepted, sampled output
on the target's distribution, the server and torchrun, and faults that end in clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError, ModelLoadError
from specdec.parallel import WorkerError
from specdec.testing import check_sampling_lossless, running_server, stream_chat, tiny_model_dir

ONE_THREAD = {"num_threads": 1}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def repeating_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (n,), generator=g).tolist() * 2 for n in (5, 9, 14)]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_at_two_ranks_decode_as_one_rank(tmp_path, arch):
    model = str(tiny_model_dir(tmp_path, arch))
    prompts = repeating_prompts()
    one = [o.token_ids for o in LLM(model, dtype="float32", engine=ONE_THREAD).generate(prompts, GREEDY)]
    with LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD) as plain:
        assert len(plain.group.workers) == 1 and plain.target.tensor_parallel_size == 2
        assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == one
    with LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD,
             speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False}) as ngram:
        outs = ngram.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == one
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_bfloat16_speculation_at_two_ranks_equals_plain_bit_for_bit_in_the_batch_invariant_mode(tmp_path):
    """The mode's linear products and attention run on each rank's shard, and the all-reduce
    sums the ranks' partial rows in a fixed order: a token's result still depends on its own
    sequence only, so a draft's verification rounds as a plain decode does."""
    model = str(tiny_model_dir(tmp_path, "llama"))
    engine = {**ONE_THREAD, "batch_invariant": True}
    prompts = repeating_prompts()
    with LLM(model, dtype="bfloat16", tensor_parallel_size=2, engine=engine) as plain:
        assert plain.engine.batch_invariant
        expected = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(model, dtype="bfloat16", tensor_parallel_size=2, engine=engine,
             speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False}) as ngram:
        outs = ngram.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


def test_the_embedded_model_at_three_ranks_with_every_method():
    """The embedded model has 9 query and 3 KV heads: three ranks of three and one. Plain
    decoding with logprobs and a stop string as at one rank; every method as plain, drafting."""
    chat = [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."}]
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2)
    stop = SamplingParams(max_tokens=32, temperature=0.0, stop=[" fox"])
    one = LLM(dtype="float32", engine={"num_threads": 2})
    reference, stopped = one.chat(chat, params)[0], one.chat(chat, stop)[0]
    with LLM(dtype="float32", tensor_parallel_size=3, engine=ONE_THREAD) as llm:
        out = llm.chat(chat, params)[0]
        assert out.token_ids == reference.token_ids
        for mine, theirs in zip(out.logprobs, reference.logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t] - theirs[t]) < 1e-3 for t in mine)
        cut = llm.chat(chat, stop)[0]
        assert (cut.text, cut.finish_reason) == (stopped.text, stopped.finish_reason) and cut.text
    for method in ("ngram", "draft_target", "eagle3", "mtp", "medusa"):
        with LLM(dtype="float32", tensor_parallel_size=3, engine=ONE_THREAD,
                 speculative_config={"decoding_type": method, "adaptive": False}) as llm:
            out = llm.chat(chat, params)[0]
        assert out.token_ids == reference.token_ids, method
        assert out.metrics.num_accepted_tokens > 0, f"{method}: no draft accepted"
        assert out.metrics.num_steps < len(out.token_ids), method


def test_sampled_output_at_two_ranks_follows_the_target(tmp_path):
    model = tiny_model_dir(tmp_path, "llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    _, accepted = check_sampling_lossless({"decoding_type": "ngram", "max_draft_len": 3}, model, prompt, n=600,
                                          engine={"tensor_parallel_size": 2, **ONE_THREAD})
    assert accepted > 0


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tmp_path):
    model = str(tiny_model_dir(tmp_path, "llama"))  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ConfigError, match=r"3 does not divide .*attention heads \(4\).*: 1, 2$"):
        LLM(model, dtype="float32", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="cannot be combined with compile"):
        LLM(model, tensor_parallel_size=2, engine={"compile": True})


def test_a_layer_skip_draft_is_refused_under_tensor_parallelism(tmp_path):
    model = str(tiny_model_dir(tmp_path, "llama"))
    with pytest.raises(ModelLoadError, match="sharded over 2 ranks.*speculative_model"):
        LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD,
            speculative_config={"decoding_type": "draft_target", "draft_layers": 1})


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_worker_that_dies_or_hangs_fails_requests_with_its_rank_and_leaves_no_process(tmp_path, fault):
    model = str(tiny_model_dir(tmp_path, "llama"))
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, engine={**ONE_THREAD, "distributed_timeout_s": 4})
    worker = llm.group.workers[0]
    assert [o.token_ids for o in llm.generate(repeating_prompts(), GREEDY)]
    os.kill(worker.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    started = time.monotonic()
    expected = "rank 1 .*killed by signal 9" if fault == "killed" else "did not answer within .* = 4 s"
    with pytest.raises(WorkerError, match=expected):
        llm.generate(repeating_prompts(), GREEDY)
    assert time.monotonic() - started < 30
    with pytest.raises(WorkerError, match=expected):  # at once: the engine is known to be gone
        llm.generate([[1, 2, 3]], GREEDY)
    llm.close()
    assert worker.poll() is not None


def test_a_worker_with_another_configuration_is_refused(tmp_path):
    """Under torchrun each rank reads its own options: rank 1 asks for another dtype."""
    model = str(tiny_model_dir(tmp_path, "llama"))
    script = ("import sys\nfrom specdec import LLM\n"
              "LLM(sys.argv[1], dtype=sys.argv[2], tensor_parallel_size=2, engine={'num_threads': 1})\n")
    (tmp_path / "launch.py").write_text(script)
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "launch.py"), model, dtype],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank, dtype in ((0, "float32"), (1, "bfloat16"))]
    logs = [proc.communicate(timeout=120)[0] for proc in ranks]
    assert all(proc.returncode != 0 for proc in ranks)
    assert "rank 1 does not run what rank 0 runs (configuration dtype: 'bfloat16' on that rank, 'float32' on " \
           "rank 0)" in logs[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_machines_under_torchrun_decode_as_one_rank(tmp_path):
    """Two torchrun agents on loopback, as two machines would run them: node 0 holds ranks 0
    and 1, node 1 rank 2; rank 0 prints the text, the others exit quietly."""
    prompt = "Repeat these words twice: red green blue yellow."
    one = LLM(dtype="float32", engine={"num_threads": 2})
    expected = one.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=24, temperature=0.0))[0]
    port = _free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", str(procs), "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "-m", "specdec.cli", "chat",
                               "--tensor-parallel-size", "3", "--dtype", "float32", "--threads", "1",
                               "-d", "ngram", "-n", "24", "-t", "0", prompt],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, procs in ((0, 2), (1, 1))]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    assert results[0][0].strip() == expected.text.strip()
    assert results[1][0].strip() == ""


def test_the_server_under_tensor_parallelism_answers_and_reports_a_dead_worker(tmp_path):
    config = "engine: {tensor_parallel_size: 3, num_threads: 1, distributed_timeout_s: 10}\ndtype: float32\n"
    with running_server(config, tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        text = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=8, temperature=0).choices[0].message.content
        assert text and stream_chat(client, "Say hi.", max_tokens=8, temperature=0) == text
        server = int(next(p for p in children(os.getpid()) if "serve" in Path(f"/proc/{p}/cmdline").read_text()))
        workers = children(server)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        import httpx

        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 503:  # the idle server's heartbeat finds it
            assert time.monotonic() < deadline, "/health stayed healthy after a worker died"
            time.sleep(0.2)
        assert "rank 2" in httpx.get(f"{base}/health").json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert refused.value.status_code == 503 and "rank 2" in refused.value.message
    time.sleep(0.5)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()
                and " Z " not in Path(f"/proc/{w}/stat").read_text()], "a worker outlived the server"
