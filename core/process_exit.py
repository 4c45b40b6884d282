"""Ending a process whose work is done without finalizing the interpreter.

A normal exit tears the loaded modules down one by one: with torch and transformers
loaded, thousands of them, after every command, worker rank and engine process, and the
caller waits for it. :func:`exit_now` keeps what a normal exit does that matters (the
atexit handlers run: process groups, inductor's compile workers, multiprocessing's
children, logging; the standard streams are flushed), then ends the process. Where a
thread that is not a daemon still runs, it exits normally instead, so that the thread
finishes first, as it would."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int | str | None = 0) -> NoReturn:
    """End the process with ``code`` as :func:`sys.exit` would (a string is printed to
    standard error, status 1), skipping the interpreter's finalization."""
    main = threading.main_thread()
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not main):
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    run_exit_handlers()
    os._exit(code or 0)


def run_exit_handlers() -> None:
    """What a normal exit does that matters: the atexit handlers, then the standard streams
    flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
