"""`specdec serve`: a real server on a loopback port, driven over HTTP."""

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import child_processes
from specdec_test_support import embedded
from specdec_test_support.served import running_server, stream_chat

from specdec import LLM, SamplingParams, testing

PROMPTS = [f"Here is a list of {i + 2} fruits:\n1." for i in range(16)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server("speculative_config: {decoding_type: ngram, max_draft_len: 6, adaptive: false}\n"
                        "engine: {max_batch_size: 16, compile: false}\nsampling: {temperature: 0, max_tokens: 24}\n",
                        tmp_path_factory.mktemp("srv")) as base:
        yield base


def metrics(base) -> dict:
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_models_and_health(server):
    health = httpx.get(f"{server}/health").json()
    assert health["status"] == "ok" and health["engine"]["decoding_type"] == "ngram"
    assert health["engine"]["quantization"] == "w4a8" and health["engine_restarts"] == 0
    data = httpx.get(f"{server}/v1/models").json()
    assert data["data"][0]["id"] == "SmolLM2-135M-Instruct" and data["data"][0]["max_model_len"] == 8192


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """`specdec serve` with the engine's defaults but eager (``compile: false``), greedy."""
    with running_server("engine: {compile: false}\nsampling: {temperature: 0}\n",
                        tmp_path_factory.mktemp("plain")) as base:
        yield base


def test_the_server_resolves_its_engine_as_llm_does(plain_server):
    """`specdec serve` with no options runs the engine ``LLM()`` builds with none: the same
    quantization, compile, batch invariance, threads and dtype (its /health says which)."""
    import subprocess
    import sys

    import torch

    from specdec.serving.async_engine import engine_info

    # the server is a fresh process with torch's own thread count; the suite's workers set theirs
    fresh = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                               capture_output=True, text=True, check=True).stdout)
    ours = torch.get_num_threads()
    torch.set_num_threads(fresh)
    try:
        default = engine_info(LLM(engine={"compile": False}))
    finally:
        torch.set_num_threads(ours)
    served = httpx.get(f"{plain_server}/health").json()["engine"]
    assert served == default.resolved and served["quantization"] == "w4a8"


def test_a_killed_engine_process_fails_its_requests_and_a_new_one_serves(plain_server, w4a8):
    """SIGKILL to the engine process with requests in flight: streamed and whole requests end
    with errors in OpenAI's shape naming the cause, the server answers /health with 503
    while a new engine starts, then serves the openai client the same answers as before."""
    from openai import OpenAI

    base = plain_server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    expected = w4a8.chat(messages, SamplingParams(max_tokens=12, temperature=0.0))[0].text
    assert client.chat.completions.create(model="any", messages=messages, max_tokens=12).choices[0] \
        .message.content == expected
    port = base.rsplit(":", 1)[1]
    server = next(p for p in child_processes(os.getpid())
                  if f"--port\0{port}\0" in Path(f"/proc/{p}/cmdline").read_text())
    (engine,) = [p for p in child_processes(server) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    long = {"prompt": "Count to a thousand:", "max_tokens": 2000, "min_tokens": 2000}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(httpx.post, f"{base}/v1/completions", json=long, timeout=120)
        with httpx.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=120) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            while metrics(base)["specdec_running_requests"] < 2:  # the whole one is in flight too
                time.sleep(0.05)
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest and rest[-1] != "data: [DONE]"
        error = json.loads(rest[-1][6:])["error"]
        assert error["type"] == "server_error" and "SIGKILL" in error["message"]
        assert whole.result().status_code == 500 and "SIGKILL" in whole.result().json()["error"]["message"]
    codes = set()
    deadline = time.monotonic() + 300
    while (status := httpx.get(f"{base}/health", timeout=30).status_code) != 200:
        codes.add(status)
        assert time.monotonic() < deadline, "no new engine within 300 s"
        time.sleep(0.2)
    assert codes <= {503}
    health = httpx.get(f"{base}/health").json()
    assert health["engine_restarts"] == 1
    assert client.chat.completions.create(model="any", messages=messages, max_tokens=12).choices[0] \
        .message.content == expected
    assert metrics(base)["specdec_engine_restarts_total"] == 1


def test_completion_equals_offline_generate(server, w4a8):
    body = httpx.post(f"{server}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0},
                      timeout=120).json()
    offline = w4a8.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert body["choices"][0]["text"] == offline.text
    assert body["usage"]["completion_tokens"] == len(offline.token_ids)
    spec = body["usage"]["speculative"]
    assert spec["num_steps"] >= 1 and "acceptance_length" in spec and "per_position_acceptance" in spec


def test_chat_completion_equals_offline_chat(server, w4a8):
    messages = [{"role": "user", "content": "Name three primary colors."}]
    body = httpx.post(f"{server}/v1/chat/completions", json={"messages": messages, "max_tokens": 20,
                                                             "temperature": 0}, timeout=120).json()
    offline = w4a8.chat(messages, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": offline.text}


def test_streaming_matches_non_streaming(server):
    request = {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0}
    whole = httpx.post(f"{server}/v1/completions", json=request, timeout=120).json()["choices"][0]["text"]
    pieces, done, final = [], False, None
    with httpx.stream("POST", f"{server}/v1/completions", json={**request, "stream": True}, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            pieces.append(chunk["choices"][0]["text"])
            final = chunk
    assert done and "".join(pieces) == whole and len([p for p in pieces if p]) > 1
    assert final["choices"][0]["finish_reason"] in ("length", "stop") and "usage" in final


def test_sixteen_concurrent_clients_share_the_batch_and_match_offline(server, w4a8):
    def ask(prompt):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0},
                       timeout=300)
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(ask, PROMPTS))
    offline = w4a8.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    assert texts == [o.text for o in offline]


def test_bad_input_gets_a_clear_error_and_the_server_keeps_serving(server):
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "x", "temperature": -1})
    assert r.status_code == 422 and "temperature" in r.text
    r = httpx.post(f"{server}/v1/completions", json={"max_tokens": 3})
    assert r.status_code == 422 and "prompt" in r.text
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "word " * 9000, "max_tokens": 3}, timeout=60)
    assert r.status_code == 400 and "context holds" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 100000}, timeout=60)
    assert r.status_code == 400 and "at most 8191 can be generated" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 422
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_disconnect_cancels_and_frees_kv_blocks(server):
    before = metrics(server)
    with httpx.stream("POST", f"{server}/v1/completions",
                      json={"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True},
                      timeout=120) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server)
        if m['specdec_requests_total{outcome="aborted"}'] > before['specdec_requests_total{outcome="aborted"}'] \
                and m["specdec_kv_cache_usage"] == 0.0 and m["specdec_running_requests"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"request not cancelled: {m}")


def test_metrics_report_speculation(server):
    httpx.post(f"{server}/v1/completions", json={"prompt": "Repeat: a b c d e f. a b c d e f. a b c",
                                                  "max_tokens": 20, "temperature": 0}, timeout=60)
    m = metrics(server)
    assert m['specdec_requests_total{outcome="ok"}'] >= 1
    assert m["specdec_draft_tokens_total"] >= m["specdec_accepted_tokens_total"] > 0
    assert m["specdec_acceptance_length"] > 1.0
    assert 'specdec_per_position_acceptance{position="1"}' in m
    assert "specdec_queue_depth" in m and "specdec_kv_cache_blocks" in m


def test_the_official_openai_client_gets_the_same_answers(server, w4a8):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    done = client.completions.create(model="any", prompt=PROMPTS[3], max_tokens=24, temperature=0)
    offline = w4a8.generate(PROMPTS[3], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert done.choices[0].text == offline.text and done.usage.completion_tokens == len(offline.token_ids)
    messages = [{"role": "user", "content": "Name two colors."}]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=16, temperature=0)
    streamed = stream_chat(client, messages[0]["content"], max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == streamed == w4a8.chat(messages, SamplingParams(
        max_tokens=16, temperature=0.0))[0].text
    assert [m.id for m in client.models.list().data] == [w4a8.target.name]


def test_openai_fields_specdec_lacks_are_refused_not_ignored(server, w4a8):
    """The OpenAI client's ``max_completion_tokens`` (its newer name for chat's
    ``max_tokens``) limits the answer; sampling fields specdec does not implement are a 422
    naming the field where they would change the answer, and accepted where they are off."""
    from openai import OpenAI, UnprocessableEntityError

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name two colors."}]
    chat = client.chat.completions.create(model="any", messages=messages, max_completion_tokens=5, temperature=0)
    assert chat.usage.completion_tokens == 5
    want = w4a8.chat(messages, SamplingParams(max_tokens=5, temperature=0.0))[0].text
    assert chat.choices[0].message.content == want
    with pytest.raises(UnprocessableEntityError, match="disagree"):
        client.chat.completions.create(model="any", messages=messages, max_tokens=4, max_completion_tokens=6)
    off = client.chat.completions.create(model="any", messages=messages, max_tokens=4, temperature=0,
                                         frequency_penalty=0, presence_penalty=0.0, logprobs=False, user="u1")
    assert off.choices[0].message.content == w4a8.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))[0].text
    for field, value in (("best_of", 3), ("suffix", "x"), ("tools", [{"type": "function"}])):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value})
        assert r.status_code == 422 and field in r.json()["error"]["message"]


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(server, w4a8):
    """OpenAI's frequency_penalty, presence_penalty and logit_bias (token ids as strings) and
    vLLM's min_tokens answer as the Python API does with the same SamplingParams; a bias out
    of range or a token outside the vocabulary is a 4xx naming it."""
    from openai import BadRequestError, OpenAI, UnprocessableEntityError

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = [{"role": "user", "content": "List five fruits."}]
    banned = w4a8.chat(messages, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    got = client.chat.completions.create(model="any", messages=messages, max_tokens=12, temperature=0,
                                         frequency_penalty=1.2, presence_penalty=0.6,
                                         logit_bias={str(banned): -100}, extra_body={"min_tokens": 4})
    want = w4a8.chat(messages, SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=1.2,
                                             presence_penalty=0.6, logit_bias={banned: -100.0}, min_tokens=4))[0]
    assert got.choices[0].message.content == want.text and banned not in want.token_ids
    for bad, word in (({"logit_bias": {"5": 300}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                      ({"frequency_penalty": 3}, "frequency_penalty")):
        with pytest.raises((UnprocessableEntityError, BadRequestError), match=word):
            client.chat.completions.create(model="any", messages=messages, max_tokens=2, **bad)


def test_chat_content_parts_and_the_developer_role(server, w4a8):
    """OpenAI's list-of-parts content and ``developer`` role (what newer clients and agent
    frameworks send) read as the string content and ``system`` role they stand for; a part
    specdec cannot read (an image) is refused by name, not rendered into the prompt."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "text", "text": "Name two"}, {"type": "text", "text": "colors."}]}]
    plain = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name two\ncolors."}]
    assert w4a8.apply_chat_template(parts) == w4a8.apply_chat_template(plain)
    chat = client.chat.completions.create(model="any", messages=parts, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == w4a8.chat(plain, SamplingParams(max_tokens=12, temperature=0.0))[0].text
    image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(BadRequestError, match="image_url"):
        client.chat.completions.create(model="any", messages=image, max_tokens=4)


def test_several_prompts_and_n_choices_are_batched_requests(server, w4a8):
    """OpenAI's batch form (a list of prompts, as strings or token ids) and ``n`` samples of a
    prompt: one choice per request, in OpenAI's order, each what the request gets alone; a
    seed advances per choice; streaming delivers every choice by its index."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompts = [PROMPTS[4], PROMPTS[5], PROMPTS[6]]
    done = client.completions.create(model="any", prompt=prompts, max_tokens=10, temperature=0)
    alone = [w4a8.generate(p, SamplingParams(max_tokens=10, temperature=0.0))[0] for p in prompts]
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == [o.text for o in alone]
    assert done.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in alone)
    assert done.usage.completion_tokens == sum(len(o.token_ids) for o in alone)
    as_ids = client.completions.create(model="any", prompt=[w4a8.encode(p) for p in prompts[:2]], max_tokens=10,
                                       temperature=0)
    assert [c.text for c in as_ids.choices] == [o.text for o in alone[:2]]

    streamed = ["", ""]
    for chunk in client.completions.create(model="any", prompt=prompts[:2], max_tokens=10, temperature=0,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == [o.text for o in alone[:2]]

    # Sampled: without the seed advancing per choice, a prompt's three seeded choices would be one text.
    stories = ["Once upon a time", "The strangest thing about my town is"]
    sampled = client.completions.create(model="any", prompt=stories, n=3, max_tokens=16, temperature=1.0, seed=11)
    texts = [c.text for c in sampled.choices]
    assert len(texts) == 6 and len(set(texts[:3])) > 1 and len(set(texts[3:])) > 1
    assert sampled.usage.prompt_tokens == sum(len(w4a8.encode(p)) for p in stories)
    assert 6 <= sampled.usage.completion_tokens <= 6 * 16

    messages = [{"role": "user", "content": "Name a fruit."}]
    greedy = w4a8.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))[0].text
    chat = client.chat.completions.create(model="any", messages=messages, n=2, max_tokens=8, temperature=0)
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model="any", messages=messages, n=2, max_tokens=8, temperature=0,
                                                stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [c.message.content for c in chat.choices] == streamed == [greedy, greedy]

    r = httpx.post(f"{server}/v1/completions", json={"prompt": ["a"] * 9, "n": 8, "max_tokens": 2})
    assert r.status_code == 422 and "more than 64" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": ["Hi", ""], "max_tokens": 2})
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]


def test_logprobs_in_openai_form_streamed_or_not(server, w4a8):
    """Completions' legacy ``logprobs`` columns and chat's ``logprobs`` / ``top_logprobs``:
    the target's own figures (as ``LLM.generate`` gives them), streamed or not."""
    from openai import OpenAI, UnprocessableEntityError

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    offline = w4a8.generate(PROMPTS[9], SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))[0]
    want = [entry[token] for entry, token in zip(offline.logprobs, offline.token_ids)]
    done = client.completions.create(model="any", prompt=PROMPTS[9], max_tokens=12, temperature=0, logprobs=2)
    columns = done.choices[0].logprobs
    assert columns.token_logprobs == pytest.approx(want, abs=1e-4)
    assert "".join(columns.tokens) == done.choices[0].text and len(columns.top_logprobs[0]) == 2
    assert columns.text_offset == [sum(len(t) for t in columns.tokens[:i]) for i in range(len(columns.tokens))]
    streamed = []
    for chunk in client.completions.create(model="any", prompt=PROMPTS[9], max_tokens=12, temperature=0,
                                           logprobs=2, stream=True):
        if chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(want, abs=1e-4)

    messages = [{"role": "user", "content": "Name two colors."}]
    offline = w4a8.chat(messages, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]
    chat = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [entry[token] for entry, token in zip(offline.logprobs, offline.token_ids)], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-4 for c in content)
    plain = client.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None
    with pytest.raises(UnprocessableEntityError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="any", messages=messages, max_tokens=4, top_logprobs=2)


def test_echo_returns_the_prompt_with_its_tokens_scored(server, w4a8):
    """The completions API's ``echo`` (what lm-eval's loglikelihood requests send, with
    ``logprobs``): the prompt before the answer, its tokens scored as the target scores them
    (the first one ``None``), streamed or not."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompt = "The capital of France is Paris. The capital of Italy is"
    offline = w4a8.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, logprobs=1, prompt_logprobs=1))[0]
    want = [None] + [e[t] for e, t in zip(offline.prompt_logprobs[1:], offline.prompt_token_ids[1:])] + [
        e[t] for e, t in zip(offline.logprobs, offline.token_ids)]
    done = client.completions.create(model="any", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    choice = done.choices[0]
    assert choice.text == prompt + offline.text
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert len(choice.logprobs.tokens) == len(offline.prompt_token_ids) + len(offline.token_ids)
    text, streamed = "", []
    for chunk in client.completions.create(model="any", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           logprobs=1, stream=True):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert text == choice.text and streamed[0] is None and streamed[1:] == pytest.approx(want[1:], abs=1e-4)
    bare = client.completions.create(model="any", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert bare.choices[0].text == prompt + offline.text and bare.choices[0].logprobs is None


def test_metrics_are_prometheus_exposition_with_histograms(server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{server}/v1/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": 8}, timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    assert families["specdec_requests"].type == "counter"
    assert families["specdec_request_acceptance_length"].type == "histogram"
    count = [s.value for s in families["specdec_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert count and count[0] >= 1
    assert {"specdec_time_per_output_token_seconds", "specdec_drafter_faults", "specdec_preemptions",
            "specdec_kv_cache_usage", "specdec_speculation_off_steps"} <= set(families)
    by_depth = {s.labels["draft_len"]: s.value for s in families["specdec_draft_len_steps"].samples
                if s.name.endswith("_total")}
    steps = [s.value for s in families["specdec_target_steps"].samples if s.name.endswith("_total")][0]
    assert by_depth and sum(by_depth.values()) == steps  # every decode step counted under its draft depth


KEY = "sk-right"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """`specdec serve` with an API key (SPECDEC_API_KEY), one request at a time, a body limit
    (--max-body-bytes 2000), a waiting limit (--max-waiting 2) and CORS for one origin."""
    with running_server("engine: {max_batch_size: 1, compile: false}\nsampling: {temperature: 0, max_tokens: 24}\n",
                        tmp_path_factory.mktemp("guarded"), env={"SPECDEC_API_KEY": KEY},
                        args=("--max-body-bytes", "2000", "--max-waiting", "2",
                              "--allowed-origin", "https://app.example")) as base:
        yield base


def test_an_api_key_guards_every_v1_route(guarded_server, w4a8):
    """`specdec serve` with SPECDEC_API_KEY: the openai client with the key is answered, a
    wrong or missing key gets OpenAI's 401 on every /v1 route, /health and /metrics stay open;
    --protect-all guards them too."""
    from fastapi.testclient import TestClient
    from openai import AuthenticationError, OpenAI

    from specdec.serving.server import ServerOptions, create_app

    base = guarded_server
    messages = [{"role": "user", "content": "Say hi."}]
    good = OpenAI(base_url=f"{base}/v1", api_key=KEY)
    assert good.chat.completions.create(model="any", messages=messages, max_tokens=4).choices[0].message.content == \
        w4a8.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))[0].text
    with pytest.raises(AuthenticationError, match="API key"):
        OpenAI(base_url=f"{base}/v1", api_key="sk-wrong").chat.completions.create(model="any", messages=messages)
    for path, method in (("/v1/models", "get"), ("/v1/completions", "post"), ("/v1/chat/completions", "post")):
        r = getattr(httpx, method)(f"{base}{path}", **({"json": {}} if method == "post" else {}))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
    assert httpx.get(f"{base}/health").status_code == 200 and httpx.get(f"{base}/metrics").status_code == 200
    with TestClient(create_app(w4a8, ServerOptions(api_key="k", protect_all=True))) as client:
        assert client.get("/health").status_code == 401 and client.get("/metrics").status_code == 401
        assert client.get("/health", headers={"Authorization": "Bearer k"}).status_code == 200


def test_limits_answer_413_429_and_cors_only_where_configured(guarded_server):
    """A body over --max-body-bytes gets 413 and a burst beyond --max-waiting 429, each in
    OpenAI's error shape, and the server keeps serving; browsers get CORS headers only from
    the origins given with --allowed-origin."""
    import asyncio

    base = guarded_server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 3000, "max_tokens": 1}, headers=AUTH)
    assert r.status_code == 413 and "max-body-bytes" in r.json()["error"]["message"]

    async def burst():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            return await asyncio.gather(*[client.post(f"{base}/v1/completions",
                                                      json={"prompt": f"Count to {i}:", "n": 2}) for i in range(4)])

    codes = sorted(r.status_code for r in asyncio.run(burst()))
    assert 429 in codes and 200 in codes, codes
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=AUTH)
    assert ok.status_code == 200
    allowed = httpx.options(f"{base}/v1/models", headers={"Origin": "https://app.example",
                                                          "Access-Control-Request-Method": "GET"})
    assert allowed.headers.get("access-control-allow-origin") == "https://app.example"
    other = httpx.get(f"{base}/v1/models", headers={"Origin": "https://evil.example", **AUTH})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_structured_output_through_the_openai_client_and_vllms_fields(server, w4a8):
    """``response_format`` (JSON schema, JSON object) from the ``openai`` client, streamed
    or not, and vLLM's ``structured_outputs`` / ``guided_*`` fields: the output follows the
    grammar and is the text plain decoding gives under it (the server speculates with ngram)."""
    from openai import BadRequestError, OpenAI, UnprocessableEntityError

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    messages = embedded.STRUCTURED_CHECK_PROMPTS[0]
    schema = embedded.STRUCTURED_CHECK_SCHEMA
    offline = w4a8.chat([messages], SamplingParams(max_tokens=64, temperature=0.0,
                                                   structured_outputs={"json": schema}))[0].text
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    done = client.chat.completions.create(model="any", messages=messages, max_tokens=64, temperature=0,
                                          response_format=fmt)
    assert done.choices[0].message.content == offline and embedded.follows_check_schema(json.loads(offline))
    assert stream_chat(client, messages[0]["content"], max_tokens=64, temperature=0, response_format=fmt) == offline
    cat = [{"role": "user", "content": "Describe a cat as a JSON object with name and color."}]
    obj = client.chat.completions.create(model="any", messages=cat, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    question = [{"role": "user", "content": "Is the sky green?"}]
    for extra in ({"structured_outputs": {"choice": ["yes", "no"]}}, {"guided_choice": ["yes", "no"]}):
        answer = client.chat.completions.create(model="any", messages=question, max_tokens=8, temperature=0,
                                                extra_body=extra)
        assert answer.choices[0].message.content in ("yes", "no")
    phone = client.completions.create(model="any", prompt="Call me at", max_tokens=12, temperature=0,
                                      extra_body={"guided_regex": r" [0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.choices[0].text)
    with pytest.raises(BadRequestError, match="unclosed character class"):
        client.completions.create(model="any", prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-"})
    with pytest.raises(UnprocessableEntityError, match="give one of them"):
        client.chat.completions.create(model="any", messages=question, max_tokens=4,
                                       response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})


def test_max_tokens_zero_with_echo_scores_the_prompt_alone(server, w4a8):
    """What lm-eval's loglikelihood requests send: the prompt's tokens scored, nothing generated."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompt = "The capital of France is Paris."
    offline = w4a8.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    done = client.completions.create(model="any", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = done.choices[0]
    assert choice.text == prompt and done.usage.completion_tokens == 0 and choice.finish_reason == "length"
    want = [e[t] for e, t in zip(offline.prompt_logprobs[1:], offline.prompt_token_ids[1:])]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_a_request_past_the_timeout_gets_504_and_the_server_serves_on(w4a8):
    """ServerOptions.request_timeout (`serve --request-timeout`): 504 in OpenAI's error
    shape, or an error event ending the stream; its requests are aborted, others served."""
    from fastapi.testclient import TestClient

    from specdec.serving.server import ServerOptions, create_app

    with TestClient(create_app(w4a8, ServerOptions(request_timeout=0.5))) as client:
        long = {"prompt": "Count:", "max_tokens": 400, "min_tokens": 400}
        r = client.post("/v1/completions", json=long)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        events = client.post("/v1/completions", json={**long, "stream": True}).text
        assert '"code": "timeout"' in events and "[DONE]" not in events
        assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        deadline = time.time() + 10  # aborts reach the engine thread as commands
        while w4a8.engine.requests and time.time() < deadline:
            time.sleep(0.05)
        assert not w4a8.engine.requests


def test_a_grammar_the_engine_gives_up_on_fails_its_request_alone(server):
    """A grammar llguidance cannot follow within its limits is a 400 for that request; the
    requests beside it in the batch are served."""
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, f"{server}/v1/completions", json={
            "prompt": "x", "max_tokens": 8, "guided_regex": "(a{1000}){1000}"}, timeout=60)
        good = pool.submit(httpx.post, f"{server}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16},
                           timeout=60)
        assert bad.result().status_code == 400 and "simplify the grammar" in bad.result().json()["error"]["message"]
        assert good.result().status_code == 200 and good.result().json()["usage"]["completion_tokens"] == 16


def test_the_openapi_schema_documents_every_status_and_a_fuzzer_finds_no_fault(tmp_path, w4a8):
    """Every status the server answers is in /openapi.json, /metrics is documented as text;
    schemathesis, driven by that schema, finds no 5xx, no undocumented status and no crash
    in a bounded run against the real server (a tiny random Llama with the embedded
    model's tokenizer, so that generated requests of many tokens cost little)."""
    import subprocess
    import sys
    from pathlib import Path

    model = testing.tiny_model_dir(tmp_path / "tiny", vocab_size=len(w4a8.tokenizer))
    w4a8.tokenizer.save_pretrained(model)
    config = (f"model: {model}\ndtype: float32\nengine: {{max_batch_size: 64, max_model_len: 96}}\n"
              "speculative_config: {decoding_type: ngram}\n")
    with running_server(config, tmp_path) as base:
        spec = httpx.get(f"{base}/openapi.json").json()
        for path in ("/v1/completions", "/v1/chat/completions"):
            assert {"200", "400", "401", "413", "422", "429", "499", "500", "504"} <= set(spec["paths"][path]["post"]
                                                                                           ["responses"])
        assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        fuzz = subprocess.run([str(Path(sys.executable).with_name("schemathesis")), "run", f"{base}/openapi.json",
                               "--checks", "not_a_server_error,status_code_conformance", "--max-examples", "25",
                               "--no-shrink", "--phases", "examples,coverage,fuzzing", "--seed", "1", "--workers", "1",
                               "--request-timeout", "60", "--generation-database", "none", "--max-failures", "5"],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        failures = fuzz.stdout[fuzz.stdout.find("FAILURES"):]  # each failing request, as curl
        assert fuzz.returncode == 0, failures[:6000] + (tmp_path / "server.log").read_text()[-3000:]
        assert httpx.get(f"{base}/health").status_code == 200
