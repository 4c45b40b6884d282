"""Native llama.cpp (``llama-server``, ``llama-bench``) as comparison systems of
``specdec bench --llama-cpp native``: what a llama.cpp user runs, not the Python bindings.

The binaries come from ``--llama-cpp-bin DIR``, or ``PATH``, or the user cache, where they
are built once from the llama.cpp source that the llama-cpp-python sdist vendors (the
installed bindings' version, else :data:`DEFAULT_VERSION`; ``pip download`` fetches the
sdist from the configured index), with ``GGML_NATIVE`` for this machine's CPU but without
AMX: its tile kernels die with SIGILL on virtual machines that report AMX (seen on a 2-core
Xeon VM, ``tileloadd`` in ggml's AMX matmul), and a comparison that crashes compares nothing.
A server is timed at the client over its HTTP API, as specdec's own server is; the prompt
goes as token ids (the chat template applied by specdec), so both answer the same tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from ..model.loading import cache_dir
from ..parallel.group import free_port

#: llama-cpp-python whose vendored llama.cpp is built when no binaries are found
DEFAULT_VERSION = "0.3.36"
BINARIES = ("llama-server", "llama-bench")
#: compiler flags that keep AMX out of a native build (explicit -mno-* win over -march=native)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def _bindings_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return DEFAULT_VERSION


def find_binaries(bin_dir: str | os.PathLike | None = None, build: bool = True) -> Path:
    """The directory holding ``llama-server`` and ``llama-bench``: ``bin_dir``, else ``PATH``,
    else the user cache (built there first when ``build``)."""
    if bin_dir is not None:
        found = Path(bin_dir)
        missing = [b for b in BINARIES if not (found / b).is_file()]
        if missing:
            raise ValueError(f"--llama-cpp-bin {found}: {', '.join(missing)} not there")
        return found
    on_path = [shutil.which(b) for b in BINARIES]
    if all(on_path) and len({Path(p).parent for p in on_path}) == 1:
        return Path(on_path[0]).parent
    cached = cache_dir() / "llama.cpp" / _bindings_version() / "bin"
    if all((cached / b).is_file() for b in BINARIES):
        return cached
    if not build:
        raise ValueError(f"no llama-server and llama-bench on PATH or in {cached}")
    return build_binaries(cached)


def build_binaries(destination: Path, version: str | None = None) -> Path:
    """Build ``llama-server`` and ``llama-bench`` from the llama-cpp-python ``version``
    sdist's vendored llama.cpp into ``destination``; a few minutes on two cores."""
    version = version or _bindings_version()
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ValueError(f"building llama.cpp needs {tool} on PATH (or give --llama-cpp-bin DIR with "
                             "llama-server and llama-bench)")
    jobs = str(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="specdec-llama-cpp-") as tmp:
        print(f"llama.cpp: fetching the llama-cpp-python {version} source", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                        "--no-binary", ":all:", "--disable-pip-version-check", "-q", "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        print(f"llama.cpp: building {' and '.join(BINARIES)} ({jobs} jobs, a few minutes)", file=sys.stderr,
              flush=True)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", *BINARIES, "-j", jobs], check=True,
                       stdout=sys.stderr)
        destination.mkdir(parents=True, exist_ok=True)
        for binary in BINARIES:
            shutil.copy2(build / "bin" / binary, destination / binary)
    print(f"llama.cpp: {destination}", file=sys.stderr, flush=True)
    return destination


class LlamaServer:
    """``llama-server`` on ``gguf`` (``extra``: its speculation options), ``parallel`` slots,
    greedy; :meth:`complete` answers token-id prompts, timed at the client."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, n_ctx: int, parallel: int = 1,
                 extra: tuple[str, ...] = (), start_timeout: float = 300.0):
        import httpx

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(
            [str(bin_dir / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
             "-c", str(n_ctx * parallel), "--parallel", str(parallel), "--port", str(self.port),
             "--host", "127.0.0.1", "--no-webui", *extra], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not start: {self.log()[-2000:]}")
            time.sleep(0.2)
        self._client = httpx.Client(timeout=600)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The greedy answer's token ids (its end-of-sequence token left out)."""
        r = self._client.post(f"{self.base}/completion", json={
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "return_tokens": True,
            "cache_prompt": True, "stream": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def llama_bench(bin_dir: Path, gguf: Path, threads: int, prompt_tokens: int = 512, decode_tokens: int = 128,
                repetitions: int = 3) -> dict:
    """``llama-bench``'s prefill (``-p``) and decode (``-n``) tok/s (mean and spread)."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p",
                          str(prompt_tokens), "-n", str(decode_tokens), "-r", str(repetitions), "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    result = {}
    for row in rows:
        kind = "prefill" if row["n_prompt"] else "decode"
        result[kind] = {"tokens": row["n_prompt"] or row["n_gen"], "tokens_per_s": row["avg_ts"],
                        "stddev": row["stddev_ts"]}
    return result
