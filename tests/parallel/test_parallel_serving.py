"""Tensor parallelism where users meet it: `specdec serve` answering the openai client
(streaming too) and reporting a killed worker, and two "machines" under torchrun. A tiny
random Llama with the embedded model's tokenizer keeps them cheap; two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from helpers import child_processes, free_port, tiny_chat_model
from specdec_test_support.served import running_server, stream_chat

from specdec import LLM, SamplingParams


def test_two_machines_under_torchrun_decode_as_one_rank(tmp_path):
    """Two torchrun agents on loopback, as two machines run them, one rank each: rank 0
    prints the text, rank 1 exits quietly."""
    model = str(tiny_chat_model(tmp_path))
    prompt = "Repeat these words twice: red green blue yellow."
    one = LLM(model, dtype="float32", engine={"num_threads": 2})
    expected = one.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=24, temperature=0.0))[0]
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                               "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "-m", "specdec.cli", "chat", "--model", model,
                               "--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1",
                               "-d", "ngram", "-n", "24", "-t", "0", prompt],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    results = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], results
    assert expected.text.strip() and results[0][0].strip() == expected.text.strip()
    assert results[1][0].strip() == ""


def test_the_server_under_tensor_parallelism_answers_and_reports_a_dead_worker(tmp_path):
    model = tiny_chat_model(tmp_path)
    config = (f"model: {model}\ndtype: float32\n"
              "engine: {tensor_parallel_size: 2, num_threads: 1, distributed_timeout_s: 10}\n")
    with running_server(config, tmp_path) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        text = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=8, temperature=0).choices[0].message.content
        assert text and stream_chat(client, "Say hi.", max_tokens=8, temperature=0) == text
        port = base.rsplit(":", 1)[1]
        server = next(p for p in child_processes(os.getpid())
                      if f"--port\0{port}\0" in Path(f"/proc/{p}/cmdline").read_text())
        (engine,) = [p for p in child_processes(server) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        # the engine process leads the group; its workers are forks of its launcher
        (launcher,) = [p for p in child_processes(engine)
                       if "specdec.parallel" in Path(f"/proc/{p}/cmdline").read_text()]
        workers = child_processes(launcher)
        assert [Path(f"/proc/{p}/comm").read_text().strip() for p in workers] == ["specdec-rank1"]
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 503:  # the idle server's watch finds it
            assert time.monotonic() < deadline, "/health stayed healthy after a worker died"
            time.sleep(0.2)
        assert "rank 1" in httpx.get(f"{base}/health").json()["error"]["message"]
        try:
            client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        except openai.APIStatusError as refused:
            assert refused.status_code == 503 and "rank 1" in refused.message
        else:
            raise AssertionError("a request was served after the worker died")
