"""Built-in prompts written for specdec, by category (chat messages).

Input-grounded categories (the answer reuses text from the prompt) are where prompt
lookup shines; open-ended ones show what a method costs when drafts rarely match.
"""

from __future__ import annotations

APOLLO = (
    "The Apollo program was the third United States human spaceflight program carried out by NASA, which "
    "accomplished landing the first humans on the Moon from 1969 to 1972. It was first conceived during Dwight "
    "D. Eisenhower's administration as a three-person spacecraft to follow the one-person Project Mercury, which "
    "put the first Americans in space. Apollo was later dedicated to President John F. Kennedy's national goal of "
    "landing a man on the Moon and returning him safely to the Earth by the end of the 1960s. Kennedy's goal was "
    "accomplished on the Apollo 11 mission when astronauts Neil Armstrong and Buzz Aldrin landed their Apollo "
    "Lunar Module on July 20, 1969, and walked on the lunar surface, while Michael Collins remained in lunar orbit "
    "in the command and service module.")

INVENTORY = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if name in self.items:
            self.items[name] = self.items[name] + count
        else:
            self.items[name] = count

    def remove(self, name, count):
        self.items[name] = self.items[name] - count

    def total(self):
        total = 0
        for name in self.items:
            total = total + self.items[name]
        return total
'''

PROMPTS: dict[str, list[str]] = {
    "summarization": [f"Summarize the following text in three sentences, reusing its wording:\n\n{APOLLO}"],
    "code_editing": [f"Rename the method `remove` to `take` and make it raise KeyError for unknown names. "
                     f"Return the whole class.\n\n```python\n{INVENTORY}```"],
    "qa_over_text": [f"Read the text and answer: who remained in lunar orbit, and in which module? Quote the "
                     f"sentence that says so.\n\n{APOLLO}"],
    "chat": ["Give me three tips for keeping houseplants alive."],
    "math_reasoning": ["A train leaves at 9:40 and arrives at 13:05. How long is the journey? Think step by step."],
    "translation": ["Translate into French: The Apollo program landed the first humans on the Moon. Neil Armstrong "
                    "and Buzz Aldrin walked on the lunar surface while Michael Collins stayed in orbit."],
}

INPUT_GROUNDED = ("summarization", "code_editing", "qa_over_text")


def messages(category: str) -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for text in PROMPTS[category]]


class Turns(list):
    """A multi-turn conversation's user messages, answered in order: each turn is sent with
    the turns before it and the answers they got (an agent's loop, a chat's follow-ups)."""


def load_jsonl(path: str) -> dict[str, list[list[dict]]]:
    """A user's prompt set: one JSON object a line, ``{"prompt": "..."}``,
    ``{"messages": [...]}`` or ``{"turns": ["...", ...]}`` (a :class:`Turns`), with an
    optional ``"category"`` (default ``"custom"``)."""
    import json

    sets: dict[str, list[list[dict]]] = {}
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if "turns" in item:
                    conversation = Turns({"role": "user", "content": str(t)} for t in item["turns"])
                else:
                    conversation = (item["messages"] if "messages" in item
                                    else [{"role": "user", "content": item["prompt"]}])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{number}: expected {{\"prompt\": ...}}, {{\"messages\": [...]}} or "
                    f"{{\"turns\": [...]}} ({exc})") from None
            sets.setdefault(item.get("category", "custom"), []).append(conversation)
    if not sets:
        raise ValueError(f"{path}: no prompts")
    return sets
