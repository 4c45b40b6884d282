"""The repository's own rules, checked by the tools made for them: layers that import
downward only and plugins that import the core through its plugin API only (import-linter),
lint and import order (ruff), and a documentation site that builds without warnings
(mkdocs --strict)."""

import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_layers_import_downward_only():
    result = run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout[-3000:]


def test_every_installed_plugin_is_held_to_the_plugin_api():
    """The contract names plugin packages one by one (import-linter has no "all but one
    module" rule), so a plugin added without joining it would import the core freely."""
    from importlib.metadata import entry_points

    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in linter["contracts"] if c["name"].startswith("Plugins import the core"))
    packages = {e.value.split(".")[0].split(":")[0] for e in entry_points(group="specdec.plugins")} - {"specdec"}
    assert "specdec_eagle" in packages and "specdec_example_drafter" in packages
    assert packages <= set(contract["source_modules"]), packages - set(contract["source_modules"])
    assert packages <= set(linter["root_packages"])


def test_ruff_finds_nothing():
    result = run(str(BIN / "ruff"), "check", "core", "plugins", "tests", "scripts", "examples", "conftest.py")
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_documentation_builds_strictly(tmp_path):
    result = run(str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr[-3000:]
    site = tmp_path / "site"
    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    hooks = (site / "reference" / "hooks" / "index.html").read_text()
    # generated from the code: every key of the engine's config and every hook, with its docs
    from specdec.config import EngineConfig
    from specdec.drafting import hookspecs

    for field in attrs.fields(EngineConfig):
        assert f"<code>{field.name}</code>" in configuration, field.name
    assert "the registered name of the method" in configuration  # a field's docstring text
    for name in ("register_decoding_types", "prepare_draft_tokens", "build_tree_mask", "on_draft_verified"):
        assert name in hooks and hasattr(hookspecs, name)
    assert "Called once per process" in hooks
    plugin_api = (site / "reference" / "plugin_api" / "index.html").read_text()
    from specdec import plugin_api as api

    for name in api.__all__:
        assert f"<code>{name}</code>" in plugin_api, name
    assert "One drafting method, as a plugin registers it." in plugin_api  # DecodingType's docstring


def test_old_module_paths_warn_and_give_the_moved_modules_for_one_release():
    import importlib

    from specdec._moved import MOVED_MODULES, MOVED_NAMES

    for old, new in MOVED_MODULES.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
            assert importlib.import_module(old) is importlib.import_module(new)
    for package, names in {"specdec.drafting": ["Drafter", "DraftProposal"], "specdec.bench": ["run_bench"],
                           "specdec.kernels": ["AttentionLayout", "make_linear_invariant"]}.items():
        for name in names:
            where = MOVED_NAMES[package]
            module = where[name] if isinstance(where, dict) else where
            with pytest.warns(DeprecationWarning, match=f"{package}.{name} moved to {module}.{name}"):
                assert getattr(importlib.import_module(package), name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        importlib.import_module("specdec.kernels").nothing_here
