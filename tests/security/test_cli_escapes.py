"""``npukv`` never writes a terminal control sequence taken from a file
(security review, finding 10). Anyone who can write to a cache directory
chooses a chunk's metadata (its creator), namespace.json's fields, tensor and
file names and the marker; ``npukv inspect`` once copied a creator's
``ESC ] 0 ; title BEL`` (retitles the terminal) and ``ESC [ 2 J`` (clears it)
to stdout. Every form is checked: plain text, rich tables and ``--json``, on
stdout and stderr; the only control character left is the newline the CLI
writes itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.cli import main
from npukv_store.cli import render as cli_render
from npukv_store.store.directory import MARKER
from tests.support.blocks import block_tensors, tiny_spec

#: OSC (set the window title, ended by BEL), clear the screen, a colour, the
#: one-byte C1 CSI, DEL, carriage return, backspace and a bidi override.
EVIL = "\x1b]0;owned-title\x07\x1b[2J\x1b[31m\x9b2J\x7f\r\b\u202e"
#: What may not reach a terminal: C0 but the newline, DEL, C1, the line and
#: paragraph separators, bidi overrides and isolates.
CONTROLS = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def _reheader(path: str, edit) -> None:
    """Rewrite the chunk's header JSON as ``edit(body)`` returns it, padded to
    a 4096 multiple (data offsets are relative to the data section)."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack_from("<Q", data)
    body = edit(json.loads(data[8 : 8 + length].rstrip(b" ")))
    text = json.dumps(body, separators=(",", ":")).encode()
    total = -(-(8 + len(text)) // 4096) * 4096
    head = struct.pack("<Q", total - 8) + text.ljust(total - 8)
    with open(path, "wb") as f:
        f.write(head + data[8 + length :])


def _set_creator(body: dict) -> dict:
    body["__metadata__"]["npukv_creator"] = "1@host" + EVIL
    return body


@pytest.fixture
def evil_cache(tmp_path):
    """A cache whose namespace.json (model and revision, as a server wrote
    them, and kv_dtype, as an attacker edited it) and whose one chunk's creator
    carry EVIL: (root, namespace, chunk file). Tensor and part names cannot:
    NamespaceSpec refuses them."""
    root = str(tmp_path / "c")
    spec = tiny_spec(model="m" + EVIL, revision="r" + EVIL)
    with KVStore(StoreConfig(cache_dir=root), spec) as store:
        keys = store.keys_for(range(64))
        store.put(keys, block_tensors(store.spec, keys))
        namespace = store.namespace
    chunks = os.path.join(root, namespace, "chunks")
    (name,) = os.listdir(chunks)
    chunk = os.path.join(chunks, name)
    _reheader(chunk, _set_creator)
    spec_path = os.path.join(root, namespace, "namespace.json")
    with open(spec_path) as f:
        body = json.load(f)
    body["kv_dtype"] += EVIL
    with open(spec_path, "w") as f:
        json.dump(body, f)
    return root, namespace, chunk


def _run(capsys, *argv: str) -> str:
    code = main(list(argv))
    captured = capsys.readouterr()
    assert code in (0, 2), (argv, code, captured.err)
    return captured.out + captured.err


def _assert_clean(output: str, pattern: re.Pattern[str] = CONTROLS) -> None:
    found = sorted({hex(ord(c)) for c in pattern.findall(output)})
    assert not found, f"control characters {found} reached the terminal:\n{output!r}"


@pytest.mark.parametrize("use_rich", [False, True], ids=["plain", "rich"])
def test_chunk_metadata_is_escaped(attack, evil_cache, capsys, monkeypatch, use_rich):
    root, _, chunk = evil_cache
    monkeypatch.setattr(cli_render, "USE_RICH", use_rich)
    with attack("cli: escapes in chunk metadata"):
        output = _run(capsys, "inspect", root, chunk, "--plan")
        _assert_clean(output)
        assert "owned-title" in output  # shown, escaped: \x1b]0;owned-title\x07
        assert "\\x1b]0;owned-title\\x07" in output
        _assert_clean(_run(capsys, "inspect", chunk))  # the old form
        _assert_clean(_run(capsys, "inspect", root, chunk, "--json"))


@pytest.mark.parametrize("use_rich", [False, True], ids=["plain", "rich"])
def test_namespace_json_is_escaped(attack, evil_cache, capsys, monkeypatch, use_rich):
    root, namespace, _ = evil_cache
    monkeypatch.setattr(cli_render, "USE_RICH", use_rich)
    with attack("cli: escapes in namespace.json"):
        output = _run(capsys, "inspect", root, namespace)
        _assert_clean(output)
        assert "m\\x1b]0;owned-title\\x07" in output  # read, shown escaped
        assert "float16\\x1b]0;owned-title\\x07" in output
        _assert_clean(_run(capsys, "stats", root))
        for argv in (("inspect", root, namespace), ("stats", root)):
            _assert_clean(_run(capsys, *argv, "--json"))


@pytest.mark.parametrize("use_rich", [False, True], ids=["plain", "rich"])
def test_file_names_are_escaped(
    attack, evil_cache, tmp_path, capsys, monkeypatch, use_rich
):
    """A chunk file given by a name someone else chose."""
    root, _, chunk = evil_cache
    monkeypatch.setattr(cli_render, "USE_RICH", use_rich)
    named = shutil.copy(chunk, tmp_path / f"x{EVIL.replace('/', '')}.safetensors")
    with attack("cli: escapes in file names"):
        _assert_clean(_run(capsys, "inspect", root, str(named)))


def test_marker_fields_are_escaped(attack, evil_cache, capsys):
    """A marker whose fields carry EVIL: the one-line error shows them escaped."""
    root, _, _ = evil_cache
    marker = os.path.join(root, MARKER)
    with open(marker) as f:
        body = json.load(f)
    body["format_version"] = EVIL
    with open(marker, "w") as f:
        json.dump(body, f)
    with attack("cli: escapes in the marker"):
        for argv in (("stats", root), ("inspect", root, "00"), ("verify", root)):
            _assert_clean(_run(capsys, *argv))
