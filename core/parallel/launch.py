"""Worker ranks started on this machine: forks of a process that imported them once.

A worker rank needs torch, transformers and specdec imported, seconds of a core in every
new interpreter. Rank 0 starts a launcher process (``python -m specdec.parallel``)
at its first group, which imports the worker module and then forks one worker per request:
every rank of every later group of the process is ready at once. The launcher runs no
threads, so its forks are safe whatever rank 0 runs, and unlike multiprocessing's fork
server it never runs the user's main module again. A worker takes rank 0's environment
as it is at the launch (variables torch reads at import keep the launcher's values), is
named ``specdec-rankN`` (``ps``, ``top``), writes its output to rank 0's standard error,
and the kernel kills it when the launcher ends, which the launcher does when rank 0 exits.

The wire: rank 0 writes one JSON line per worker (its environment) to the launcher's
standard input; the launcher answers ``pid N`` once forked, and ``exit N CODE`` (negative
for a signal) when a worker ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn

#: how long rank 0 waits for the launcher to fork a worker (its first start imports torch)
START_TIMEOUT_S = 180.0

_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def die_with_parent() -> None:
    """The kernel kills this process when its parent exits, however the parent exits."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Launcher:
    """Rank 0's side of the launcher process: forks workers, reads how they ended."""

    def __init__(self):
        self._process = subprocess.Popen([sys.executable, "-m", "specdec.parallel"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, preexec_fn=die_with_parent)
        self._lock = threading.Lock()
        self._buffer = b""
        self._pids: list[int] = []
        self.exits: dict[int, int] = {}

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def fork(self, env: dict[str, str]) -> int:
        """A worker with environment ``env``: its pid."""
        with self._lock:
            self._process.stdin.write(json.dumps(env).encode() + b"\n")
            self._process.stdin.flush()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not self._pids:
                left = deadline - time.monotonic()
                if left <= 0 or not self._read(left):
                    self._process.kill()
                    raise ChildProcessError(f"the tensor-parallel launcher did not start a worker (status "
                                            f"{self._process.poll()}); its messages are on standard error above")
            return self._pids.pop(0)

    def exit_code(self, pid: int) -> int | None:
        """How worker ``pid`` ended (negative: the signal), None while it runs. A worker
        whose launcher is gone is dead too (the kernel killed it with the launcher)."""
        with self._lock:
            while self._read(0):
                pass
            if pid not in self.exits and not self.alive:
                return -signal.SIGKILL
            return self.exits.get(pid)

    def _read(self, timeout: float) -> bool:
        """Read what the launcher wrote within ``timeout`` seconds; False if nothing came."""
        out = self._process.stdout.fileno()
        if not select.select([out], [], [], timeout)[0]:
            return False
        data = os.read(out, 65536)
        if not data:
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            kind, *numbers = line.split()
            if kind == b"pid":
                self._pids.append(int(numbers[0]))
            else:
                self.exits[int(numbers[0])] = int(numbers[1])
        return True


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


class WorkerProcess:
    """A started worker, read as a :class:`subprocess.Popen` is: ``pid``, :meth:`poll`
    (its exit status, negative for a signal), :meth:`wait`, :meth:`kill`."""

    def __init__(self, launcher: Launcher, pid: int):
        self._launcher = launcher
        self.pid = pid

    def poll(self) -> int | None:
        return self._launcher.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"specdec-rank (pid {self.pid})", timeout)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def start_worker(env: dict[str, str]) -> WorkerProcess:
    """Rank ``env["RANK"]``, forked by this process's launcher (started at the first call,
    or again if it is gone), with ``env`` as its environment."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or not _launcher.alive:
            _launcher = Launcher()
        launcher = _launcher
    return WorkerProcess(launcher, launcher.fork(env))


# -- the launcher process ---------------------------------------------------------------


def serve() -> None:
    """Import the worker, then fork a worker per line of standard input until it closes,
    reporting each pid and each exit on standard output."""
    import specdec.parallel.worker  # noqa: F401 - what every fork would otherwise import

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    launcher, pending = os.getpid(), b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_r:
                os.read(wake_r, 4096)
                _reap()
                continue
            data = os.read(0, 65536)
            if not data:  # rank 0 closed the wire: it is gone, or done with workers
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    _worker(json.loads(line), launcher)
                _report(f"pid {pid}")


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _report(line: str) -> None:
    os.write(1, line.encode() + b"\n")


def _worker(env: dict[str, str], launcher: int) -> NoReturn:
    """In a worker forked by ``launcher``: rank 0's environment, its name, death with the
    launcher, its output to standard error, then :func:`.worker.main`; never returns into
    the launcher's loop."""
    code = 1
    try:
        from ..process_exit import run_exit_handlers
        from .worker import main

        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        die_with_parent()
        if os.getppid() != launcher:  # the launcher died before the line above
            return
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(2, 1)
        os.environ.clear()
        os.environ.update(env)
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, f"specdec-rank{env['RANK']}".encode()[:15])
        code = main()
        run_exit_handlers()
    except BaseException:  # noqa: BLE001 - reported, and the fork ends here whatever happened
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)
