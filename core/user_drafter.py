"""``decoding_type: user``: a drafter from the user's own code.

    speculative_config: {decoding_type: user, drafter: "my_pkg.drafts:MyDrafter", options: {k: 3}}

In YAML the drafter is a dotted path; in Python it may also be the class itself or a
ready instance (``LLM(speculative_config={"decoding_type": "user", "drafter": MyDrafter()})``,
as TensorRT-LLM's ``UserProvidedDecodingConfig`` takes one). A class is built as
``MyDrafter(config, target)``; either way it implements the hooks of :mod:`specdec.drafting.hookspecs`
like any plugin's drafter, and ``config.options`` holds its options.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from .config import SpeculativeConfig
from .drafting.hookspecs import hookimpl
from .errors import FieldError, PluginError
from .plugins import DecodingType


@attrs.frozen(kw_only=True)
class UserDrafterConfig(SpeculativeConfig):
    """Attributes: drafter: ``"package.module:Class"``, a class, or an instance; options:
    free-form options for it."""

    drafter: Any = attrs.field()
    options: dict[str, Any] = attrs.Factory(dict)

    @drafter.validator
    def _check(self, attribute, value):
        if isinstance(value, str):
            if ":" not in value:
                raise FieldError(attribute.name, f"expected 'package.module:Class', got {value!r}")
        elif not (isinstance(value, type) or hasattr(value, "prepare_draft_tokens")):
            raise FieldError(attribute.name, f"expected 'package.module:Class', a drafter class or a drafter "
                                             f"instance (with prepare_draft_tokens), got {value!r}")


def load_user_drafter(config: UserDrafterConfig, target):
    if not isinstance(config.drafter, str):
        return config.drafter(config, target) if isinstance(config.drafter, type) else config.drafter
    module_name, _, attr = config.drafter.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"speculative_config.drafter: cannot import {config.drafter!r}: {exc}") from None
    return cls(config, target)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="user", config_class=UserDrafterConfig, drafter_class=load_user_drafter,
                          description="a drafter class from your own code (drafter: 'pkg.module:Class')"))
