"""Build the self-distillation prompt set the shipped drafters are trained on.

No hub is reachable here, so the prompts are made from what this machine has: sentences
and paragraphs of the Python standard library's docstrings (for translation, summaries,
explanations) and hand-written templates with random fillers (open questions, lists,
short writing tasks, arithmetic word problems, small coding tasks). None of them is a
prompt of ``specdec bench``'s built-in sets (checked below) or of a public evaluation set.

    python scripts/make_train_prompts.py --out train_prompts/prompts.jsonl --count 2400 --seed 0

The target model answers these prompts during ``specdec train`` (self-distillation).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import random
import re
import sys
import warnings

ACTIVITIES = ["learning to cook", "running a first marathon", "saving money each month", "studying for exams",
              "starting a vegetable garden", "learning a new language", "writing a novel", "moving to a new city",
              "training a puppy", "planning a wedding", "organising a small office", "teaching kids to read",
              "getting better sleep", "building a wooden shelf", "preparing for a job interview",
              "learning to draw", "cycling to work", "camping in the mountains", "hosting a dinner party",
              "reducing screen time", "keeping a journal", "learning the guitar", "painting a room",
              "travelling on a budget", "taking better photos", "making friends as an adult",
              "working from home", "baking bread", "volunteering locally", "learning chess",
              "caring for an old cat", "decluttering a flat", "managing a team", "giving a public talk",
              "learning to swim", "brewing coffee at home", "birdwatching", "fixing a leaking tap"]
SUBJECTS = ["the sea", "an old lighthouse", "a rainy morning", "a lost key", "the first snow", "a busy market",
            "a quiet library", "a robot that learns to paint", "a fox in the city", "the last train home",
            "a mountain village", "a forgotten letter", "autumn leaves", "a broken clock", "a summer storm",
            "a friendly dragon", "the night sky", "a small bakery", "an abandoned garden", "a long journey",
            "a river at dawn", "a curious child", "a desert road", "an island", "a winter market",
            "a violin maker", "a cat on a roof", "the moon over a lake", "a school trip", "a paper boat"]
FORMS = ["poem", "short story", "haiku", "diary entry", "letter to a friend", "product description",
         "limerick", "news report", "dialogue between two friends", "speech"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
CODE_TASKS = ["reverses a string", "checks whether a number is prime", "counts the words in a text",
              "merges two sorted lists", "removes duplicates from a list while keeping order",
              "computes the factorial of n", "finds the largest element of a list", "converts Celsius to Fahrenheit",
              "returns the n-th Fibonacci number", "checks whether a string is a palindrome",
              "flattens a nested list", "groups words by their first letter", "parses a date like 2024-03-01",
              "computes the average of a list of numbers", "reads a CSV file and sums a column",
              "finds the most common character in a string", "rotates a list by k positions",
              "checks whether two words are anagrams", "computes the greatest common divisor",
              "converts a number to binary", "validates an email address with a regular expression",
              "transposes a matrix", "counts vowels in a sentence", "sorts a list of dictionaries by a key",
              "implements binary search", "chunks a list into pieces of size n", "capitalises every word"]
NAMES = ["Ana", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Rosa", "Sami", "Tara", "Yuki"]
ITEMS = ["apples", "notebooks", "pencils", "tickets", "loaves of bread", "candles", "plants", "mugs", "books",
         "oranges", "stamps", "batteries"]
QUESTION_FORMS = ["Explain in simple terms: {}", "What is meant by the following? {}",
                  "Give an example that illustrates this idea: {}", "Why would someone need this? {}",
                  "Rewrite this sentence in plain English: {}", "Summarize in one sentence: {}"]


def docstring_text(limit_modules: int = 400) -> tuple[list[str], list[str]]:
    """Sentences and paragraphs from the standard library's module, class and function docstrings."""
    sentences, paragraphs = [], []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix))
    warnings.simplefilter("ignore")
    for name in names[:limit_modules]:
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "turtledemo", "tkinter"}:
            continue
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        docs = [module.__doc__] + [getattr(getattr(module, a, None), "__doc__", None) for a in dir(module)[:60]]
        for doc in docs:
            if not doc or not isinstance(doc, str):
                continue
            for para in re.split(r"\n\s*\n", doc):
                flat = " ".join(para.split())
                if not re.fullmatch(r"[A-Za-z][A-Za-z0-9 ,.;:'()\-]+", flat or "-"):
                    continue
                if 25 <= len(flat.split()) <= 90:
                    paragraphs.append(flat)
                for sent in re.split(r"(?<=[.!?])\s+", flat):
                    if 8 <= len(sent.split()) <= 30 and sent.endswith("."):
                        sentences.append(sent)
    return sorted(set(sentences)), sorted(set(paragraphs))


def arithmetic(rng: random.Random) -> str:
    kind = rng.randrange(4)
    a, b = rng.choice(NAMES), rng.choice(NAMES)
    if kind == 0:
        price, qty = rng.randint(2, 30), rng.randint(2, 15)
        return (f"A shop sells {rng.choice(ITEMS)} for {price} dollars each. {a} buys {qty} of them and pays with "
                f"a {rng.choice([100, 200, 500])} dollar note. How much change does {a} get? Explain your steps.")
    if kind == 1:
        speed, hours = rng.randint(20, 120), rng.randint(2, 9)
        return (f"{a} drives at {speed} km per hour for {hours} hours, then {rng.randint(10, 90)} km more. "
                "How far does she travel in total? Show the calculation.")
    if kind == 2:
        total, pct = rng.randint(40, 900), rng.choice([5, 10, 15, 20, 25, 30, 40])
        return (f"What is {pct} percent of {total}? Then add {rng.randint(3, 60)} to the result. "
                "Work it out step by step.")
    x, y = rng.randint(3, 40), rng.randint(3, 40)
    return (f"{a} has {x} marbles and {b} has {y}. {a} gives {b} {rng.randint(1, x)} marbles. How many marbles "
            "does each of them have now? Reason step by step.")


def build(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    sentences, paragraphs = docstring_text()
    makers = [
        lambda: f"Give me {rng.randint(3, 6)} tips for {rng.choice(ACTIVITIES)}.",
        lambda: f"What are the main challenges of {rng.choice(ACTIVITIES)}, and how can I deal with them?",
        lambda: f"Write a {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}.",
        lambda: f"Describe {rng.choice(SUBJECTS)} in a few vivid sentences.",
        lambda: f"Translate into {rng.choice(LANGUAGES)}: {rng.choice(sentences)}",
        lambda: f"Translate into {rng.choice(LANGUAGES)}: {rng.choice(sentences)} {rng.choice(sentences)}",
        lambda: rng.choice(QUESTION_FORMS).format(rng.choice(sentences)),
        lambda: f"Summarize the following paragraph:\n\n{rng.choice(paragraphs)}",
        lambda: f"Write a Python function that {rng.choice(CODE_TASKS)}, with a short explanation.",
        lambda: f"How would you test a function that {rng.choice(CODE_TASKS)}?",
        lambda: arithmetic(rng), lambda: arithmetic(rng),
        lambda: (f"Compare {rng.choice(ACTIVITIES)} and {rng.choice(ACTIVITIES)}: which one takes more patience, "
                 "and why?"),
        lambda: f"Plan a simple one-week schedule for {rng.choice(ACTIVITIES)}.",
    ]
    from specdec.bench.prompt_sets import PROMPTS

    forbidden = {p for prompts in PROMPTS.values() for p in prompts}
    seen, out = set(), []
    while len(out) < count:
        prompt = rng.choice(makers)()
        if prompt in seen or prompt in forbidden:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="train_prompts/prompts.jsonl")
    parser.add_argument("--count", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = build(args.count, args.seed)
    with open(args.out, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    print(f"{len(rows)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
