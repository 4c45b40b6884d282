"""Build a second self-distillation prompt set: user requests written by the target itself.

The first set (``scripts/make_train_prompts.py``) is made from the standard library's
docstrings and templates, and the drafters trained on it accept far fewer drafts on chat,
math and translation requests than on held-out prompts of their own distribution. Here the
target writes the requests (the "Magpie" recipe): its chat template up to the start of a
user turn, optionally followed by the opening words of a kind of request, is sampled to
the end of that turn, so the requests follow the distribution the instruction-tuned model
expects. Requests that did not end on their own, are too short or too long, not mostly
plain text, or repeated, are dropped; so is any request sharing six consecutive words
with a prompt of ``specdec bench`` (the built-in sets and ``benchmarks/*.jsonl``), and
then any on a benchmark prompt's topic (:func:`off_topic`): a file of ``--count``
requests at most.

    python scripts/make_self_instruct_prompts.py --out train_prompts/self_instruct.jsonl --count 2400 --seed 1

grows a set with ``--avoid`` (its requests count as repeats) and another seed:

    python scripts/make_self_instruct_prompts.py --out train_prompts/self_instruct_2.jsonl --count 3000 --seed 2 \
        --avoid train_prompts/self_instruct.jsonl

The target then answers them during ``specdec train`` like any other prompt file.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import time
from collections import Counter

# Openings of a user turn (empty: the target writes the whole request) and their weights.
OPENINGS = [
    ("", 6),
    ("Give me", 2), ("Can you explain", 1), ("How do I", 2), ("What are some", 2), ("Why do", 1),
    ("Write a", 2), ("I need help with", 1), ("What is the difference between", 1), ("Tips for", 1),
    ("Solve this step by step:", 2), ("A word problem:", 1), ("Calculate", 1), ("How many", 1),
    ("Translate into French:", 1), ("Translate into Spanish:", 1), ("Translate into German:", 1),
    ("Translate this sentence into Italian:", 1), ("Write a Python function that", 1), ("Summarize", 1),
]
WINDOW = 6  # words shared with a benchmark prompt that disqualify a request


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def shingles(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i:i + WINDOW]) for i in range(len(w) - WINDOW + 1)}


def benchmark_texts() -> list[str]:
    """The prompts of ``specdec bench``: built-in sets and ``benchmarks/*.jsonl``."""
    from specdec.bench.prompt_sets import PROMPTS, load_jsonl

    texts = [p for prompts in PROMPTS.values() for p in prompts]
    for path in sorted(glob.glob("benchmarks/*.jsonl")):
        for conversations in load_jsonl(path).values():
            texts += [m["content"] for conv in conversations for m in conv]
    return texts


def topic_words(text: str, common: set[str]) -> set[str]:
    return {w for w in words(text) if len(w) >= 4 and w not in common}


def off_topic(rows: list[dict], benchmarks: list[str], common_share: float = 0.01) -> list[dict]:
    """Drop requests on the topic of a benchmark prompt: two or more words of four letters
    or more in common with one, leaving out words found in more than ``common_share`` of
    the requests ("explain", "write", "tips": wording, not topic)."""
    counts = Counter(w for row in rows for w in set(words(row["prompt"])))
    common = {w for w, n in counts.items() if n > common_share * len(rows)}
    topics = [topic_words(t, common) for t in benchmarks]
    return [row for row in rows
            if all(len(topic_words(row["prompt"], common) & topic) < 2 for topic in topics)]


def acceptable(text: str, min_words: int, max_words: int) -> bool:
    n = len(text.split())
    if not min_words <= n <= max_words or "<|" in text:
        return False
    plain = sum(c.isascii() or c.isalpha() for c in text) / len(text)
    return plain > 0.97 and sum(c.isalpha() for c in text) / len(text) > 0.6


def build(llm, count: int, seed: int, batch: int, min_words: int, max_words: int, known: set[str] = frozenset(),
          log=print) -> list[dict]:
    """``count`` requests; one whose words are those of a request in ``known`` (or of one
    drawn before) counts as a repeat."""
    from specdec import SamplingParams

    rng = random.Random(seed)
    template = llm.apply_chat_template([{"role": "user", "content": "\x00"}])
    marker = llm.encode("\x00")
    start = next(i for i in range(len(template)) if template[i:i + len(marker)] == marker)
    prefix = template[:start]  # ... <|im_start|>user\n
    forbidden = set().union(*(shingles(t) for t in benchmark_texts()))
    openings, weights = zip(*OPENINGS)
    seen, out, drawn, started = set(known), [], 0, time.perf_counter()
    while len(out) < count:
        chosen = rng.choices(openings, weights, k=batch)
        params = [SamplingParams(max_tokens=96, temperature=0.8, top_p=0.95, seed=seed * 1_000_003 + drawn + i)
                  for i in range(batch)]
        reqs = [llm.engine.add_request(prefix + (llm.encode(o) if o else []), p) for o, p in zip(chosen, params)]
        drawn += batch
        while llm.engine.has_unfinished():
            llm.engine.step()
        for opening, req in zip(chosen, reqs):
            if req.finish_reason != "stop":
                continue
            text = (opening + llm.output_text(req)).strip()
            key = " ".join(words(text))
            if key in seen or not acceptable(text, min_words, max_words) or shingles(text) & forbidden:
                continue
            seen.add(key)
            out.append({"prompt": text, "opening": opening})
        log(f"{len(out)}/{count} requests kept of {drawn} drawn ({time.perf_counter() - started:.0f} s)")
    return out[:count]


def write_requests(out: str, count: int, seed: int, batch: int, min_words: int = 4, max_words: int = 80,
                   avoid: list[str] = ()) -> None:
    """``count`` requests the embedded model writes (``seed``, ``batch`` at a time), less those
    on a benchmark prompt's topic, into the JSONL file ``out``; ``avoid``: prompt files whose
    requests count as repeats."""
    from specdec import LLM

    known = {" ".join(words(json.loads(line)["prompt"])) for path in avoid for line in open(path) if line.strip()}
    llm = LLM(dtype="bfloat16", engine={"max_batch_size": batch})
    drawn = build(llm, count, seed, batch, min_words, max_words, known)
    rows = off_topic(drawn, benchmark_texts())
    with open(out, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"{len(rows)} prompts -> {out} ({len(drawn) - len(rows)} dropped on a benchmark prompt's topic)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="train_prompts/self_instruct.jsonl")
    parser.add_argument("--count", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=80)
    parser.add_argument("--avoid", nargs="*", default=[], metavar="FILE",
                        help="prompt files whose requests count as repeats (to grow a set with another seed)")
    args = parser.parse_args()
    write_requests(args.out, args.count, args.seed, args.batch, args.min_words, args.max_words, args.avoid)


if __name__ == "__main__":
    main()
