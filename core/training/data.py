"""Training data for drafters: self-distillation through the engine.

The target answers the prompts of a JSONL file (``{"prompt": ...}`` or ``{"messages":
[...]}``, as ``specdec bench`` reads them) with the engine's own continuous batching, and
every answer becomes a :class:`Sample`: prompt and answer tokens, with the loss on the
answer. Lines ``{"text": ...}`` are used as they are (teacher forcing: the loss covers the
whole text, and the labels are the target's own predictions, computed at training time).
Public instruction sets are read as they are published, a JSON list or JSONL: Alpaca's
``{"instruction", "input"}`` and ShareGPT's ``{"conversations": [{"from", "value"}]}``
become prompts (a conversation up to its first user turn: the target writes its own
answers, and a dataset's answers, another model's, are never learnt).

Answers are appended to ``samples.jsonl`` in the run directory as they finish, a chunk
at a time, so an interrupted run resumes where it stopped and later epochs (and later
runs on the same directory) reuse them.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import attrs
import torch

from ..errors import SpecdecError

log = logging.getLogger(__name__)


class TrainingDataError(SpecdecError):
    """The training data file is missing, empty or malformed."""


@attrs.frozen
class Sample:
    """One training sequence.

    Attributes:
        token_ids: prompt followed by the target's answer (or a plain text).
        loss_start: first position whose *next* token is learnt; the prompt before it
            is context only.
        labels_from_target: True for plain text, whose labels the target must predict
            at training time; False when ``token_ids`` after the prompt already are the
            target's own greedy answer.
    """

    token_ids: list[int]
    loss_start: int
    labels_from_target: bool = False


#: ShareGPT's speaker names of a user turn
USER_SPEAKERS = {"human", "user"}


def item_from_record(record) -> dict | None:
    """A training item from one record of a supported format, None for a record of none:
    ``prompt`` / ``messages`` / ``text`` as they are; Alpaca's instruction (and input)
    as a prompt; a ShareGPT conversation's first user turn as a prompt."""
    if not isinstance(record, dict):
        return None
    if {"prompt", "messages", "text"} & record.keys():
        return record
    if isinstance(record.get("instruction"), str) and record["instruction"].strip():
        extra = record.get("input")
        return {"prompt": record["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra else "")}
    turns = record.get("conversations")
    if isinstance(turns, list):
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") in USER_SPEAKERS and isinstance(turn.get("value"), str):
                return {"prompt": turn["value"]}
    return None


EXPECTED = ('expected {"prompt": ...}, {"messages": [...]}, {"text": ...}, Alpaca\'s {"instruction": ...} or '
            'ShareGPT\'s {"conversations": [...]}')


def _records(path: Path, skip_unreadable: bool) -> list[tuple[str, object]]:
    """(where, record) of a ``.json`` list or a JSONL file; an unreadable line is skipped
    with ``skip_unreadable``, refused otherwise."""
    if path.suffix == ".json":
        try:
            records = json.loads(path.read_text())
        except ValueError as exc:
            raise TrainingDataError(f"{path}: not JSON ({exc})") from None
        if not isinstance(records, list):
            raise TrainingDataError(f"{path}: a .json file must hold a list of records; {EXPECTED}")
        return [(f"{path} record {n}", record) for n, record in enumerate(records, 1)]
    numbered = []
    with path.open() as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                numbered.append((f"{path}:{number}", json.loads(line)))
            except ValueError as exc:
                if not skip_unreadable:
                    raise TrainingDataError(f"{path}:{number}: not JSON ({exc})") from None
    return numbered


def read_items(path: str | Path) -> list[dict]:
    """The file's items, checked: a JSONL file (or a ``.json`` list) of records
    :func:`item_from_record` reads."""
    path = Path(path)
    if not path.is_file():
        raise TrainingDataError(f"{path}: no such file; give a JSONL file of {{\"prompt\": ...}} lines")
    items = []
    for where, record in _records(path, skip_unreadable=False):
        item = item_from_record(record)
        if item is None:
            raise TrainingDataError(f"{where}: {EXPECTED}")
        items.append(item)
    if not items:
        raise TrainingDataError(f"{path}: the file has no training items")
    return items


def public_prompts(paths: list[str | Path], max_chars: int) -> list[str]:
    """The requests of public training sets, for a pool of prompts: each file's records
    :func:`item_from_record` reads as a prompt, in order, without repeats, requests longer
    than ``max_chars``, or the lines and records such collections carry broken."""
    seen, prompts = set(), []
    for path in paths:
        for _, record in _records(Path(path), skip_unreadable=True):
            prompt = (item_from_record(record) or {}).get("prompt")
            prompt = prompt.strip() if isinstance(prompt, str) else ""
            if prompt and len(prompt) <= max_chars and prompt not in seen:
                seen.add(prompt)
                prompts.append(prompt)
    return prompts


def split_eval(items: list[dict], num_eval: int) -> tuple[list[dict], list[dict]]:
    """Hold the last ``num_eval`` prompt items (at most a quarter of them) out of training,
    for the final evaluation."""
    prompts = [i for i, item in enumerate(items) if "text" not in item]
    num_eval = min(num_eval, len(prompts) // 4)
    held = set(prompts[len(prompts) - num_eval:]) if num_eval > 0 else set()
    return [it for i, it in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


def encode_prompt(llm, item: dict) -> list[int]:
    """A prompt item's tokens: through the chat template when the model has one (a base
    model without one reads a ``prompt`` as it is, :meth:`specdec.LLM.apply_chat_template`)."""
    return llm.apply_chat_template(item["messages"] if "messages" in item
                                   else [{"role": "user", "content": item["prompt"]}])


def distill(llm, items: list[dict], cache: Path, max_new_tokens: int, chunk: int = 64,
            progress=None) -> list[Sample]:
    """Samples for ``items``: the target's greedy answers, generated once and cached in ``cache``.

    ``llm`` is a :class:`specdec.LLM` without speculation. ``progress(done, total)`` is
    called after each chunk.
    """
    from ..sampling_params import SamplingParams

    cache.parent.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    if cache.exists():
        with cache.open() as fh:
            done = [json.loads(line) for line in fh if line.strip()]
    samples = [Sample(d["token_ids"], d["loss_start"], d.get("labels_from_target", False)) for d in done]
    todo = items[len(done):]
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    if done:
        log.info("reusing %d cached answers from %s", len(done), cache)
    for first in range(0, len(todo), chunk):
        batch = todo[first:first + chunk]
        prompts = [encode_prompt(llm, it) for it in batch if "text" not in it]
        outs = llm.generate(prompts, params) if prompts else []
        new: list[Sample] = []
        answers = iter(outs)
        for it in batch:
            if "text" in it:
                ids = llm.encode(it["text"])
                new.append(Sample(ids, 0, labels_from_target=True))
            else:
                out = next(answers)
                new.append(Sample(out.prompt_token_ids + out.token_ids, len(out.prompt_token_ids) - 1))
        with cache.open("a") as fh:
            for s in new:
                fh.write(json.dumps(attrs.asdict(s)) + "\n")
        samples += new
        if progress is not None:
            progress(len(samples), len(items))
    return samples


def draft_vocabulary(target, samples, size: int) -> torch.Tensor:
    """The tokens a drafter for ``target`` learns to draft, on its device: the ``size`` most
    frequent in the answers plus the end-of-sequence token, or every token when ``size`` is
    0 or covers the vocabulary."""
    vocab = target.parts.vocab_size
    if size <= 0 or size >= vocab:
        return torch.arange(vocab, device=target.device)
    eos = getattr(target.tokenizer, "eos_token_id", None)
    return frequent_tokens(samples, size, {eos} if eos is not None else set()).to(target.device)


def frequent_tokens(samples, size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` tokens most frequent in the samples' answers (plus ``always``), sorted."""
    counts = Counter()
    for s in samples:
        counts.update(s.token_ids[s.loss_start + 1:])
    chosen = set(always) | {t for t, _ in counts.most_common(max(0, size - len(always)))}
    covered = sum(counts[t] for t in chosen) / max(1, sum(counts.values()))
    log.info("draft vocabulary: %d tokens cover %.1f%% of the answer tokens", len(chosen), 100 * covered)
    return torch.tensor(sorted(chosen))
