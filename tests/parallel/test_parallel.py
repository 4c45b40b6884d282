"""Tensor parallelism over real torch.distributed process groups (gloo, one thread per rank) on
tiny models of real architectures: greedy output equal to one rank's, speculation lossless,
sampled output on the target's distribution, and faults that end in clear errors. The
embedded model, the server and torchrun: test_parallel_embedded.py, test_parallel_serving.py."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import free_port

from specdec import LLM, SamplingParams
from specdec.errors import ConfigError, ModelLoadError
from specdec.parallel import WorkerError
from specdec.testing import check_sampling_lossless, tiny_model_dir

ONE_THREAD = {"num_threads": 1}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def repeating_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (n,), generator=g).tolist() * 2 for n in (5, 9, 14)]


def ngram_at_two_ranks(model: str, dtype: str, engine: dict, prompts: list) -> list:
    with LLM(model, dtype=dtype, tensor_parallel_size=2, engine=engine,
             speculative_config={"decoding_type": "ngram", "max_draft_len": 4, "adaptive": False}) as llm:
        return llm.generate(prompts, GREEDY)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_models_at_two_ranks_decode_as_one_rank(tmp_path, arch):
    model = str(tiny_model_dir(tmp_path, arch))
    prompts = repeating_prompts()
    one = [o.token_ids for o in LLM(model, dtype="float32", engine=ONE_THREAD).generate(prompts, GREEDY)]
    with LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD) as plain:
        assert len(plain.group.workers) == 1 and plain.target.tensor_parallel_size == 2
        assert [o.token_ids for o in plain.generate(prompts, GREEDY)] == one
    outs = ngram_at_two_ranks(model, "float32", ONE_THREAD, prompts)
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
    outs = ngram_at_two_ranks(model, "bfloat16", engine, prompts)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0


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


def test_workers_are_forks_of_one_launcher_and_die_with_it(tmp_path):
    """Rank 0 forks the workers of every group it starts from one launcher process, which
    imported them once; a killed launcher takes its workers with it (the group fails naming
    the rank), and the next group starts a launcher of its own."""
    model = str(tiny_model_dir(tmp_path, "llama"))
    prompts = repeating_prompts()

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    with LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD) as first:
        worker = first.group.workers[0]
        launcher = parent(worker.pid)
        assert Path(f"/proc/{worker.pid}/comm").read_text().strip() == "specdec-rank1"
        expected = [o.token_ids for o in first.generate(prompts, GREEDY)]
    assert worker.poll() == 0
    llm = LLM(model, dtype="float32", tensor_parallel_size=2, engine={**ONE_THREAD, "distributed_timeout_s": 4})
    assert parent(llm.group.workers[0].pid) == launcher != os.getpid()
    os.kill(launcher, signal.SIGKILL)
    with pytest.raises(WorkerError, match="rank 1 .*killed by signal 9"):
        llm.generate(prompts, GREEDY)
    llm.close()
    with LLM(model, dtype="float32", tensor_parallel_size=2, engine=ONE_THREAD) as again:
        assert parent(again.group.workers[0].pid) not in (launcher, os.getpid())
        assert [o.token_ids for o in again.generate(prompts, GREEDY)] == expected


SLOW_LOADING_RANK = """
import sys, time, torch
from specdec.config_loading import config_from_dict
from specdec.parallel import TensorParallelGroup
from specdec.parallel.messages import Shutdown
config = config_from_dict({"model": "unused", "engine": {"tensor_parallel_size": 2, "distributed_timeout_s": 1}})
group = TensorParallelGroup.start(config, torch.device("cpu"))
time.sleep(3)  # its shard loads for longer than distributed_timeout_s
group.loaded()
while not isinstance(group.receive(), Shutdown):
    pass
"""


def start_two_ranks(monkeypatch, rank1_script: str):
    """Rank 1 runs ``rank1_script`` in a process of its own; this process is rank 0 (its
    groups numbered from 0 again, as in the fresh process of a torchrun launch)."""
    from specdec.config_loading import config_from_dict
    from specdec.parallel import TensorParallelGroup
    from specdec.parallel import group as group_module

    monkeypatch.setattr(group_module, "_GROUPS", itertools.count())

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    rank1 = subprocess.Popen([sys.executable, "-c", rank1_script], env={**os.environ, **env, "RANK": "1"})
    for name, value in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    config = config_from_dict({"model": "unused", "engine": {"tensor_parallel_size": 2, "distributed_timeout_s": 1}})
    group = TensorParallelGroup.start(config, torch.device("cpu"))
    group.loaded()
    return group, rank1


def test_a_rank_that_loads_its_shard_slowly_is_waited_for(monkeypatch):
    """Ranks meet, load their shards at their own pace, then meet again: the ranks watch each
    other only once every rank is loaded, so a rank loading for longer than
    ``distributed_timeout_s`` does not fail the group."""
    group, rank1 = start_two_ranks(monkeypatch, SLOW_LOADING_RANK)
    time.sleep(4)  # idle: the ranks' counters tick
    assert group.failure is None
    group.close()
    assert rank1.wait(timeout=30) == 0


BUSY_RANK = """
import sys, time, torch
from specdec.config_loading import config_from_dict
from specdec.parallel import TensorParallelGroup
from specdec.parallel.messages import Shutdown
config = config_from_dict({"model": "unused", "engine": {"tensor_parallel_size": 2, "distributed_timeout_s": 1}})
group = TensorParallelGroup.start(config, torch.device("cpu"))
group.loaded()
while not isinstance(message := group.receive(), Shutdown):
    time.sleep(message)  # one operation for longer than distributed_timeout_s
"""


def test_a_worker_busy_for_longer_than_the_timeout_is_alive_and_a_stopped_one_is_found(monkeypatch):
    """Liveness is not asked on the wire the operations travel: a worker three timeouts into
    one operation is alive, and rank 0, idle meanwhile, keeps the group; a stopped worker
    fails the group within about the timeout, with no operation sent."""
    group, rank1 = start_two_ranks(monkeypatch, BUSY_RANK)
    group.send(3.0)
    time.sleep(4)
    assert group.failure is None
    group.send(0.0)  # taken: the worker is back at its receive
    assert group.failure is None
    os.kill(rank1.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while group.failure is None:
        assert time.monotonic() < deadline, "a stopped worker was not found"
        time.sleep(0.1)
    assert "did not answer within engine.distributed_timeout_s = 1 s" in str(group.failure)
    with pytest.raises(WorkerError):
        group.send(0.0)
    group.close()
    rank1.kill()
    rank1.wait()


STOPPED_LEADER = """
import os, signal, time, torch
from specdec.config_loading import config_from_dict
from specdec.parallel import TensorParallelGroup
config = config_from_dict({"model": "unused", "engine": {"tensor_parallel_size": 2, "distributed_timeout_s": 1}})
group = TensorParallelGroup.start(config, torch.device("cpu"))
group.loaded()
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_waiting_worker_whose_rank_0_stops_leaves_with_an_error(monkeypatch):
    """A script plays rank 0 and stops itself once the ranks are loaded: the worker's receive
    cannot be interrupted, so its watch ends the process, naming rank 0."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    leader = subprocess.Popen([sys.executable, "-c", STOPPED_LEADER], env={**os.environ, **env, "RANK": "0"})
    worker = subprocess.Popen([sys.executable, "-c", BUSY_RANK], env={**os.environ, **env, "RANK": "1"},
                              stderr=subprocess.PIPE, text=True)
    try:
        _, err = worker.communicate(timeout=60)
        assert worker.returncode == 1
        assert "rank 1 stops: rank 0 did not answer within engine.distributed_timeout_s = 1 s" in err
    finally:
        for proc in (leader, worker):
            proc.kill()
            proc.wait()


def test_a_worker_with_another_configuration_is_refused(tmp_path):
    """Under torchrun each rank reads its own options: rank 1 asks for another dtype."""
    model = str(tiny_model_dir(tmp_path, "llama"))
    script = ("import sys\nfrom specdec import LLM\n"
              "LLM(sys.argv[1], dtype=sys.argv[2], tensor_parallel_size=2, engine={'num_threads': 1})\n")
    (tmp_path / "launch.py").write_text(script)
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(tmp_path / "launch.py"), model, dtype],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank, dtype in ((0, "float32"), (1, "bfloat16"))]
    logs = [proc.communicate(timeout=120)[0] for proc in ranks]
    assert all(proc.returncode != 0 for proc in ranks)
    assert "rank 1 does not run what rank 0 runs (configuration dtype: 'bfloat16' on that rank, 'float32' on " \
           "rank 0)" in logs[0]

