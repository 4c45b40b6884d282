"""How long an engine takes to start: ``LLM``s built one after another in one process.

    .venv/bin/python scripts/startup_time.py [plain ngram eagle3 plain] [--cold] [--max-tokens 16]

Builds an ``LLM`` on the default target for each method in turn (``plain``: no drafter),
each timed from its constructor to its first answer, and prints the seconds of each and
in all. ``--cold`` points torch's compile caches at a new folder first, as on a fresh
machine. Run a commit against another by running the script in each, alternately.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", default=["plain", "ngram", "eagle3", "plain"])
    parser.add_argument("--cold", action="store_true", help="torch's compile caches in a new folder")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    started = time.perf_counter()
    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    seconds = []
    for method in args.methods:
        began = time.perf_counter()
        llm = LLM(speculative_config=None if method == "plain" else {"decoding_type": method})
        llm.generate(["Hi"], params)
        seconds.append(time.perf_counter() - began)
        del llm
    print("  ".join(f"{m} {s:.1f} s" for m, s in zip(args.methods, seconds)),
          f"  in all (imports included) {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
