"""Old import paths of modules that moved into subpackages, kept working for one release.

Importing one (``specdec.models``, ``specdec.feature_drafter``, ...) or a name that left a
package (``specdec.drafting.Drafter``, ``specdec.kernels.AttentionLayout``) warns with a
``DeprecationWarning`` naming the new place and gives the moved module or name. Plugins
import :mod:`specdec.plugin_api`, whose names do not move; this module goes in the next
release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED_MODULES = {
    "specdec.hookspecs": "specdec.drafting.hookspecs",
    "specdec.tree": "specdec.drafting.tree",
    "specdec.tree_expansion": "specdec.drafting.tree_expansion",
    "specdec.layers": "specdec.drafting.layers",
    "specdec.draft_runner": "specdec.drafting.runner",
    "specdec.draft_checkpoint": "specdec.drafting.checkpoint",
    "specdec.feature_drafter": "specdec.drafting.feature_drafter",
    "specdec.last_state": "specdec.drafting.last_state",
    "specdec.models": "specdec.model.loading",
    "specdec.target_model": "specdec.model.target",
    "specdec.quantization": "specdec.model.quantization",
    "specdec.gguf_blocks": "specdec.model.gguf_blocks",
    "specdec.kernels.layout": "specdec.kvcache.layout",
    "specdec.kernels.invariant": "specdec.numerics.invariant",
    "specdec.server": "specdec.serving.server",
    "specdec.async_engine": "specdec.serving.async_engine",
    "specdec.openai_protocol": "specdec.serving.openai_protocol",
    "specdec.server_metrics": "specdec.serving.metrics",
    "specdec.prompt_sets": "specdec.bench.prompt_sets",
    "specdec.llama_cpp_baseline": "specdec.bench.llama_cpp_bindings",
    "specdec.llama_cpp_native": "specdec.bench.llama_cpp_native",
    "specdec.grammar": "specdec.sampler.grammar",
}

#: modules that became packages, or packages that gave names away: the names' new modules
MOVED_NAMES = {
    "specdec.drafting": "specdec.drafting.interface",
    "specdec.bench": "specdec.bench.runner",
    "specdec.kernels": {"AttentionLayout": "specdec.kvcache.layout", "SequenceSlice": "specdec.kvcache.layout",
                        "make_linear_invariant": "specdec.numerics.invariant",
                        "restore_linear": "specdec.numerics.invariant"},
}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (plugins: from specdec.plugin_api), the old "
                  "path goes in the next release", DeprecationWarning, stacklevel=stacklevel + 1)


def moved_attribute(package: str, name: str):
    """A package's ``__getattr__``: ``name`` from the module it moved to, with a warning."""
    where = MOVED_NAMES.get(package)
    if isinstance(where, dict):
        where = where.get(name)
    if where is not None and not name.startswith("_"):
        module = importlib.import_module(where)
        if hasattr(module, name):
            _warn(f"{package}.{name}", f"{where}.{name}", 3)
            return getattr(module, name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new, 2)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        pass


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds an old module path and hands out the moved module itself."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(new)) if new else None


def install() -> None:
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
