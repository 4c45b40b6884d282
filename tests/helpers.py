"""Shared test helpers (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import collections
import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch

from specdec import Drafter, DraftProposal, hookimpl
from specdec.drafting.tree import ancestor_mask
from specdec.kvcache.layout import AttentionLayout, SequenceSlice
from specdec.testing import first_divergence, near_tie_at  # noqa: F401 - re-exported for the tests


class OracleDrafter(Drafter):
    """Test drafter: mixes the true greedy continuation with random tokens, as chains or trees.

    ``config.options``: ``oracle`` (dict: tuple(prompt) -> full greedy continuation),
    ``tree`` (bool), ``seed``.
    """

    def __init__(self, config, target):
        super().__init__(config, target)
        self.oracle = config.options.get("oracle", {})
        self.tree = config.options.get("tree", False)
        self.gen = torch.Generator().manual_seed(config.options.get("seed", 0))

    def _truth(self, req, k):
        full = self.oracle.get(tuple(req.token_ids[:req.prompt_len]), [])
        done = req.num_output_tokens
        return full[done:done + k]

    def _rand(self):
        return int(torch.randint(0, self.target.vocab_size, (), generator=self.gen))

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        out = []
        for req, k in zip(requests, draft_lens):
            truth = self._truth(req, k)
            keep = int(torch.randint(0, len(truth) + 1, (), generator=self.gen)) if truth else 0
            chain = truth[:keep] + [self._rand() for _ in range(k - keep)]
            if not self.tree:
                out.append(DraftProposal(token_ids=chain))
                continue
            # A tree: a random decoy branch first at each level, then the chain node.
            tokens, parents, parent = [], [], -1
            for tok in chain:
                tokens.append(self._rand())
                parents.append(parent)
                tokens.append(tok)
                parents.append(parent)
                parent = len(tokens) - 1
            out.append(DraftProposal(token_ids=tokens, parents=parents))
        return out


class StateWatcher(Drafter):
    """Drafts nothing; keeps every verified result (``seen``, cleared by the test), with
    the hidden states of the first layer and the final norm."""

    seen: list = []

    @hookimpl
    def target_hidden_layers(self, target):
        return [0, -1]

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        return [None] * len(requests)

    @hookimpl
    def on_draft_verified(self, results):
        self.seen.extend(results)


class LastStateWatcher(StateWatcher):
    """As :class:`StateWatcher`, with the final norm's state alone (what EAGLE, MTP,
    Medusa and ReDrafter read)."""

    seen: list = []

    @hookimpl
    def target_hidden_layers(self, target):
        return [-1]


def random_layout(gen, block_size: int, num_blocks: int, shapes: list, device: str = "cpu") -> AttentionLayout:
    """shapes: (committed tokens, new tokens, tree?) per sequence."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for start, n, tree in shapes:
        need = -(-(start + n) // block_size)
        table = [free.pop() for _ in range(need)]
        if tree:
            parents = [-1] + [int(torch.randint(-1, i, (), generator=gen)) for i in range(n - 2)]
            mask = ancestor_mask(parents)
            depths = [0] + [1 if p < 0 else 0 for p in parents]
            for i, p in enumerate(parents):
                depths[i + 1] = 1 if p < 0 else depths[p + 1] + 1
            positions = start + torch.tensor(depths)
        else:
            mask, positions = None, torch.arange(start, start + n)
        seqs.append(SequenceSlice(block_table=table, start=start, positions=positions, tree_mask=mask))
    return AttentionLayout(seqs, block_size, torch.device(device))


def specdec_cli(*args: str, input: str | None = None, env: dict | None = None,
                timeout: int = 900) -> subprocess.CompletedProcess:
    """``python -m specdec.cli ARGS`` as a user runs it, in a process of its own."""
    return subprocess.run([sys.executable, "-m", "specdec.cli", *args], capture_output=True, text=True, input=input,
                          timeout=timeout, env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})


def specdec_main(*args: str) -> subprocess.CompletedProcess:
    """The command line's ``main(ARGS)`` in this process, its status (argparse's exits
    included) and its output captured as :func:`specdec_cli` returns them: where a process
    of its own would add only its imports and model loads (10-15 s on CI's 2 cores), not
    what the test is about."""
    from specdec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(["specdec", *args], code, out.getvalue(), err.getvalue())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_processes(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def tiny_chat_model(directory) -> Path:
    """A tiny random Llama (4 heads, 2 KV heads) with the embedded model's tokenizer and chat
    template: text in and out at a tiny model's cost."""
    from specdec.model.loading import resolve_model_dir
    from specdec.testing import tiny_model_dir

    path = tiny_model_dir(directory, "llama", vocab_size=49152)
    source = resolve_model_dir(None)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, path / name)
    return path


def long_document_prompt(tokenizer, num_tokens: int) -> list[int]:
    """A summarization request of exactly ``num_tokens`` tokens: an instruction, then the
    project's own documentation (repeated as needed) as the text to summarize, cut to size,
    in the model's chat template. What a RAG or summarization user sends."""
    docs = sorted((Path(__file__).parents[1] / "docs").glob("*.md"))
    text = "\n\n".join(p.read_text() for p in docs)
    head = tokenizer.apply_chat_template([{"role": "user", "content": "Summarize this document:\n\n"}],
                                         tokenize=False).split("Summarize")[0]
    ids = tokenizer(head + "Summarize this document:\n\n", add_special_tokens=False).input_ids
    body = tokenizer(text, add_special_tokens=False).input_ids
    tail = tokenizer("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    need = num_tokens - len(ids) - len(tail)
    body = (body * (need // len(body) + 1))[:need]
    return ids + body + tail


def count_accepted_by_source(monkeypatch) -> collections.Counter:
    """Draft tokens the target accepts from here on, in every engine, by who drafted them:
    ``lookup`` (``speculative_config.lookup``) or ``method``."""
    from specdec.drafting.interface import is_lookup_kind
    from specdec.executor.planner import DraftPlanner

    counts = collections.Counter()
    observe = DraftPlanner.observe_decode

    def counting(self, req, proposal, accepted_nodes):
        if proposal is not None:
            counts["lookup" if is_lookup_kind(proposal.kind) else "method"] += len(accepted_nodes)
        return observe(self, req, proposal, accepted_nodes)

    monkeypatch.setattr(DraftPlanner, "observe_decode", counting)
    return counts
