""":func:`specdec.process_exit.exit_now`, which ends the CLI, the worker ranks and the
engine processes: the status, the streams and the atexit handlers of a normal exit, and a
normal exit where a thread that is not a daemon still runs. Each case is a small process
that loads the module alone (importing the package would load torch)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parent.parent / "core" / "process_exit.py"


def _run(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import atexit, importlib.util, sys, threading, time
        spec = importlib.util.spec_from_file_location("process_exit", {str(MODULE)!r})
        process_exit = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(process_exit)
        atexit.register(lambda: open({str(tmp_path / "atexit")!r}, "w").write("ran"))
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PYTHONUNBUFFERED": ""})


@pytest.mark.parametrize("code, status", [(0, 0), (3, 3), (None, 0)])
def test_the_status_the_streams_and_atexit_handlers_are_those_of_a_normal_exit(tmp_path, code, status):
    done = _run(f"""
        sys.stdout.write("x" * 100000)  # buffered: a pipe is not a terminal
        sys.stderr.write("to stderr")
        process_exit.exit_now({code})
        print("never")
    """, tmp_path)
    assert done.returncode == status
    assert done.stdout == "x" * 100000 and done.stderr == "to stderr"
    assert (tmp_path / "atexit").read_text() == "ran"


def test_a_message_is_printed_and_ends_with_status_one(tmp_path):
    done = _run('process_exit.exit_now("specdec: error: bad")', tmp_path)
    assert (done.returncode, done.stderr) == (1, "specdec: error: bad\n")


def test_a_thread_that_is_not_a_daemon_finishes_first(tmp_path):
    done = _run(f"""
        def late():
            time.sleep(0.5)
            open({str(tmp_path / "thread")!r}, "w").write("done")
        threading.Thread(target=late).start()
        process_exit.exit_now(4)
    """, tmp_path)
    assert done.returncode == 4
    assert (tmp_path / "thread").read_text() == "done" and (tmp_path / "atexit").read_text() == "ran"
