"""Soak: the real server under 64 concurrent streaming clients, a third of them leaving
mid-stream, with a KV cache small enough to force preemption, on the default target eager
(``compile: false``: the soak checks serving, not the compiled graph, whose start would cost
a minute). Every completed response equals the same request's answer offline, and the KV
cache is empty again at the end."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from specdec_test_support.served import running_server
from test_server import metrics

from specdec import SamplingParams

COLORS = ["red", "green", "blue", "amber", "violet", "silver", "black", "white"]
THINGS = ["boat", "kite", "lamp", "chair", "tower", "garden", "river", "clock"]
PROMPTS = [f"Describe a {c} {t} in one sentence." for c in COLORS for t in THINGS]  # 64 distinct


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    with running_server("speculative_config: {decoding_type: ngram, max_draft_len: 4}\n"
                        "engine: {max_batch_size: 16, kv_cache_blocks: 24, block_size: 16, compile: false}\n"
                        "sampling: {temperature: 0, max_tokens: 24}\n", tmp_path_factory.mktemp("soak")) as base:
        yield base


def stream(base: str, i: int) -> str | None:
    """Client ``i``: streams a chat completion; every third one leaves after two chunks."""
    body = {"messages": [{"role": "user", "content": PROMPTS[i]}], "stream": True}
    pieces = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as r:
        for n, line in enumerate(r.iter_lines()):
            if i % 3 == 0 and n >= 4:
                return None  # disconnect mid-stream
            if line == "data: [DONE]":
                return "".join(pieces)
            if line.startswith("data: "):
                choices = json.loads(line[6:])["choices"]
                pieces.append(choices[0]["delta"].get("content", "") if choices else "")
    raise AssertionError(f"client {i}: the stream ended without [DONE]")


@pytest.mark.slow
def test_sixty_four_streams_with_disconnects_and_preemption(small_server, w4a8):
    with ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(lambda i: stream(small_server, i), range(64)))
    completed = [(i, t) for i, t in enumerate(texts) if t is not None]
    assert len(completed) == 42
    params = SamplingParams(max_tokens=24, temperature=0.0)
    # each request offline, with a roomy cache: in one batch, whose answers are each request's
    # alone (the default target is batch-invariant)
    offline = w4a8.chat([[{"role": "user", "content": PROMPTS[i]}] for i, _ in completed], params)
    for (i, text), want in zip(completed, offline):
        assert text == want.text, PROMPTS[i]
    deadline = time.time() + 60
    while time.time() < deadline:
        m = metrics(small_server)
        if m["specdec_kv_cache_usage"] == 0.0 and m["specdec_running_requests"] == 0 \
                and m["specdec_queue_depth"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the KV cache was not emptied: {m}")
    assert m["specdec_preemptions_total"] > 0, "the cache was large enough: nothing was preempted"
    assert m['specdec_requests_total{outcome="ok"}'] == 42
    assert m['specdec_requests_total{outcome="aborted"}'] == 22
