"""llama.cpp (``llama-cpp-python``) as a comparison system of ``specdec bench --llama-cpp``,
run in a process of its own.

Why a process of its own: in the benchmark's process llama.cpp's thread pool and torch's
share the cores and each runtime's threads spin while the other works; measured on a
2-core EPYC, specdec's compiled forward fell from 187 to 137 tok/s beside it. Apart, each
system runs as a user's process would, and the bench still interleaves them request by
request: the parent sends a batch of prompts (token ids) and the worker answers with the
seconds it took and the tokens, timed inside the worker.

Systems: ``plain`` (greedy decoding; with several prompts at once the sequences decode
together, as llama.cpp's server decodes parallel requests) and ``prompt lookup`` (its
prompt-lookup drafting, 10 tokens, one request at a time: its speculative decoding takes
one sequence).
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

INSTALL = "pip install 'specdec[llama-cpp]' (llama-cpp-python; it compiles llama.cpp, a few minutes)"


def require_bindings() -> None:
    """Raise naming the install command where llama-cpp-python is missing."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise ValueError(f"--llama-cpp needs llama-cpp-python: {INSTALL}") from None


class LlamaCppWorker:
    """The llama.cpp systems on ``gguf`` in a child process: ``run(system, prompts)`` returns
    ``(seconds, outputs)``, each output the greedy tokens of a prompt up to ``max_tokens``
    or an end-of-sequence token (not included)."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, max_tokens: int, eos: set[int], batch_size: int):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, str(gguf), n_ctx, threads, max_tokens,
                                                             sorted(eos), batch_size), daemon=True)
        self._process.start()
        child.close()
        self._answer()  # the models are loaded

    def _answer(self):
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the llama.cpp worker process exited (code {self._process.exitcode})") from None
        if kind == "error":
            raise RuntimeError(f"the llama.cpp worker failed: {value}")
        return value

    def run(self, system: str, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
        self._conn.send((system, prompts))
        return self._answer()

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()


def _serve(conn, gguf: str, n_ctx: int, threads: int, max_tokens: int, eos: list[int], batch_size: int) -> None:
    try:
        systems = _systems(gguf, n_ctx, threads, max_tokens, set(eos), batch_size)
        conn.send(("ready", None))
        while (message := conn.recv()) is not None:
            system, prompts = message
            started = time.perf_counter()
            outputs = systems[system](prompts)
            conn.send(("done", (time.perf_counter() - started, outputs)))
    except EOFError:  # the bench ended without a goodbye: nobody to answer
        return
    except Exception as exc:  # noqa: BLE001 - reported to the bench, which names it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _systems(gguf: str, n_ctx: int, threads: int, max_tokens: int, eos: set[int], batch_size: int) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def one_at_a_time(**extra):
        model = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                      **extra)

        def run(prompts: list[list[int]]) -> list[list[int]]:
            outputs = []
            for ids in prompts:
                out: list[int] = []
                for token in model.generate(ids, top_k=1, temp=0.0, reset=True):
                    if token in eos:
                        break
                    out.append(token)
                    if len(out) == max_tokens:
                        break
                outputs.append(out)
            return outputs
        return run

    if batch_size == 1:
        plain = one_at_a_time()
    else:
        model = Llama(model_path=gguf, n_ctx=64, n_threads=threads, verbose=False)
        plain = _batched(model, min(n_ctx, 2048) * batch_size, batch_size, threads, max_tokens, eos)
    return {"plain": plain, "prompt lookup": one_at_a_time(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))}


def _batched(model, n_ctx: int, batch_size: int, threads: int, max_tokens: int, eos: set[int]):
    """Greedy decoding of a batch's sequences together, as llama.cpp's server decodes
    parallel requests: a context of ``batch_size`` sequences over one KV cache, each step one
    ``llama_decode`` of every unfinished sequence's newest token (prompts prefilled one
    sequence at a time). Through the bindings' low-level API: their ``Llama`` class holds
    one sequence."""
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, 512, 512, batch_size
    params.n_threads = params.n_threads_batch = threads
    params.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(model._model.model, params)
    if not ctx:
        raise ValueError(f"llama.cpp could not make a context of {batch_size} sequences and {n_ctx} tokens")
    vocab = model.n_vocab()
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, batch_size)

    def decode(tokens: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, sequence, wants logits)``."""
        for i, (token, pos, seq, logits) in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())

    def run(prompts: list[list[int]], model=model) -> list[list[int]]:  # the context needs the model alive
        outs: list[list[int]] = [[] for _ in prompts]
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        nxt = {}
        for seq, prompt in enumerate(prompts):
            for start in range(0, len(prompt), params.n_batch):
                chunk = prompt[start:start + params.n_batch]
                decode([(t, start + j, seq, start + j == len(prompt) - 1) for j, t in enumerate(chunk)])
            nxt[seq] = argmax(len(chunk) - 1)
        while nxt:
            for seq, token in list(nxt.items()):
                if token in eos:
                    del nxt[seq]
                    continue
                outs[seq].append(token)
                if len(outs[seq]) == max_tokens:
                    del nxt[seq]
            order = list(nxt)
            if order:
                decode([(nxt[seq], len(prompts[seq]) + len(outs[seq]) - 1, seq, True) for seq in order])
                nxt = {seq: argmax(i) for i, seq in enumerate(order)}
        return outs

    return run
