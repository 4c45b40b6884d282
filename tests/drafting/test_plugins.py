"""Plugins found through real entry points; hook documentation; failures reported by distribution."""

import contextlib
import importlib
import inspect
import json
import sys
import textwrap

import pytest
from helpers import specdec_main

from specdec import LLM, testing
from specdec.drafting import hookspecs
from specdec.errors import ConfigError, PluginError
from specdec.plugins import get_registry, hook_names, reset_registry

METHODS = {"ngram": "specdec-plugin-ngram", "lookahead": "specdec-plugin-lookahead",
           "draft_target": "specdec-plugin-draft-target", "medusa": "specdec-plugin-medusa",
           "eagle": "specdec-plugin-eagle", "eagle3": "specdec-plugin-eagle", "mtp": "specdec-plugin-mtp",
           "redrafter": "specdec-plugin-redrafter"}


def test_every_hook_is_documented():
    names = hook_names()
    assert {"register_decoding_types", "prepare_draft_tokens", "build_tree_mask", "on_draft_verified",
            "target_hidden_layers", "on_request_finished"} <= set(names)
    for name in names:
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        params = inspect.signature(getattr(hookspecs, name)).parameters
        assert len(doc.splitlines()[0]) > 10, f"{name}: no summary line"
        assert "Called" in doc, f"{name}: does not say when it is called"
        for param in params:
            assert f":param {param}:" in doc, f"{name}: argument {param} undocumented"
        assert ":return:" in doc, f"{name}: return value undocumented"
        assert "Example::" in doc, f"{name}: no example"


def test_plugins_json_lists_every_method_with_its_distribution():
    result = specdec_main("plugins", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    found = {row["name"]: row for row in data["decoding_types"]}
    for name, dist in METHODS.items():
        assert found[name]["distribution"] == dist
        assert found[name]["version"] == "0.1.0"
    assert found["ngram"]["implemented"] and "prepare_draft_tokens" in found["ngram"]["hooks"]
    assert found["eagle3"]["aliases"] == ["Eagle3"]
    assert data["failed"] == []


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_plugin_registers_through_its_entry_point(name):
    testing.check_registration(name, distribution=METHODS[name])


@contextlib.contextmanager
def _plugin_installed(tmp_path, module: str, source: str, entry: str, dist: str):
    """A plugin module and its distribution's entry point in a directory on this process's
    path, the registry loaded anew to find them; both undone on leaving."""
    site = tmp_path / "site"
    site.mkdir()
    (site / f"{module}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[specdec.plugins]\n{entry} = {module}\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    reset_registry()
    try:
        yield
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(module, None)
        reset_registry()


def test_registered_but_not_implemented_method_fails_clearly(tmp_path):
    """A plugin may register a method before its drafter exists: choosing it is a message
    naming the plugin and the methods that work, never a fallback to plain decoding, and
    it comes before any model is read (here an empty model directory, whose own error
    would come first otherwise)."""
    with _plugin_installed(tmp_path, "planned_specdec_plugin", textwrap.dedent("""
        import attrs

        from specdec import DecodingType, hookimpl
        from specdec.config import SpeculativeConfig

        @attrs.frozen(kw_only=True)
        class PlannedConfig(SpeculativeConfig):
            pass

        @hookimpl
        def register_decoding_types(register):
            register(DecodingType(name="planned", config_class=PlannedConfig))
        """), "planned", "specdec-plugin-planned"):
        table = specdec_main("plugins")
        (tmp_path / "no-model").mkdir()
        result = specdec_main("generate", "-d", "planned", "--model", str(tmp_path / "no-model"), "hi")
    assert any(line.startswith("planned") and "not implemented yet" in line for line in table.stdout.splitlines())
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "decoding type 'planned' (specdec-plugin-planned 0.3) is registered but not implemented yet; choose " \
           "another decoding_type (" in result.stderr
    offered = result.stderr.split("choose another decoding_type (")[1].split(")")[0].split(", ")
    assert {"ngram", "mtp", "eagle3"} <= set(offered) and "planned" not in offered


def test_missing_plugin_names_the_package_to_install(monkeypatch):
    monkeypatch.setenv("SPECDEC_PLUGINS", "ngram")
    reset_registry()
    try:
        assert get_registry().names() == ["ngram", "user"]
        with pytest.raises(PluginError) as info:
            LLM(speculative_config={"decoding_type": "eagle3"})
        msg = str(info.value)
        assert "'eagle3'" in msg and "installed: ngram, user" in msg and "pip install specdec-plugin-eagle" in msg
    finally:
        monkeypatch.delenv("SPECDEC_PLUGINS")
        reset_registry()


def test_broken_plugin_is_reported_with_its_distribution_and_others_keep_working(tmp_path):
    with _plugin_installed(tmp_path, "broken_specdec_plugin", "import not_a_module_that_exists\n", "broken",
                           "specdec-plugin-broken"):
        result = specdec_main("plugins", "--json")
        table = specdec_main("plugins")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert data["failed"] == [{"plugin": "broken", "distribution": "specdec-plugin-broken",
                               "error": "ModuleNotFoundError: No module named 'not_a_module_that_exists'"}]
    assert "ngram" in {row["name"] for row in data["decoding_types"]}
    assert "FAILED  broken (specdec-plugin-broken)" in table.stdout
    assert "Traceback" not in table.stdout + table.stderr


def test_user_decoding_type_loads_a_class_by_dotted_path(tmp_path):
    (tmp_path / "my_drafts.py").write_text(textwrap.dedent("""
        from specdec import Drafter, DraftProposal, hookimpl

        class RepeatLast(Drafter):
            @hookimpl
            def prepare_draft_tokens(self, requests, draft_lens):
                return [DraftProposal(token_ids=[r.token_ids[-1]] * k) for r, k in zip(requests, draft_lens)]
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        spec = {"decoding_type": "user", "drafter": "my_drafts:RepeatLast", "max_draft_len": 2}
        outs = testing.check_greedy_lossless(spec, model=testing.tiny_model_dir(tmp_path))
        assert all(o.metrics.num_draft_tokens > 0 for o in outs)
        with pytest.raises(PluginError, match="cannot import 'my_drafts:Nope'"):
            LLM(model=str(testing.tiny_model_dir(tmp_path)),
                speculative_config={"decoding_type": "user", "drafter": "my_drafts:Nope"})
    finally:
        sys.path.remove(str(tmp_path))


def test_drafter_with_a_misspelled_hook_is_rejected(tmp_path):
    (tmp_path / "typo_drafts.py").write_text(textwrap.dedent("""
        from specdec import Drafter, hookimpl

        class Typo(Drafter):
            @hookimpl
            def prepare_draft_token(self, requests, draft_lens):
                return []
    """))
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(PluginError, match="prepare_draft_token"):
            LLM(model=str(testing.tiny_model_dir(tmp_path)),
                speculative_config={"decoding_type": "user", "drafter": "typo_drafts:Typo"})
    finally:
        sys.path.remove(str(tmp_path))


def test_user_decoding_type_takes_a_class_or_an_instance_in_python(tmp_path):
    """TensorRT-LLM's UserProvidedDecodingConfig(drafter=MyDrafter()) style."""
    from specdec import Drafter, DraftProposal, SamplingParams, hookimpl

    class Echo(Drafter):
        @hookimpl
        def prepare_draft_tokens(self, requests, draft_lens):
            return [DraftProposal(token_ids=[r.token_ids[-1]] * k) for r, k in zip(requests, draft_lens)]

    class Counting:
        calls = 0

        @hookimpl
        def prepare_draft_tokens(self, requests, draft_lens):
            Counting.calls += 1
            return [None] * len(requests)

    model = str(testing.tiny_model_dir(tmp_path))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    by_class = LLM(model=model, speculative_config={"decoding_type": "user", "drafter": Echo, "max_draft_len": 2,
                                                               "adaptive": False})
    assert isinstance(by_class.drafter, Echo)
    assert by_class.generate([[1, 2, 3]], params)[0].metrics.num_draft_tokens > 0
    instance = Counting()
    by_instance = LLM(model=model, speculative_config={"decoding_type": "user", "drafter": instance})
    assert by_instance.drafter is instance
    by_instance.generate([[1, 2, 3]], params)
    assert Counting.calls > 0
    with pytest.raises(ConfigError, match="speculative_config.drafter: expected"):
        LLM(model=model, speculative_config={"decoding_type": "user", "drafter": 42})


def test_plugin_registering_the_base_config_class_is_reported(tmp_path):
    with _plugin_installed(tmp_path, "bare_specdec_plugin", textwrap.dedent("""
        from specdec import DecodingType, hookimpl
        from specdec.config import SpeculativeConfig

        @hookimpl
        def register_decoding_types(register):
            register(DecodingType(name="bare", config_class=SpeculativeConfig))
        """), "bare", "specdec-plugin-bare"):
        data = json.loads(specdec_main("plugins", "--json").stdout)
    assert data["failed"] == [{"plugin": "bare", "distribution": "specdec-plugin-bare",
                               "error": "PluginError: decoding type 'bare': config_class must be an attrs subclass "
                                        "of specdec.config.SpeculativeConfig (the method's own, even with no "
                                        "options)"}]


def test_hidden_states_are_kept_beside_the_kv_only_for_drafters_that_read_every_prompt_token(tmp_path):
    """Prefix caching stays on for every drafter; the engine keeps the hidden states of
    committed tokens (for prefixes served from the cache) unless every drafter asking for
    states declares that it reads the newest token's alone."""
    from specdec import Drafter, hookimpl

    class ReadsEveryToken(Drafter):
        @hookimpl
        def target_hidden_layers(self, target):
            return [-1]

        @hookimpl
        def prepare_draft_tokens(self, requests, draft_lens):
            return [None] * len(requests)

    class ReadsTheNewest(ReadsEveryToken):
        @hookimpl
        def reads_prompt_hidden_states(self):
            return False

    model = str(testing.tiny_model_dir(tmp_path))
    kept = {}
    for drafter in (ReadsEveryToken, ReadsTheNewest, None):
        spec = drafter and {"decoding_type": "user", "drafter": drafter}
        engine = LLM(model=model, speculative_config=spec).engine
        assert engine.kv.pool.enable_prefix_caching
        kept[drafter] = engine.hidden_cache is not None and sorted(engine.hidden_cache.states)
    assert kept == {ReadsEveryToken: [-1], ReadsTheNewest: False, None: False}
