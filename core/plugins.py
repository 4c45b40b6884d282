"""Plugin discovery and the decoding-type registry.

stevedore finds plugin modules in the ``specdec.plugins`` entry-point group; each is
registered in a pluggy manager and announces its methods through the
``register_decoding_types`` hook. A plugin that fails to import is recorded with its
distribution name and error, and the others keep working. ``SPECDEC_PLUGINS`` (a comma
list of entry-point or distribution names) limits which plugins load.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
from collections.abc import Callable

import attrs
import pluggy
from stevedore import ExtensionManager, NamedExtensionManager

from .config import SpeculativeConfig
from .drafting import hookspecs
from .drafting.interface import DraftProposal, TreeMask
from .drafting.tree import default_tree_mask
from .errors import PluginError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "specdec.plugins"

#: Where the methods the project maintains live, so a missing one names its package.
KNOWN_DISTRIBUTIONS = {
    "ngram": "specdec-plugin-ngram",
    "lookahead": "specdec-plugin-lookahead",
    "draft_target": "specdec-plugin-draft-target",
    "medusa": "specdec-plugin-medusa",
    "eagle": "specdec-plugin-eagle",
    "eagle3": "specdec-plugin-eagle",
    "mtp": "specdec-plugin-mtp",
    "redrafter": "specdec-plugin-redrafter",
}


def normalize(name: str) -> str:
    """``DraftTarget``, ``draft-target`` and ``draft_target`` all become ``drafttarget``."""
    return re.sub(r"[-_\s]", "", name).lower()


@attrs.frozen(kw_only=True)
class DecodingType:
    """One drafting method, as a plugin registers it.

    Attributes:
        name: the ``decoding_type`` users write.
        config_class: an attrs subclass of :class:`~specdec.config.SpeculativeConfig`.
        drafter_class: ``drafter_class(config, target)`` builds the drafter; ``None``
            while the method is registered but not implemented yet.
        aliases: other spellings accepted (TensorRT-LLM's ``NGram``, ``Eagle3``...).
        trainer_class: ``trainer_class(target, samples, options)`` trains the method's
            drafter for ``specdec train`` (a :class:`specdec.training.MethodTrainer`);
            ``None`` for methods with nothing to train.
        lossy_options: the method's options that switch on an opt-in acceptance rule that
            changes the output (Medusa's typical acceptance, MTP's relaxed acceptance);
            ``specdec plugins`` names them, and requests verified by such a rule have
            ``metrics.lossless`` False. Empty: the method is always lossless.
        description: one line for ``specdec plugins``.
        plugin, distribution, version: filled in by the registry.
    """

    name: str
    config_class: type[SpeculativeConfig]
    drafter_class: Callable | None = None
    trainer_class: Callable | None = None
    aliases: tuple[str, ...] = ()
    lossy_options: tuple[str, ...] = ()
    description: str = ""
    plugin: str = ""
    distribution: str = ""
    version: str = ""

    def hooks_implemented(self) -> list[str]:
        marker = f"{hookspecs.PROJECT_NAME}_impl"
        return [name for name in hook_names()
                if getattr(getattr(self.drafter_class, name, None), marker, None) is not None]


@attrs.frozen
class PluginFailure:
    plugin: str
    distribution: str
    error: str


def hook_names() -> list[str]:
    return [n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), f"{hookspecs.PROJECT_NAME}_spec", None)]


def _entry_point_distributions() -> dict[str, tuple[str, str]]:
    """Entry-point name -> (distribution name, version) for the specdec.plugins group."""
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        found[ep.name] = (dist.metadata["Name"], dist.version) if dist is not None else ("?", "?")
    return found


class PluginRegistry:
    """The decoding types of every loaded plugin, and the plugins that failed to load."""

    def __init__(self, only: str | None = None):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.types: dict[str, DecodingType] = {}
        self.failures: list[PluginFailure] = []
        self._dists = _entry_point_distributions()
        self._load(only)

    def _selected(self, only: str | None) -> list[str] | None:
        if not only:
            return None
        wanted = {normalize(w) for w in only.split(",") if w.strip()}
        return [name for name, (dist, _) in self._dists.items()
                if dist == "specdec" or normalize(name) in wanted or normalize(dist) in wanted]

    def _load(self, only: str | None) -> None:
        def failed(_manager, entry_point, exc):
            dist = self._dists.get(entry_point.name, ("?", "?"))[0]
            self.failures.append(PluginFailure(entry_point.name, dist, f"{type(exc).__name__}: {exc}"))
            log.warning("specdec plugin %s (%s) failed to load: %s: %s",
                        entry_point.name, dist, type(exc).__name__, exc)

        names = self._selected(only)
        common = dict(namespace=ENTRY_POINT_GROUP, invoke_on_load=False, on_load_failure_callback=failed)
        extensions = (NamedExtensionManager(names=names, **common) if names is not None
                      else ExtensionManager(**common))
        for ext in extensions:
            dist, version = self._dists.get(ext.name, ("?", "?"))
            try:
                self.manager.register(ext.plugin, name=ext.name)
                for impl in self.manager.hook.register_decoding_types.get_hookimpls():
                    if impl.plugin_name == ext.name:
                        impl.function(register=lambda t, e=ext.name, d=dist, v=version: self._add(t, e, d, v))
            except Exception as exc:  # a broken plugin must not take the others down
                self.failures.append(PluginFailure(ext.name, dist, f"{type(exc).__name__}: {exc}"))
                log.warning("specdec plugin %s (%s) failed to register: %s", ext.name, dist, exc)

    def _add(self, dtype: DecodingType, plugin: str, dist: str, version: str) -> None:
        if not (isinstance(dtype.config_class, type) and issubclass(dtype.config_class, SpeculativeConfig)
                and dtype.config_class is not SpeculativeConfig and attrs.has(dtype.config_class)):
            raise PluginError(f"decoding type {dtype.name!r}: config_class must be an attrs subclass of "
                              "specdec.config.SpeculativeConfig (the method's own, even with no options)")
        for spelling in (dtype.name, *dtype.aliases):
            clash = self._find(spelling)
            if clash is not None:
                raise PluginError(f"decoding type {spelling!r} from {dist} is already registered by "
                                  f"{clash.distribution}")
        self.types[dtype.name] = attrs.evolve(dtype, plugin=plugin, distribution=dist, version=version)

    def _find(self, name: str) -> DecodingType | None:
        key = normalize(name)
        for dtype in self.types.values():
            if key in {normalize(n) for n in (dtype.name, *dtype.aliases)}:
                return dtype
        return None

    def names(self) -> list[str]:
        return sorted(self.types)

    def resolve(self, name: str) -> DecodingType:
        """The decoding type called ``name`` (or an alias); a clear PluginError if there is none."""
        if not isinstance(name, str):
            raise PluginError(f"speculative_config.decoding_type: expected a name, got {name!r}")
        found = self._find(name)
        if found is not None:
            return found
        canonical = next((k for k in KNOWN_DISTRIBUTIONS if normalize(k) == normalize(name)), None)
        installed = ", ".join(self.names()) or "none"
        msg = f"speculative_config.decoding_type: unknown decoding type {name!r}; installed: {installed}."
        if canonical:
            dist = KNOWN_DISTRIBUTIONS[canonical]
            broken = [f for f in self.failures if f.distribution == dist]
            if broken:
                msg += f" Its plugin {dist} is installed but failed to load: {broken[0].error}"
            else:
                msg += f" Install its plugin: pip install {dist}"
        else:
            msg += (" For a drafter in your own code use decoding_type: user with "
                    "drafter: 'package.module:Class'.")
        raise PluginError(msg)

    def resolve_drafter(self, name: str) -> DecodingType:
        """:meth:`resolve`, and a clear PluginError where the type has no drafter yet: what
        an engine checks before it loads any weights, so that the error comes at once."""
        dtype = self.resolve(name)
        if dtype.drafter_class is None:
            raise PluginError(f"decoding type {dtype.name!r} ({dtype.distribution} {dtype.version}) is registered "
                              "but not implemented yet; choose another decoding_type "
                              f"({', '.join(n for n, t in self.types.items() if t.drafter_class)})")
        return dtype

    def create_drafter(self, config: SpeculativeConfig, target) -> object:
        return self.resolve_drafter(config.decoding_type).drafter_class(config, target)

    def plugins_table(self) -> list[dict]:
        return [{"name": t.name, "aliases": list(t.aliases), "distribution": t.distribution, "version": t.version,
                 "implemented": t.drafter_class is not None, "trainable": t.trainer_class is not None,
                 "lossy_options": list(t.lossy_options),
                 "hooks": t.hooks_implemented(), "description": t.description}
                for t in sorted(self.types.values(), key=lambda t: t.name)]


_registry: PluginRegistry | None = None


def get_registry() -> PluginRegistry:
    """The process-wide registry, loaded on first use (honours ``SPECDEC_PLUGINS``)."""
    global _registry
    if _registry is None:
        _registry = PluginRegistry(os.environ.get("SPECDEC_PLUGINS"))
    return _registry


def reset_registry() -> None:
    """Forget the loaded plugins (after changing ``SPECDEC_PLUGINS`` or installing one),
    and the entry points stevedore keeps per group for the life of the process: a plugin
    installed since is found."""
    global _registry
    _registry = None
    ExtensionManager.ENTRY_POINT_CACHE.pop(ENTRY_POINT_GROUP, None)


class CoreTreeHooks:
    """The core's own implementation of ``build_tree_mask``; drafters may override it."""

    @hookspecs.hookimpl(trylast=True)
    def build_tree_mask(self, request, proposal: DraftProposal) -> TreeMask:
        return default_tree_mask(proposal)


#: the name of a method's lookup drafter (``speculative_config.lookup``) in its engine's
#: plugin manager
LOOKUP_PLUGIN = "lookup"


def drafter_plugin_manager(drafter: object, name: str, lookup: object | None = None) -> pluggy.PluginManager:
    """A plugin manager for one engine: the core's default hooks plus this drafter, and its
    lookup drafter (:data:`LOOKUP_PLUGIN`) where it has one: every hook reaches both but
    ``prepare_draft_tokens``, which the draft stage asks of each apart
    (:func:`proposal_callers`)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(CoreTreeHooks(), name="specdec-core")
    for plugin, plugin_name in ((drafter, name), (lookup, LOOKUP_PLUGIN)):
        if plugin is None:
            continue
        try:
            pm.register(plugin, name=plugin_name)
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"drafter {plugin_name!r} implements a hook wrongly: {exc}") from None
    return pm


def proposal_callers(pm: pluggy.PluginManager) -> tuple[pluggy.HookCaller, pluggy.HookCaller | None]:
    """``prepare_draft_tokens`` of the method alone, and of its lookup drafter alone (None
    where it has none)."""
    lookup = pm.get_plugin(LOOKUP_PLUGIN)
    if lookup is None:
        return pm.hook.prepare_draft_tokens, None
    others = [plugin for plugin in pm.get_plugins() if plugin is not lookup]
    return (pm.subset_hook_caller("prepare_draft_tokens", [lookup]),
            pm.subset_hook_caller("prepare_draft_tokens", others))
