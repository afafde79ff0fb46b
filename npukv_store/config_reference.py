"""The configuration reference, rendered from StoreConfig's field metadata.

Runs in: a developer's shell; imports only ``config``. ``render()`` returns the
text of docs/guide/configuration.md: every key with its type, default,
environment variable and doc, grouped by ``section``, from the ``_doc`` entries
in config.py. ``python -m npukv_store.config_reference`` prints it;
``--write`` writes it over the repository's copy. tests/test_config_reference.py
fails when the committed page differs from ``render()``, so a key's doc is
changed in config.py, never in the page.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

from npukv_store.config import StoreConfig

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "guide" / "configuration.md"
REGENERATE = "python -m npukv_store.config_reference --write"
ENV_PREFIX = "NPUKV_"
WIDTH = 80

#: (section, title, what its keys have in common), in page order
SECTIONS = (
    ("store", "Store", "Read by every store handle: the connector's, `npukv`'s and "
     "the maintenance job's."),
    ("connector", "Connector", "Read by the vLLM connector only; a store handle "
     "opened from Python ignores them."),
    ("remote", "Remote tier", "The Mooncake Store tier behind the local store "
     "([remote-tier.md](remote-tier.md)); off by default."),
)  # fmt: skip

HEADER = f"""\
# Configuration reference

<!-- Generated from npukv_store/config.py by `{REGENERATE}`;
     edit the field docs there, not this page. -->

Every key is a field of `StoreConfig` and a key of vLLM's
`kv_connector_extra_config`; the environment variable `NPUKV_<KEY>` overrides
it (e.g. `NPUKV_REMOTE_STORE=none`). Unknown keys and bad values are one message
that names the key, what was found and what was expected: a `ConfigError` from
`StoreConfig`, `npukv` and `scripts/compact.py`; in vLLM the connector turns
itself off with that line as its one error, and vLLM serves without it
([decision 0056](../decisions/0056-vllm-versions.md)). Sizes accept `4096`,
`64MiB`, `500GiB` or `1.5TB` (KiB/MiB/GiB/TiB and K/M/G/T are powers of 1024,
KB/MB/GB/TB powers of 1000); booleans `true`/`false`, `1`/`0`, `yes`/`no` or
`on`/`off`.
"""

_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_DOC_LINK = re.compile(r"docs/((?:decisions/(\d{4}))|[\w/-]+\.md)")
_LINK_TEXT = re.compile(r"\[[^\]]*\]")
_NBSP = "\u00a0"  # holds a link's words together while wrapping (not in any doc)


def env_var(key: str) -> str:
    """The environment variable that overrides ``key``."""
    return f"{ENV_PREFIX}{key.upper()}"


def format_size(size: int) -> str:
    """``size`` in the largest binary unit that holds it exactly (``64MiB``)."""
    for unit, factor in _BINARY_UNITS:
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def format_default(field: dataclasses.Field[object]) -> str:
    """The default as a ``kv_connector_extra_config`` value would spell it."""
    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    if field.metadata["unit"] == "bytes" and isinstance(value, int):
        return f"`{format_size(value)}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    if isinstance(value, tuple):  # a mapping, kept as pairs (hashable)
        return f"`{json.dumps(dict(value))}`"
    if value == "":
        return '`""`'
    return f"`{value}`"


def format_type(field: dataclasses.Field[object]) -> str:
    """What the key takes: one of its choices, a size, or a number and its unit."""
    choices: tuple[str, ...] = field.metadata["choices"]
    if choices:
        return " \\| ".join(f"`{choice}`" for choice in choices)
    unit: str = field.metadata["unit"]
    if unit == "bytes":
        return "size"
    if unit == "shares":
        return "mapping: cache_salt -> fraction or size"
    kind = str(field.type)
    return f"{kind}, {unit}" if unit else kind


def _link(match: re.Match[str]) -> str:
    """A ``docs/...`` mention in a field doc as a link relative to docs/guide/."""
    path, number = match.group(1), match.group(2)
    if number is not None:
        found = sorted((REPO / "docs" / "decisions").glob(f"{number}-*.md"))
        if not found:
            return match.group(0)
        return f"[decision {number}](../decisions/{found[0].name})"
    target = path.removeprefix("guide/") if path.startswith("guide/") else f"../{path}"
    return f"[{Path(path).name}]({target})"


def _fill(text: str) -> str:
    """``text`` wrapped at WIDTH, never inside a link's text."""
    joined = _LINK_TEXT.sub(lambda m: m.group(0).replace(" ", _NBSP), text)
    wrapped = textwrap.fill(
        joined, width=WIDTH, break_long_words=False, break_on_hyphens=False
    )
    return wrapped.replace(_NBSP, " ")


def _entry(field: dataclasses.Field[object]) -> list[str]:
    doc = _DOC_LINK.sub(_link, field.metadata["doc"])
    return [f"### `{field.name}`", "", _fill(doc), ""]


def render() -> str:
    """The text of docs/guide/configuration.md."""
    fields = dataclasses.fields(StoreConfig)
    known = {name for name, _, _ in SECTIONS}
    strays = [f.name for f in fields if f.metadata.get("section") not in known]
    if strays:
        raise ValueError(f"fields without a known section: {', '.join(strays)}")
    lines = [HEADER]
    for name, title, about in SECTIONS:
        members = [f for f in fields if f.metadata["section"] == name]
        lines += [f"## {title}", "", _fill(about), ""]
        lines += ["| key | type | default | environment |", "|---|---|---|---|"]
        lines += [
            f"| [`{f.name}`](#{f.name}) | {format_type(f)} | {format_default(f)} "
            f"| `{env_var(f.name)}` |"
            for f in members
        ]
        lines.append("")
        for f in members:
            lines += _entry(f)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the reference, or with ``--write`` write it to the page."""
    parser = argparse.ArgumentParser(
        prog="python -m npukv_store.config_reference", description=__doc__
    )
    parser.add_argument(
        "--write",
        nargs="?",
        const=str(PAGE),
        metavar="PATH",
        help=f"write the page (default {PAGE.relative_to(REPO)}) instead of printing",
    )
    args = parser.parse_args(argv)
    text = render()
    if args.write is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.write)
    if not path.parent.is_dir():
        parser.error(f"--write: found no directory {path.parent}, expected docs/guide")
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
