"""docs/configuration.md, the generated reference of every config key, is complete and current.

The page is written by ``scripts/gen_config_docs.py`` from the schema's dataclasses and the
docstrings under their fields; these tests fail when a key is added, renamed or redocumented
without regenerating it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
import typing
from pathlib import Path

from rlorch.config.schema import Config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
REGENERATE = "docs/configuration.md is out of date with rlorch/config/schema.py: run python scripts/gen_config_docs.py"


def _generator():
    name = "gen_config_docs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "gen_config_docs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses in the module look their own module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Dotted names of every field that is not itself a section, walked at runtime."""
    hints = typing.get_type_hints(cls)
    found = []
    for item in dataclasses.fields(cls):
        kind = hints[item.name]
        if dataclasses.is_dataclass(kind):
            found += _leaf_keys(kind, f"{prefix}{item.name}.")
        else:
            found.append(f"{prefix}{item.name}")
    return found


def test_every_schema_key_is_documented():
    text = DOC.read_text(encoding="utf-8")
    keys = _leaf_keys(Config)
    assert len(keys) > 100 and "trainer.fsdp.max_tokens_per_micro_batch" in keys
    missing = [key for key in keys if f"`{key}`" not in text]
    assert not missing, f"{REGENERATE} (missing: {', '.join(missing)})"
    documented = _generator().all_keys(text)
    assert sorted(documented) == sorted(keys), f"{REGENERATE} (keys on the page differ from the schema's)"


def test_page_is_what_the_generator_writes():
    generator = _generator()
    expected = generator.render()
    actual = DOC.read_text(encoding="utf-8")
    if actual != expected:
        problems = "; ".join(generator.differences(expected, actual))
        raise AssertionError(f"{REGENERATE} ({problems})")
    assert generator.render() == expected, "the generator's output must be deterministic"


def test_every_field_has_a_docstring():
    assert _generator().undocumented() == [], "add a docstring under each of these fields in rlorch/config/schema.py"


SYNTHETIC = '''
    """A module shaped like the schema."""

    from __future__ import annotations

    import enum
    from dataclasses import dataclass, field
    from typing import ClassVar, Optional


    class Colour(str, enum.Enum):
        """Not a section."""

        red = "red"
        blue = "blue"


    @dataclass
    class Inner:
        """The inner section."""

        depth: int = 3
        """How deep,
            over two lines."""
        undocumented: str = "x"
        after: Colour = Colour.blue
        """Documented after an undocumented field."""


    @dataclass
    class Outer:
        count: Optional[int] = None
        """How many; empty: all."""
        names: list[str] = field(default_factory=lambda: ["a", "b"])
        """Names."""
        LIMIT: ClassVar[int] = 4
        """A class constant, not a key."""
        inner: Inner = field(default_factory=Inner)
        plain = 5
        """Not annotated: not a field."""

        @property
        def derived(self) -> int:
            """Computed, not a key."""
            return 2 * self.depth

        def method(self) -> None:
            x: int = 1
            """Inside a function: not a field of the class."""


    @dataclass
    class Root:
        outer: Outer = field(default_factory=Outer)
'''


def _load(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(SYNTHETIC), encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return path, module


def test_parser_pairs_each_field_with_the_string_under_it(tmp_path):
    generator = _generator()
    path, _ = _load(tmp_path, "synthetic_schema_parse")
    sys.modules.pop("synthetic_schema_parse", None)
    docs = generator.parse_docs(path.read_text(encoding="utf-8"))
    assert docs["Inner"] == {"": "The inner section.", "depth": "How deep, over two lines.",
                             "after": "Documented after an undocumented field."}
    assert docs["Outer"] == {"count": "How many; empty: all.", "names": "Names.",
                             "LIMIT": "A class constant, not a key."}
    assert docs["Root"] == {}
    assert docs["Colour"] == {"": "Not a section."}


def test_render_of_a_synthetic_schema(tmp_path):
    generator = _generator()
    _, module = _load(tmp_path, "synthetic_schema_render")
    try:
        text = generator.render(module.Root)
        assert generator.all_keys(text) == ["outer.count", "outer.names", "outer.inner.depth",
                                            "outer.inner.undocumented", "outer.inner.after"]
        assert "### `outer.count`\n\n`int` or empty · default `null`\n\nHow many; empty: all.\n" in text
        assert "### `outer.names`\n\n`list[str]` · default `[a, b]`\n\nNames.\n" in text
        assert "### `outer.inner.depth`\n\n`int` · default `3`\n\nHow deep, over two lines.\n" in text
        assert ("### `outer.inner.after`\n\none of `red`, `blue` · default `blue`\n\n"
                "Documented after an undocumented field.\n") in text
        assert "### `outer.inner.undocumented`\n\n`str` · default `x`\n\n_Not documented in the schema._\n" in text
        assert "## `outer.inner`\n\nThe inner section.\n" in text
        for absent in ("LIMIT", "plain", "derived", "method", "`outer.inner`\n\n`"):
            assert absent not in text.split("## Sections")[1]
        assert generator.undocumented(module.Root) == ["outer.inner.undocumented"]
    finally:
        sys.modules.pop("synthetic_schema_render", None)
