"""mkdocs hook: the reference pages are generated from the code at build time.

``<!-- configuration -->`` becomes one table per configuration class (its attrs fields,
types, defaults, and the descriptions of its docstring's ``Attributes:`` section), and one
per installed method's own options; ``<!-- hooks -->`` becomes every hook specification
of :mod:`specdec.drafting.hookspecs` with its signature and docstring; ``<!-- plugin_api -->`` every
name of :mod:`specdec.plugin_api`, grouped as its ``__all__`` groups them.
"""

from __future__ import annotations

import inspect
import re

import attrs

ROLE = re.compile(r":(?:class|func|mod|attr|meth|data):`~?([^`]+)`")


def _markdown(text: str) -> str:
    """reStructuredText roles and literals as Markdown."""
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    text = re.sub(r"^:param (\w+):", r"- **\1**:", text, flags=re.M)
    text = re.sub(r"^:returns?:", "\n**Returns:**", text, flags=re.M)
    return re.sub(r"::$", ":", text, flags=re.M)  # a literal block: indented, it stays code


def _attribute_docs(cls) -> dict[str, str]:
    """name -> description, from the ``Attributes:`` sections of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.getdoc(klass) or ""
        if "Attributes:" not in doc or klass.__module__ == "builtins":
            continue
        section = doc.split("Attributes:", 1)[1]
        name = None
        for line in section.splitlines():
            match = re.match(r"^    (\w+): (.*)$", line)
            if match:
                name = match.group(1)
                docs[name] = match.group(2)
            elif name and line.startswith("        "):
                docs[name] += " " + line.strip()
            elif line.strip():
                name = None
    return docs


def _default(field) -> str:
    if field.default is attrs.NOTHING:
        return "required"
    if isinstance(field.default, attrs.Factory):
        if field.default.takes_self:
            return "derived from the other keys"
        value = field.default.factory()
        return "its own table" if attrs.has(type(value)) else f"`{value!r}`"
    return f"`{field.default!r}`"


def _table(cls, prefix: str) -> str:
    docs = _attribute_docs(cls)
    intro = (inspect.getdoc(cls) or "").split("Attributes:", 1)[0].strip()
    rows = [f"### `{prefix}`" if prefix else f"### `{cls.__name__}`", "", _markdown(intro), "",
            "| key | type | default | meaning |", "|---|---|---|---|"]
    for field in attrs.fields(cls):
        if field.name.startswith("_"):
            continue
        kind = str(field.type).replace("|", "\\|")
        meaning = _markdown(docs.get(field.name, "")).replace("|", "\\|")
        rows.append(f"| `{field.name}` | `{kind}` | {_default(field).replace('|', '/')} | {meaning} |")
    return "\n".join(rows) + "\n"


def configuration_reference() -> str:
    from specdec.config import EngineConfig, SpecdecConfig, SpeculativeConfig, TreeDraftConfig
    from specdec.plugins import get_registry
    from specdec.sampling_params import SamplingParams

    parts = [_table(SpecdecConfig, ""), _table(EngineConfig, "engine"), _table(SamplingParams, "sampling"),
             _table(SpeculativeConfig, "speculative_config"),
             _table(TreeDraftConfig, "speculative_config (tree-drafting methods)")]
    for method in sorted(get_registry().types.values(), key=lambda t: t.name):
        own = [f for f in attrs.fields(method.config_class)
               if f.name not in {g.name for g in attrs.fields(SpeculativeConfig)}]
        if own:
            parts.append(_table(method.config_class, f"speculative_config: decoding_type {method.name}"))
    return "\n".join(parts)


def hooks_reference() -> str:
    from specdec.drafting import hookspecs

    parts = []
    for name, func in inspect.getmembers(hookspecs, inspect.isfunction):
        if func.__module__ != hookspecs.__name__ or not hasattr(func, "specdec_spec"):
            continue
        parts.append(f"### `{name}{inspect.signature(func)}`\n\n{_markdown(inspect.getdoc(func) or '')}\n")
    order = [n for n in re.findall(r"^def (\w+)", inspect.getsource(hookspecs), flags=re.M)]
    parts.sort(key=lambda p: order.index(re.match(r"### `(\w+)", p).group(1)))
    return "\n".join(parts)


def plugin_api_reference() -> str:
    """One table per group of :mod:`specdec.plugin_api`'s ``__all__``, in its order, with the
    first paragraph of each name's docstring (a constant: its value)."""
    from specdec import plugin_api

    source = inspect.getsource(plugin_api).split("__all__ = [", 1)[1]
    parts = []
    for group, names in re.findall(r"# (.+)\n((?:\s+\".*\n)+)", source):
        rows = [f"### {group[0].upper()}{group[1:]}", "", "| name | defined in | what it is |", "|---|---|---|"]
        for name in re.findall(r'"(\w+)"', names):
            value = getattr(plugin_api, name)
            home = getattr(value, "__module__", None) or "-"
            doc = (inspect.getdoc(value) or "") if callable(value) else f"``{value!r}``"
            summary = _markdown(doc.split("\n\n", 1)[0].replace("\n", " ")).replace("|", "\\|")
            rows.append(f"| `{name}` | {home if home == '-' else f'`{home}`'} | {summary} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "<!-- configuration -->" in markdown:
        markdown = markdown.replace("<!-- configuration -->", configuration_reference())
    if "<!-- hooks -->" in markdown:
        markdown = markdown.replace("<!-- hooks -->", hooks_reference())
    if "<!-- plugin_api -->" in markdown:
        markdown = markdown.replace("<!-- plugin_api -->", plugin_api_reference())
    return markdown
