"""Generate docs/configuration.md, the reference of every config key, from the schema.

The schema (:mod:`rlorch.config.schema`) is one dataclass per section, rooted at ``Config``, with a
docstring under every field. Python keeps no such docstrings at runtime, so they are read from
the module's source with :mod:`ast` (each annotated assignment paired with the string expression
statement right after it); names, types and defaults come from the dataclasses themselves.

    python scripts/gen_config_docs.py           # write docs/configuration.md
    python scripts/gen_config_docs.py --check   # exit 1, naming the keys, if it is out of date
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import importlib
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"
SCHEMA_MODULE = "rlorch.config.schema"
ROOT_CLASS = "Config"
SCRIPT = "scripts/gen_config_docs.py"
SCHEMA_FILE = "rlorch/config/schema.py"


# --- docstrings, from the source ---------------------------------------------------------------

def normalise(text: str) -> str:
    """A docstring on one line: runs of whitespace (newlines and indentation included) to one space."""
    return " ".join(text.split())


def _string(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
        return node.value.value
    return None


def parse_docs(source: str) -> dict[str, dict[str, str]]:
    """Docstrings by class name, then by field name, read from a module's source.

    A field's docstring is the string expression statement directly after its annotated
    assignment (``name: type = default`` then ``\"\"\"...\"\"\"``); the class's own docstring is
    under the key ``""``. Classes nested anywhere in the module are included; a field with no
    string right after it is absent. Whitespace is normalised.
    """
    docs: dict[str, dict[str, str]] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        found: dict[str, str] = {}
        own = ast.get_docstring(node, clean=True)
        if own is not None:
            found[""] = normalise(own)
        body = node.body
        for statement, following in zip(body, body[1:] + [None]):
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            text = _string(following) if following is not None else None
            if text is not None:
                found[statement.target.id] = normalise(text)
        docs[node.name] = found
    return docs


@functools.lru_cache(maxsize=None)
def _module_docs(module_name: str) -> dict[str, dict[str, str]]:
    module = sys.modules[module_name]
    return parse_docs(Path(module.__file__).read_text(encoding="utf-8"))


def field_doc(cls: type, name: str) -> str | None:
    """The docstring under field ``name`` in ``cls`` or the dataclass base that declares it."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return _module_docs(klass.__module__).get(klass.__qualname__.rsplit(".", 1)[-1], {}).get(name)
    return None


def class_doc(cls: type) -> str | None:
    return _module_docs(cls.__module__).get(cls.__qualname__.rsplit(".", 1)[-1], {}).get("")


# --- the tree of sections ----------------------------------------------------------------------

@dataclasses.dataclass
class Key:
    key: str
    type: str
    default: str
    doc: str | None


@dataclasses.dataclass
class Section:
    key: str
    cls: type
    doc: str | None
    keys: list[Key]
    children: list[str]


def sections(root: type, prefix: str = "") -> Iterator[Section]:
    """Every dataclass section under ``root`` (not ``root`` itself), depth first in field order."""
    hints = typing.get_type_hints(root)
    for item in dataclasses.fields(root):
        kind = hints[item.name]
        if dataclasses.is_dataclass(kind):
            yield from _section(kind, f"{prefix}{item.name}")


def _section(cls: type, key: str) -> Iterator[Section]:
    hints = typing.get_type_hints(cls)
    keys, children, nested = [], [], []
    for item in dataclasses.fields(cls):
        kind, dotted = hints[item.name], f"{key}.{item.name}"
        if dataclasses.is_dataclass(kind):
            children.append(dotted)
            nested.append((kind, dotted))
            continue
        keys.append(Key(dotted, render_type(kind), render_default(item), field_doc(cls, item.name)))
    yield Section(key, cls, class_doc(cls), keys, children)
    for kind, dotted in nested:
        yield from _section(kind, dotted)


# --- types and defaults ------------------------------------------------------------------------

def _choices(kind: type[enum.Enum]) -> str:
    return ", ".join(f"`{member.value}`" for member in kind)


def _plain_type(kind: Any) -> str:
    """A type without markdown: ``int``, ``list[str]``, ``dict[str, any]``."""
    if kind is Any:
        return "any"
    if kind is type(None):
        return "null"
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_plain_type(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_plain_type(a) for a in args)}]" if args else name
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "str"
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "")


def render_type(kind: Any) -> str:
    """A field's type for a reader, in markdown: ``int``, ``int`` or empty, one of ``a``, ``b``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        rest = tuple(a for a in args if a is not type(None))
        kind = rest[0] if len(rest) == 1 else typing.Union[rest]
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        text = f"one of {_choices(kind)}"
        return f"{text}, or empty" if optional else text
    text = f"`{_plain_type(kind)}`"
    return f"{text} or empty" if optional else text


_PLAIN = re.compile(r"^[A-Za-z0-9_./@+-]+$")


def render_value(value: Any) -> str:
    """A default as it is written in a preset or an override (YAML flow style), without backticks."""
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return render_value(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value if _PLAIN.match(value) and value not in ("null", "true", "false") else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render_value(k)}: {render_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_default(item: dataclasses.Field) -> str:
    if item.default is not dataclasses.MISSING:
        return f"`{render_value(item.default)}`"
    if item.default_factory is not dataclasses.MISSING:
        return f"`{render_value(item.default_factory())}`"
    return "required (no default)"


# --- the page ----------------------------------------------------------------------------------

INTRO = f"""\
# Configuration reference

<!-- Generated by {SCRIPT} from {SCHEMA_FILE}; do not edit by hand.
     After changing the schema, run: python {SCRIPT} -->

Every key rlorch reads, section by section, with its type, its default and what it does. The
text is the docstring under each field of `{SCHEMA_FILE}`, the typed schema every config is
checked against (an unknown key or a value of the wrong type fails before anything starts).

**Setting keys.** Any key can be set on the command line as `key=value`, e.g.
`rlorch train rollout.max_staleness=0 trainer.lr=5e-4`; lists are written `[a,b]` and an empty
value is `null` (`key=null`). A preset from `conf/` supplies the starting values: `conf/config.yaml`
by default, another with `conf=NAME` (`conf=sim`, `conf=recipes/gsm8k_qwen05b`) or your own
YAML file with `conf=path/to/file.yaml`. Backends are chosen by config group: `inference=sim`,
`inference=cpu`, `inference=sglang`, `trainer=sim`, `trainer=fsdp`, `task=NAME`; each group's
presets live in `conf/<group>/`. A backend's own section (`inference.sim`, `trainer.fsdp`, ...)
only matters when that backend is selected, but every key is listed here.

**Defaults.** The defaults below are the schema's; the shipped presets set several keys
differently (`conf/config.yaml` and `conf/trainer/fsdp.yaml`, for instance). To see the values a
run would use, with every check applied, run `rlorch validate-config [key=value ...]` (add
`--show` to print the whole resolved config as YAML).

"Empty" in a type means the key may be `null`; what that selects is in the key's description.
"""


def markdown(doc: str) -> str:
    """A docstring's reStructuredText literals and roles (````x````, ``:mod:`x```) as markdown code."""
    doc = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", doc)
    return re.sub(r"``([^`]+)``", r"`\1`", doc)


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def render(root: type | None = None) -> str:
    """The whole of docs/configuration.md for the schema rooted at ``root`` (default: ``Config``)."""
    if root is None:
        root = getattr(importlib.import_module(SCHEMA_MODULE), ROOT_CLASS)
    tree = list(sections(root))
    lines = [INTRO, "## Sections", ""]
    for section in tree:
        depth = section.key.count(".")
        count = f"{len(section.keys)} key{'' if len(section.keys) == 1 else 's'}"
        lines.append(f"{'  ' * depth}- [`{section.key}`](#{anchor(section.key)}) ({count})")
    lines.append("")
    for section in tree:
        lines += [f"## `{section.key}`", ""]
        if section.doc:
            lines += [markdown(section.doc), ""]
        if section.children:
            links = ", ".join(f"[`{c}`](#{anchor(c)})" for c in section.children)
            lines += [f"Sub-sections: {links}.", ""]
        for key in section.keys:
            lines += [f"### `{key.key}`", "", f"{key.type} · default {key.default}", ""]
            lines += [markdown(key.doc) if key.doc else "_Not documented in the schema._", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def undocumented(root: type | None = None) -> list[str]:
    """Keys with no docstring under their field in the schema."""
    if root is None:
        root = getattr(importlib.import_module(SCHEMA_MODULE), ROOT_CLASS)
    return [k.key for section in sections(root) for k in section.keys if not k.doc]


def all_keys(text: str) -> list[str]:
    """The keys a rendered page documents (its ``### `key``` headings), in page order."""
    return re.findall(r"^### `([^`]+)`$", text, flags=re.M)


def _blocks(text: str) -> dict[str, str]:
    parts = re.split(r"^(?=### `)", text, flags=re.M)
    return {all_keys(p)[0]: p.split("\n## ", 1)[0].strip() for p in parts if p.startswith("### `")}


def differences(expected: str, actual: str) -> list[str]:
    """What ``actual`` (the page on disk) lacks or has wrong compared with ``expected``, by key."""
    want, have = _blocks(expected), _blocks(actual)
    found = [f"missing: {k}" for k in want if k not in have]
    found += [f"stale (no longer in the schema): {k}" for k in have if k not in want]
    found += [f"out of date: {k}" for k in want if k in have and want[k] != have[k]]
    if not found and expected != actual:
        found.append("the text outside the keys' entries differs (intro, section headings or order)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {OUTPUT.relative_to(ROOT)} differs from what would be written")
    args = parser.parse_args(argv)
    expected = render()
    for key in undocumented():
        print(f"warning: {key} has no docstring in {SCHEMA_FILE}", file=sys.stderr)
    relative = OUTPUT.relative_to(ROOT)
    if args.check:
        if not OUTPUT.is_file():
            print(f"{relative} does not exist: run python {SCRIPT}")
            return 1
        actual = OUTPUT.read_text(encoding="utf-8")
        if actual == expected:
            print(f"{relative} is up to date ({len(all_keys(expected))} keys)")
            return 0
        print(f"{relative} is out of date with {SCHEMA_FILE}:")
        for line in differences(expected, actual):
            print(f"  {line}")
        print(f"run: python {SCRIPT}")
        return 1
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUTPUT, "w", encoding="utf-8", newline="\n") as out:
        out.write(expected)
    print(f"wrote {relative} ({len(all_keys(expected))} keys)")
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
