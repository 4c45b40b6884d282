"""`specdec serve` in a subprocess for tests and scripts, and the text of a streamed chat
through the ``openai`` client."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specdec.parallel.group import free_port


@contextlib.contextmanager
def running_server(config: str, directory: str | Path, args: tuple[str, ...] = (),
                   env: dict | None = None) -> Iterator[str]:
    """`specdec serve` with ``config`` (YAML text, written into ``directory``) on a free
    loopback port, in a subprocess, with more command-line ``args`` and ``env`` variables,
    its output in ``directory/server.log``: yields its base URL, stops it on exit."""
    import httpx

    cfg = Path(directory) / "cfg.yaml"
    cfg.write_text(config)
    port = free_port()
    log = Path(directory) / "server.log"  # a file, not a pipe: an unread pipe fills and stalls the server
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "-c", str(cfg), "--port", str(port),
                                 *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {log.read_text()}")
            if time.time() > deadline:
                raise RuntimeError("the server did not start within 180 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # still busy after 30 s: no server outlives its test
            proc.kill()
            proc.wait()


def stream_chat(client, prompt: str, **options) -> str:
    """The text of one streamed chat completion of ``prompt`` through an ``openai.OpenAI`` client."""
    chunks = client.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}], stream=True,
                                            **options)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
