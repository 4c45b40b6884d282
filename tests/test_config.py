"""Every configuration error names the path and the problem."""

import pytest

from specdec import LLM, SamplingParams
from specdec.config import EngineConfig, SpecdecConfig
from specdec.config_loading import config_from_dict, load_config, merge_overrides
from specdec.errors import ConfigError, PluginError


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return str(info.value)


def test_unknown_key_suggests_the_right_one():
    msg = error_of({"speculative_config": {"decoding_type": "ngram", "max_draft_lenn": 3}})
    assert msg == "speculative_config.max_draft_lenn: unknown key (did you mean max_draft_len?)"
    assert error_of({"engnie": {}}) == "engnie: unknown key (did you mean engine?)"
    assert "engine.max_batch_sise: unknown key (did you mean max_batch_size?)" in error_of(
        {"engine": {"max_batch_sise": 2}})


def test_plugin_specific_key_is_checked_by_its_config_class():
    msg = error_of({"speculative_config": {"decoding_type": "ngram", "max_matching_ngram_sise": 3}})
    assert "speculative_config.max_matching_ngram_sise: unknown key (did you mean max_matching_ngram_size?)" == msg


def test_wrong_types():
    assert error_of({"speculative_config": {"decoding_type": "ngram", "max_draft_len": "4"}}) == \
        "speculative_config.max_draft_len: expected an integer, got '4' (str)"
    assert error_of({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 4.5}}) == \
        "speculative_config.max_draft_len: expected an integer, got 4.5 (float)"
    assert error_of({"sampling": {"temperature": "hot"}}) == "sampling.temperature: expected a number, got 'hot' (str)"
    assert error_of({"engine": {"enable_prefix_caching": "yes"}}) == \
        "engine.enable_prefix_caching: expected true or false, got 'yes' (str)"


def test_out_of_range_values():
    assert error_of({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 0}}) == \
        "speculative_config.max_draft_len: must be between 1 and 64, got 0"
    assert error_of({"sampling": {"top_p": 1.5}}) == "sampling.top_p: must be in (0.0, 1.0], got 1.5"
    assert error_of({"dtype": "float64"}).startswith("dtype: must be one of 'auto', 'float32'")
    assert "(did you mean bfloat16?)" in error_of({"dtype": "bfloat61"})
    assert error_of({"speculative_config": {"decoding_type": "ngram", "max_matching_ngram_size": 2,
                                            "min_matching_ngram_size": 3}}) == \
        "speculative_config.min_matching_ngram_size: must be <= max_matching_ngram_size (2), got 3"


def test_several_errors_are_all_reported():
    msg = error_of({"speculative_config": {"decoding_type": "ngram", "max_draft_lenn": 3, "is_public_pool": 3},
                    "engine": {"max_batch_size": 0}})
    assert len(msg.splitlines()) == 3


def test_unknown_decoding_type_lists_installed_ones():
    with pytest.raises(PluginError) as info:
        config_from_dict({"speculative_config": {"decoding_type": "ngrma"}})
    msg = str(info.value)
    assert "unknown decoding type 'ngrma'" in msg
    for name in ("ngram", "lookahead", "draft_target", "medusa", "eagle", "eagle3", "mtp", "redrafter"):
        assert name in msg
    with pytest.raises(ConfigError, match="speculative_config.decoding_type: missing"):
        config_from_dict({"speculative_config": {"max_draft_len": 3}})


@pytest.mark.parametrize("alias,name", [("NGram", "ngram"), ("Eagle3", "eagle3"), ("DraftTarget", "draft_target"),
                                        ("MTP", "mtp"), ("Medusa", "medusa"), ("Lookahead", "lookahead")])
def test_tensorrt_llm_spellings_are_aliases(alias, name):
    assert config_from_dict({"speculative_config": {"decoding_type": alias}}).speculative_config.decoding_type == name


def test_yaml_file(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("dtype: float32\nspeculative_config: {decoding_type: NGram, max_draft_len: 5}\n"
                    "sampling: {temperature: 0, max_tokens: 12, stop: '###'}\nengine: {max_batch_size: 4}\n")
    cfg = load_config(path)
    assert cfg.speculative_config.max_draft_len == 5 and cfg.sampling.stop == ("###",)
    assert cfg.engine == EngineConfig(max_batch_size=4)
    path.write_text("dtype: [float32\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_win_over_yaml():
    cfg = config_from_dict({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 5},
                            "engine": {"max_batch_size": 4}})
    cfg = merge_overrides(cfg, {"engine.max_batch_size": 2, "speculative_config.max_matching_ngram_size": 5,
                                "sampling.temperature": 0.0, "model": None})
    assert cfg.engine.max_batch_size == 2 and cfg.speculative_config.max_matching_ngram_size == 5
    assert cfg.speculative_config.max_draft_len == 5 and cfg.sampling.temperature == 0.0
    assert isinstance(cfg, SpecdecConfig)


def test_batch_invariant_is_true_false_or_auto():
    assert EngineConfig().batch_invariant == "auto"
    for value in (True, False, "auto"):
        assert config_from_dict({"engine": {"batch_invariant": value}}).engine.batch_invariant == value
        assert merge_overrides(config_from_dict({}), {"engine.batch_invariant": value}).engine.batch_invariant == value
    assert error_of({"engine": {"batch_invariant": "on"}}) == \
        "engine.batch_invariant: expected true, false or auto, got 'on'"
    assert error_of({"engine": {"batch_invariant": 1}}) == "engine.batch_invariant: expected true, false or auto, got 1"
    with pytest.raises(ConfigError, match="batch_invariant: expected true, false or auto, got None"):
        EngineConfig(batch_invariant=None)
    # compile is true, false or auto too; whether it combines with the mode depends on the
    # target (tests/model/test_compile.py), so the config takes both
    assert EngineConfig().compile == "auto" and EngineConfig(compile=True).batch_invariant == "auto"
    assert config_from_dict({"engine": {"compile": True, "batch_invariant": True}}).engine.compile is True
    assert error_of({"engine": {"compile": "yes"}}) == "engine.compile: expected true, false or auto, got 'yes'"


def test_draft_len_schedule():
    spec = config_from_dict({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 6,
                                                    "draft_len_schedule": {1: 6, 4: 3, 16: 0}}}).speculative_config
    assert [spec.draft_len_for_batch(b) for b in (1, 3, 4, 15, 16, 64)] == [6, 6, 3, 3, 0, 0]
    assert "draft lengths must be between 0 and 64" in error_of(
        {"speculative_config": {"decoding_type": "ngram", "draft_len_schedule": {1: 99}}})


def test_sampling_params_validate_directly():
    with pytest.raises(ConfigError, match="temperature: must be in"):
        SamplingParams(temperature=-1.0)
    assert SamplingParams(stop="x").stop == ("x",)
    for stop in ("", ["x", ""], [7]):  # an empty stop string would end every request at once
        with pytest.raises(ConfigError, match="stop: each stop string must be a non-empty string"):
            SamplingParams(stop=stop)


def test_llm_checks_config_before_loading_weights(tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.max_draft_lenn"):
        LLM(speculative_config={"decoding_type": "ngram", "max_draft_lenn": 3})
    from specdec.errors import ModelLoadError
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        LLM(model=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(model=str(tmp_path / "empty"))


def test_speculative_model_dir_is_an_alias_of_speculative_model():
    cfg = config_from_dict({"speculative_config": {"decoding_type": "draft_target", "speculative_model_dir": "d"}})
    assert cfg.speculative_config.speculative_model == "d"
    with pytest.raises(ConfigError, match="not both"):
        config_from_dict({"speculative_config": {"decoding_type": "draft_target", "speculative_model": "a",
                                                 "speculative_model_dir": "b"}})
    with pytest.raises(ConfigError, match="speculative_model_dir: unknown key"):
        config_from_dict({"speculative_config": {"decoding_type": "ngram", "speculative_model_dir": "b"}})


def test_node_budget_must_hold_the_depth():
    cfg = config_from_dict({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 4,
                                                   "max_total_draft_tokens": 10,
                                                   "draft_len_schedule": {1: 4, 8: 2, 16: 0}}})
    spec = cfg.speculative_config
    assert [spec.draft_shape_for_batch(b) for b in (1, 8, 16)] == [(4, 10), (2, 5), (0, 0)]
    with pytest.raises(ConfigError, match="speculative_config.max_total_draft_tokens: 3 nodes cannot hold"):
        config_from_dict({"speculative_config": {"decoding_type": "ngram", "max_draft_len": 4,
                                                 "max_total_draft_tokens": 3}})


def test_paths_may_be_path_objects(tmp_path):
    from pathlib import Path

    from specdec import testing

    cfg = config_from_dict({"model": Path("m"), "speculative_config": {"decoding_type": "draft_target",
                                                                       "speculative_model": Path("d")}})
    assert (cfg.model, cfg.speculative_config.speculative_model) == ("m", "d")
    llm = LLM(model=testing.tiny_model_dir(tmp_path), device="cpu")
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids
    assert error_of({"model": 3}) == "model: expected a string, got 3 (int)"


def test_a_lookup_is_a_method_config_of_its_own_checked_where_it_lies(tmp_path):
    from specdec.config_loading import unstructure

    cfg = config_from_dict({"speculative_config": {"decoding_type": "eagle3",
                                                   "lookup": {"decoding_type": "suffix", "max_draft_len": 8}}})
    lookup = cfg.speculative_config.lookup
    assert type(lookup).__name__ == "SuffixConfig" and lookup.max_draft_len == 8 and lookup.min_request_match == 3
    assert config_from_dict(unstructure(cfg)) == cfg
    assert error_of({"speculative_config": {"decoding_type": "eagle3", "lookup": {"decoding_type": "suffix",
                                                                                   "min_match": 3}}}) \
        == "speculative_config.lookup.min_match: unknown key (did you mean min_request_match?)"
    assert error_of({"speculative_config": {"decoding_type": "eagle3", "lookup": "suffix"}}) \
        == "speculative_config.lookup: expected a mapping, got 'suffix'"
    assert "speculative_config.lookup.max_draft_len: must be between 1 and 64" in error_of(
        {"speculative_config": {"decoding_type": "eagle3", "lookup": {"decoding_type": "ngram", "max_draft_len": 0}}})
    assert "speculative_config.lookup: is 'suffix', the method itself" in error_of(
        {"speculative_config": {"decoding_type": "suffix", "lookup": {"decoding_type": "suffix"}}})
    assert "cannot have a lookup of its own" in error_of(
        {"speculative_config": {"decoding_type": "eagle3", "lookup": {"decoding_type": "suffix",
                                                                      "lookup": {"decoding_type": "ngram"}}}})
    with pytest.raises(PluginError, match="speculative_config.lookup.decoding_type: unknown decoding type 'sufix'"):
        config_from_dict({"speculative_config": {"decoding_type": "eagle3", "lookup": {"decoding_type": "sufix"}}})
    path = tmp_path / "cfg.yaml"  # a lookup's model path is relative to the YAML file, as the method's
    (tmp_path / "draft").mkdir()
    path.write_text("speculative_config: {decoding_type: ngram, lookup: {decoding_type: draft_target, "
                    "speculative_model: ./draft}}\n")
    assert load_config(path).speculative_config.lookup.speculative_model == str(tmp_path / "draft")
