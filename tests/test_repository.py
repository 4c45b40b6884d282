"""The repository's own rules, checked by the tools made for them: layers that import
downward only (import-linter), lint and import order (ruff), and a documentation site
that builds without warnings (mkdocs --strict)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_layers_import_downward_only():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout[-3000:]


def test_ruff_finds_nothing():
    result = run(str(BIN / "ruff"), "check", "core", "plugins", "tests", "scripts", "examples", "conftest.py")
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_documentation_builds_strictly(tmp_path):
    result = run(str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "hooks" / "index.html").exists()
