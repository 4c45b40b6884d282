"""Soak `specdec serve`: many concurrent requests of every kind users send, then the books.

For each method, a server on the default CPU target (batch-invariant, so a request's answer
does not depend on its neighbours) takes ``--requests`` requests from ``--concurrency``
clients: prompts of 1 to 4,000 tokens (the repository's own docs, cut to length), greedy
and seeded sampling, streamed and whole, ``n > 1``, structured output (a JSON object),
clients that disconnect mid-stream and clients that give up before the answer (aborts).
It reports answers and errors by kind, the server's and the engine's resident memory after
warm-up and at the end, whether the KV cache is empty again, and re-runs a sample of the
completed answers alone, one at a time, which must equal their runs in the crowd.

    .venv/bin/python scripts/soak.py --methods plain,ngram,eagle3 --requests 600 --concurrency 16
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

LENGTHS = (1, 3, 12, 40, 120, 300, 700, 1500, 2500, 4000)
WEIGHTS = (4, 6, 14, 22, 22, 12, 8, 6, 3, 3)
KINDS = ("whole", "stream", "sampled", "n2", "json", "disconnect", "abort")
KIND_WEIGHTS = (24, 22, 16, 10, 8, 12, 8)


def doc_tokens(tokenizer) -> list[int]:
    root = Path(__file__).resolve().parents[1] / "docs"
    text = "\n\n".join(p.read_text() for p in sorted(root.glob("*.md")))
    return tokenizer(text, add_special_tokens=False).input_ids


def make_requests(count: int, seed: int, corpus: list[int]) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        length = rng.choices(LENGTHS, WEIGHTS)[0]
        start = rng.randrange(len(corpus) - length)
        request = {"id": i, "kind": kind, "prompt": corpus[start:start + length],
                   "max_tokens": rng.choice((4, 8, 16, 32))}
        if kind == "sampled":
            request.update(temperature=0.8, top_p=0.95, seed=rng.randrange(10**6))
        requests.append(request)
    return requests


def body_of(request: dict) -> tuple[str, dict]:
    kind = request["kind"]
    sampling = {"max_tokens": request["max_tokens"], "temperature": request.get("temperature", 0)}
    if "seed" in request:
        sampling.update(top_p=request["top_p"], seed=request["seed"])
    if kind == "json":
        words = " ".join(str(t) for t in request["prompt"][:20])
        return "/v1/chat/completions", {**sampling, "max_tokens": 32, "response_format": {"type": "json_object"},
                                        "messages": [{"role": "user", "content": f"Describe as JSON: {words}"}]}
    body = {**sampling, "prompt": request["prompt"]}
    if kind == "n2":
        body["n"] = 2
    if kind in ("stream", "disconnect"):
        body["stream"] = True
    return "/v1/completions", body


def send(base: str, request: dict) -> tuple[str, list[str] | None]:
    """(outcome, the choices' texts where complete)."""
    path, body = body_of(request)
    kind = request["kind"]
    try:
        if body.get("stream"):
            pieces = []
            with httpx.stream("POST", base + path, json=body, timeout=900) as r:
                if r.status_code != 200:
                    return f"http {r.status_code}", None
                for n, line in enumerate(r.iter_lines()):
                    if kind == "disconnect" and n >= 3:
                        return "disconnected", None
                    if line == "data: [DONE]":
                        return "ok", ["".join(pieces)]
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            return f"stream error: {event['error']['message'][:60]}", None
                        pieces.append(event["choices"][0]["text"] if event["choices"] else "")
            return "stream ended without [DONE]", None
        r = httpx.post(base + path, json=body, timeout=0.3 if kind == "abort" else 900)
    except httpx.TimeoutException:
        return ("aborted" if kind == "abort" else "client timeout"), None
    if r.status_code != 200:
        return f"http {r.status_code}: {r.json()['error']['message'][:60]}", None
    choices = r.json()["choices"]
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in choices]
    if kind == "json":
        try:
            json.loads(texts[0])
        except ValueError:
            return ("json cut at max_tokens" if choices[0]["finish_reason"] == "length" else "invalid json"), texts
    return "ok", texts


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_pids(port: str) -> tuple[int, int]:
    """The server process listening on ``port`` and its engine process."""
    def cmdline(pid):
        try:
            return Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            return ""

    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    server = next(p for p in pids if f"--port\0{port}\0" in cmdline(p))
    engine = next(p for p in pids if "spawn_main" in cmdline(p)
                  and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(server))
    return server, engine


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def soak(method: str, args, corpus: list[int]) -> dict:
    from specdec_test_support.served import running_server

    config = "engine: {batch_invariant: true}\n"
    if method != "plain":
        config += f"speculative_config: {{decoding_type: {method}}}\n"
    requests = make_requests(args.requests, args.seed, corpus)
    with tempfile.TemporaryDirectory() as tmp, running_server(config, tmp) as base:
        server, engine = server_pids(base.rsplit(":", 1)[1])
        warm = make_requests(2 * args.concurrency, args.seed + 1, corpus)
        with ThreadPoolExecutor(args.concurrency) as pool:  # warm-up: compile, allocator, caches
            list(pool.map(lambda r: send(base, r), warm))
        start_rss = rss_mb(server), rss_mb(engine)
        started = time.perf_counter()
        results, engine_trace = [], []
        part = -(-len(requests) // args.parts)
        with ThreadPoolExecutor(args.concurrency) as pool:  # the engine's RSS after each part
            for first in range(0, len(requests), part):
                results += pool.map(lambda r: send(base, r), requests[first:first + part])
                engine_trace.append(round(rss_mb(engine)))
        seconds = time.perf_counter() - started
        deadline = time.time() + 60
        while time.time() < deadline and (metric(base, "specdec_kv_cache_usage") or
                                          metric(base, "specdec_running_requests")):
            time.sleep(0.5)
        kv_usage, running = metric(base, "specdec_kv_cache_usage"), metric(base, "specdec_running_requests")
        end_rss = rss_mb(server), rss_mb(engine)
        rng = random.Random(args.seed)
        completed = [(r, texts) for r, (outcome, texts) in zip(requests, results)
                     if outcome == "ok" and r["kind"] in ("whole", "stream", "sampled", "n2")]
        mismatches = []
        for request, texts in rng.sample(completed, min(args.rerun, len(completed))):
            alone = send(base, {**request, "kind": "whole" if request["kind"] == "stream" else request["kind"]})[1]
            if alone != texts:
                mismatches.append((request["id"], request["kind"], len(request["prompt"]), texts, alone))
    outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for request, (outcome, _) in zip(requests, results):
        outcomes[request["kind"]][outcome] += 1
    return {"method": method, "requests": len(requests), "seconds": round(seconds, 1),
            "outcomes": {k: dict(v) for k, v in outcomes.items()},
            "rss_mb_server": [round(start_rss[0]), round(end_rss[0])],
            "rss_mb_engine": [round(start_rss[1]), round(end_rss[1])],
            "rss_mb_engine_by_part": engine_trace,
            "kv_cache_usage_after": kv_usage, "running_after": running,
            "reruns": min(args.rerun, len(completed)), "rerun_mismatches": mismatches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="plain,ngram,eagle3")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rerun", type=int, default=40, help="completed answers re-run alone")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", type=int, default=4,
                        help="the engine's memory is read after each part of the requests")
    args = parser.parse_args()

    from specdec.model.loading import load_tokenizer, resolve_model_dir

    corpus = doc_tokens(load_tokenizer(resolve_model_dir(None)))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores", flush=True)
    for method in args.methods.split(","):
        print(json.dumps(soak(method, args, corpus)), flush=True)


if __name__ == "__main__":
    main()
