"""Errors specdec raises on purpose: each names what is wrong and how to fix it."""


class SpecdecError(Exception):
    """Base class of every error specdec raises for bad input or a missing piece."""


class ConfigError(SpecdecError, ValueError):
    """A configuration value is wrong; the message starts with the path of the field."""


class FieldError(ConfigError):
    """One field's value is out of range or not allowed; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PluginError(SpecdecError):
    """A decoding type is unknown, its plugin is missing, broken or not implemented yet."""


class ModelLoadError(SpecdecError):
    """A model or tokenizer could not be loaded from the place given."""


class RequestError(SpecdecError, ValueError):
    """A single request cannot be served (prompt too long, bad sampling parameters...).

    Raised for that request only; the engine keeps serving the others.
    """


class KVCacheFullError(RequestError):
    """A request needs more KV cache than the whole pool holds, so it can never run."""
