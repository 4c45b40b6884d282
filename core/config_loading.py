"""Configuration from YAML files and dicts: a strict cattrs converter.

Every error names the path of the bad field (``speculative_config.max_draft_lenn``) and
what to do about it. ``speculative_config`` is structured into the config class that the
plugin providing its ``decoding_type`` registered, so each method validates its own options.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import cattrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from .config import SpecdecConfig, SpeculativeConfig, bool_or_auto, suggest_close
from .errors import ConfigError, FieldError, PluginError
from .plugins import get_registry


def _strict_int(value, _type):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r} ({type(value).__name__})")
    return value


def _strict_float(value, _type):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _strict_bool(value, _type):
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r} ({type(value).__name__})")
    return value


def _strict_str(value, _type):
    """A string; a path object (``pathlib.Path``) from the Python API becomes its string."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r} ({type(value).__name__})")
    return value


def _str_or_strings(value, _type):
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"expected a string or a list of strings, got {value!r}")
    return tuple(value)


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True,
                            unstruct_collection_overrides={tuple: list})
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(str, _strict_str)
    conv.register_structure_hook_func(lambda t: t == tuple[str, ...], _str_or_strings)
    conv.register_structure_hook_func(lambda t: t == bool | str, bool_or_auto)
    conv.register_structure_hook_func(lambda t: t is SpeculativeConfig, _structure_speculative)
    # A plugin's config unstructures with all its own fields, not just the base class's.
    conv.register_unstructure_hook_func(lambda t: t is SpeculativeConfig,
                                        lambda obj: conv.unstructure(obj, unstructure_as=type(obj)))
    return conv


def _structure_speculative(value, _type, path: str = "speculative_config") -> SpeculativeConfig:
    if isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a mapping, got {value!r}")
    if "decoding_type" not in value:
        raise ConfigError(f"{path}.decoding_type: missing; name the method, "
                          f"one of: {', '.join(get_registry().names())}")
    try:
        entry = get_registry().resolve(value["decoding_type"])
    except PluginError as exc:  # raised as what it is, naming the lookup's field
        raise PluginError(str(exc).replace("speculative_config.", f"{path}.", 1)) from None
    data = dict(value, decoding_type=entry.name)
    if "speculative_model_dir" in data and "speculative_model" in _fields_of(entry.config_class):
        if "speculative_model" in data:
            raise ConfigError(f"{path}: give speculative_model or its alias speculative_model_dir, not both")
        data["speculative_model"] = data.pop("speculative_model_dir")
    if data.get("lookup") is not None:
        data["lookup"] = _structure_speculative(data["lookup"], _type, f"{path}.lookup")
    try:
        return converter.structure(data, entry.config_class)
    except ConfigError:
        raise
    except Exception as exc:  # cattrs' exception groups: flatten into one message
        raise ConfigError(format_structure_error(exc, path)) from None


converter = _make_converter()


def _fields_of(cl) -> list[str]:
    try:
        return [a.name for a in attrs.fields(cl)]
    except Exception:
        return []


def _walk(exc: BaseException, path: str):
    """Yield ``(path, message)`` for each leaf error in a cattrs exception tree."""
    if isinstance(exc, ForbiddenExtraKeysError):
        for key in sorted(exc.extra_fields):
            yield f"{path}.{key}" if path else key, "unknown key" + suggest_close(key, _fields_of(exc.cl))
        return
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            sub_path = path
            for note in getattr(sub, "__notes__", []):
                name = getattr(note, "name", None)
                if name is None:
                    name = getattr(note, "index", None)
                if name is not None:
                    sub_path = f"{path}.{name}" if path else str(name)
                    break
            yield from _walk(sub, sub_path)
        return
    if isinstance(exc, FieldError):
        yield f"{path}.{exc.field}" if path else exc.field, exc.message
        return
    if isinstance(exc, ConfigError):
        yield "", str(exc)
        return
    if isinstance(exc, KeyError):
        yield path, "missing required value"
        return
    yield path, str(exc)


def format_structure_error(exc: BaseException, path: str = "") -> str:
    lines = [f"{p}: {m}" if p else m for p, m in _walk(exc, path)]
    return "\n".join(lines) if lines else str(exc)


def _plugin_error_in(exc: BaseException) -> PluginError | None:
    if isinstance(exc, PluginError):
        return exc
    for sub in getattr(exc, "exceptions", ()):
        found = _plugin_error_in(sub)
        if found is not None:
            return found
    return None


def structure(data: Any, cl: type, path: str = ""):
    """Build ``cl`` from plain data; any problem becomes one ConfigError naming the paths.

    An unknown or missing decoding type is raised as the PluginError it is.
    """
    try:
        return converter.structure(data, cl)
    except ConfigError:
        raise
    except Exception as exc:
        plugin_error = _plugin_error_in(exc)
        if plugin_error is not None:
            raise plugin_error from None
        raise ConfigError(format_structure_error(exc, path)) from None


def unstructure(obj) -> Any:
    return converter.unstructure(obj)


def _check_top_level(data: Any, where: str) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping, got {type(data).__name__}")
    return data


def config_from_dict(data: dict | None) -> SpecdecConfig:
    return structure(_check_top_level(data, "config"), SpecdecConfig)


def load_config(path: str | os.PathLike) -> SpecdecConfig:
    """Read and validate a YAML config file. Relative model paths resolve against the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    cfg = structure(_check_top_level(data, str(path)), SpecdecConfig)
    return _resolve_paths(cfg, path.parent)


def _resolve_paths(cfg: SpecdecConfig, base: Path) -> SpecdecConfig:
    def fix(p):
        if p and not os.path.isabs(p) and (p.startswith(".") or (base / p).exists()):
            return str((base / p).resolve())
        return p

    def fix_spec(spec):
        if spec is None:
            return None
        if isinstance(getattr(spec, "speculative_model", None), str):
            spec = attrs.evolve(spec, speculative_model=fix(spec.speculative_model))
        return attrs.evolve(spec, lookup=fix_spec(spec.lookup)) if spec.lookup is not None else spec

    return attrs.evolve(cfg, model=fix(cfg.model), tokenizer=fix(cfg.tokenizer),
                        speculative_config=fix_spec(cfg.speculative_config))


def merge_overrides(cfg: SpecdecConfig, overrides: dict) -> SpecdecConfig:
    """Apply dotted-path overrides (``{"engine.max_batch_size": 4}``) such as CLI flags give."""
    data = unstructure(cfg)
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[leaf] = value
    return config_from_dict(data)
