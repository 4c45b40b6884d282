"""The package ``specdec``: its public names load their modules on first use, so a process
that runs the command line or a worker rank does not import the engine, the sampler and
llguidance (importing is most of a short-lived process's start)."""

import subprocess
import sys

import pytest

import specdec


def test_the_command_line_and_a_worker_rank_import_no_engine():
    code = ("import sys, specdec.cli, specdec.parallel.worker; "
            "print([m for m in ('specdec.api', 'specdec.executor.engine', 'llguidance') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_public_name_is_there_and_another_is_an_attribute_error():
    from specdec.api import LLM

    assert specdec.LLM is LLM
    for name in specdec.__all__:
        assert getattr(specdec, name) is not None and name in dir(specdec)
    with pytest.raises(AttributeError, match="module 'specdec' has no attribute 'NoSuchName'"):
        specdec.NoSuchName
