"""The C extension's size arithmetic cannot overflow, and the build is
hardened (security review, findings 8 and 9).

Each entry point is called with counts, offsets and lengths whose products or
sums wrap a 64-bit integer: ``xxh3_rows([b''], 2**61)`` once sized its result
as nrows * 8 = 0 bytes and wrote 2**61 digests past it (SIGSEGV). Every call
must raise ValueError naming what it found, in the C extension and in its
pure-Python twin alike (tests/test_native.py checks that their messages are
the same). The calls run in a child process, so that a regression shows as a
crash of that attack kind instead of a dead pytest: the child loads
``_native`` and ``_twin`` straight from their files (not through the package,
so each child takes a fraction of a second) and prints one JSON line per call
before and after it.
"""

from __future__ import annotations

import glob
import importlib.machinery
import json
import platform
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "npukv_store"


def native_path() -> str | None:
    """The built extension in the source tree, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        found = glob.glob(str(PACKAGE / f"_native{suffix}"))
        if found:
            return found[0]
    return None


# The child's prelude: IMPLS maps "native" (when built) and "twin" to the
# modules; call() runs one call and prints what it raised.
PRELUDE = """
import importlib.machinery, importlib.util, json, os, sys, tempfile
import numpy as np

def load(name, path, loader=None):
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

native_path, twin_path = sys.argv[1], sys.argv[2]
IMPLS = {}
if native_path:
    IMPLS["native"] = load(
        "npukv_store._native", native_path,
        importlib.machinery.ExtensionFileLoader("npukv_store._native", native_path),
    )
IMPLS["twin"] = load("npukv_twin", twin_path)
INT64_MAX = 2**63 - 1

def call(label, fn, expect="ValueError", match="", impls=("native", "twin")):
    # fn(module) on each implementation; expect: the exception's type name,
    # None (returns) or "any" (anything but a crash)
    for impl, module in IMPLS.items():
        if impl not in impls:
            continue
        print(json.dumps({"label": label, "impl": impl, "started": True}), flush=True)
        try:
            fn(module)
            raised, message = None, ""
        except Exception as exc:
            raised, message = type(exc).__name__, str(exc)
        print(json.dumps({"label": label, "impl": impl, "raised": raised,
                          "message": message, "expect": expect, "match": match}),
              flush=True)

def huge_view(nbytes, ndim=1):
    # a buffer claiming nbytes over 40 real ones (the caller's word, as a
    # C exporter or numpy's as_strided may give it); never read past 40
    base = np.zeros(5, np.int64)
    if ndim == 2:
        return np.lib.stride_tricks.as_strided(base, shape=(nbytes // 40, 5),
                                               strides=(40, 8))
    return np.lib.stride_tricks.as_strided(base, shape=(nbytes // 8,), strides=(8,))

N = ("native",)  # Uring: the twin has none (io/threads.py is the other engine)

def ring_or_skip():
    # a ring of 4 entries, or exit after a "skip" line where there is none
    try:
        return IMPLS["native"].Uring(4)
    except (KeyError, OSError) as exc:  # not built; io_uring refused (seccomp)
        print(json.dumps({"skip": f"no io_uring ring here: {exc!r}"}), flush=True)
        sys.exit(0)

tmp = tempfile.NamedTemporaryFile()
tmp.write(os.urandom(8192)); tmp.flush()
FD = tmp.fileno()
"""

# One attack kind per entry point: the calls of its child (``m`` is the module).
CASES: dict[str, str] = {
    "native: xxh3_rows huge nrows": """
        call("empty part, 2**61 rows (nrows * 8 wraps)",
             lambda m: m.xxh3_rows([b""], 2**61), match="rows")
        call("two empty parts, INT64_MAX rows",
             lambda m: m.xxh3_rows([b"", bytearray()], INT64_MAX), match="rows")
        call("one row past the bound",
             lambda m: m.xxh3_rows([b""], INT64_MAX // 1024 + 1), match="rows")
    """,
    "native: pread_rows_xxh3 huge nrows": """
        call("empty part, 2**61 rows (nrows * 8 and the row states wrap)",
             lambda m: m.pread_rows_xxh3(FD, [(0, bytearray())], 2**61),
             match="rows")
        call("empty part, 2**55 rows (only nrows * sizeof(XXH3_state_t) wraps)",
             lambda m: m.pread_rows_xxh3(FD, [(0, bytearray())], 2**55),
             match="rows")
    """,
    "native: pread_layers_xxh3 huge layers x rows": """
        call("4 layers of 2**61 rows (nlayers * nrows * 8 wraps)",
             lambda m: m.pread_layers_xxh3(FD, [[(0, bytearray())]] * 4, 2**61),
             match="layers")
        call("8 layers, rows within the one-layer bound, their product past it",
             lambda m: m.pread_layers_xxh3(
                 FD, [[(0, bytearray())]] * 8, INT64_MAX // 1024 // 8 + 1),
             match="layers * rows")
    """,
    "native: pread_*_xxh3 offset + length past INT64_MAX": """
        call("offset INT64_MAX - 3, 8 bytes",
             lambda m: m.pread_rows_xxh3(FD, [(INT64_MAX - 3, bytearray(8))], 1),
             match="offset + bytes")
        call("second layer's offset wraps",
             lambda m: m.pread_layers_xxh3(
                 FD, [[(0, bytearray(8))], [(INT64_MAX, bytearray(8))]], 1),
             match="offset + bytes")
        call("negative offset",
             lambda m: m.pread_rows_xxh3(FD, [(-1, bytearray(8))], 1),
             match="offset >= 0")
    """,
    "native: page_residency offset + nbytes past INT64_MAX": """
        call("2**62 + 2**62",
             lambda m: m.page_residency(FD, 2**62, 2**62), match="offset + nbytes")
        call("INT64_MAX + 1",
             lambda m: m.page_residency(FD, INT64_MAX, 1), match="offset + nbytes")
        call("negative nbytes",
             lambda m: m.page_residency(FD, 0, -1), match=">= 0")
    """,
    "native: cached_pages offset + nbytes past INT64_MAX": """
        call("a range of 2**62 + 2**62",
             lambda m: m.cached_pages(FD, np.array([0, 4096, 2**62, 2**62], np.int64)),
             match="range 1")
        call("a negative range",
             lambda m: m.cached_pages(FD, np.array([-4096, 4096], np.int64)),
             match="range 0")
    """,
    "native: copy_runs huge counts, offsets and lengths": """
        dst = bytearray(16)
        call("more runs than the bound (as_strided shape)",
             lambda m: m.copy_runs([b"x" * 16], [dst], huge_view(INT64_MAX, 2)),
             match="rows")
        call("offset + nbytes past INT64_MAX",
             lambda m: m.copy_runs([b"x" * 16], [dst],
                                   np.array([[0, INT64_MAX, 0, 0, 1]], np.int64)),
             match="within")
        call("nbytes past the buffer",
             lambda m: m.copy_runs([b"x" * 16], [dst],
                                   np.array([[0, 8, 0, 0, INT64_MAX]], np.int64)),
             match="within")
        call("negative nbytes",
             lambda m: m.copy_runs([b"x" * 16], [dst],
                                   np.array([[0, 0, 0, 0, -1]], np.int64)),
             match=">= 0")
        call("negative index",
             lambda m: m.copy_runs([b"x" * 16], [dst],
                                   np.array([[-1, 0, 0, 0, 1]], np.int64)),
             match="src_index")
        call("negative offset",
             lambda m: m.copy_runs([b"x" * 16], [dst],
                                   np.array([[0, 0, 0, -8, 1]], np.int64)),
             match="within")
        assert dst == bytearray(16), "a refused call moved bytes"
    """,
    "native: copy_ptrs huge counts, addresses and sizes": """
        # (k + 1) * sizeof(nkv_run) wrapped to 8 bytes for this k: heap overflow
        wrap = (2**64 + 8) // 24 - 1
        many = huge_view(wrap * 8)
        call("a run count whose run table size wraps",
             lambda m: m.copy_ptrs(many, many, many), match="runs")
        one = np.array([4096], np.int64)
        call("src + size past INT64_MAX",
             lambda m: m.copy_ptrs(np.array([INT64_MAX - 8], np.int64), one,
                                   np.array([16], np.int64)),
             match="end at or below")
        call("sizes adding up past INT64_MAX",
             lambda m: m.copy_ptrs(np.array([8, 8], np.int64),
                                   np.array([8, 8], np.int64),
                                   np.array([2**62, 2**62], np.int64)),
             match="")
        call("negative size",
             lambda m: m.copy_ptrs(one, one, np.array([-1], np.int64)), match=">= 0")
    """,
    "native: Uring() huge entries": """
        ring = ring_or_skip()
        call("2**62 entries", lambda m: m.Uring(2**62), match="entries", impls=N)
        call("2**70 entries", lambda m: m.Uring(2**70), match="entries", impls=N)
        call("2**32 + 4 entries (past a C int)",
             lambda m: m.Uring(2**32 + 4), match="entries", impls=N)
        call("-1 entries", lambda m: m.Uring(-1), match="entries", impls=N)
    """,
    "native: Uring.reap huge min_complete": """
        ring = ring_or_skip()
        call("reap(-1)", lambda m: ring.reap(-1), match="min_complete", impls=N)
        call("reap(2**62): capped at in flight",
             lambda m: ring.reap(2**62), expect=None, impls=N)
        call("reap(2**80): capped at in flight",
             lambda m: ring.reap(2**80), expect=None, impls=N)
    """,
    "native: Uring.submit counts and offsets": """
        ring = ring_or_skip()
        buf = bytearray(16)
        call("5 requests on a ring of 4",
             lambda m: ring.submit([(0, FD, 0, buf, i) for i in range(5)]),
             match="entries", impls=N)
        call("a vector of IOV_MAX + 1 buffers",
             lambda m: ring.submit([(0, FD, 0, [buf] * 1025, 0)]),
             match="buffers", impls=N)
        call("a vector of 0 buffers",
             lambda m: ring.submit([(0, FD, 0, [], 0)]), match="buffers", impls=N)
        call("a negative offset",
             lambda m: ring.submit([(0, FD, -1, buf, 0)]),
             match="offset >= 0", impls=N)
        assert ring.in_flight == 0, "a refused submit left requests in flight"
    """,
    "native: Uring.register_buffer huge length": """
        ring = ring_or_skip()
        call("a buffer claiming 2**63 - 8 bytes",
             lambda m: ring.register_buffer(huge_view(INT64_MAX)),
             match="bytes", impls=N)
    """,
    "native: parts list mutated during the call": """
        # An offset's __index__ empties the list being parsed: the C side once
        # walked the list itself (PySequence_Fast) and read its freed items.
        class Shrinks:
            def __init__(self, victim): self.victim = victim
            def __index__(self):
                self.victim.clear()
                return 0
        def rows(m):
            parts = [(0, bytearray(8)), (0, bytearray(8))]
            parts[0] = (Shrinks(parts), bytearray(8))
            return m.pread_rows_xxh3(FD, parts, 1)
        def layers(m):
            layers = [[(0, bytearray(8))], [(0, bytearray(8))]]
            layers[0] = [(Shrinks(layers), bytearray(8))]
            return m.pread_layers_xxh3(FD, layers, 1)
        call("pread_rows_xxh3", rows, expect="any")
        call("pread_layers_xxh3", layers, expect="any")
    """,
}


def run_child(body: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    source = PRELUDE + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", source, native_path() or "", str(PACKAGE / "_twin.py")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done, lines


def _last_started(lines: list[dict]) -> str:
    started = [line for line in lines if line.get("started")]
    return f"{started[-1]['impl']}: {started[-1]['label']}" if started else "start-up"


@pytest.mark.parametrize("kind", list(CASES))
def test_entry_points_refuse_sizes_that_overflow(attack, kind):
    with attack(kind):
        done, lines = run_child(CASES[kind])
        skips = [line["skip"] for line in lines if "skip" in line]
        if skips and done.returncode == 0:
            pytest.skip(skips[0])
        if done.returncode >= 0:
            assert done.returncode == 0, done.stderr[-2000:]
            results = [line for line in lines if "raised" in line]
            assert results, "no call ran"
            for result in results:
                what = f"{result['impl']}: {result['label']}"
                if result["expect"] == "any":
                    continue
                assert result["raised"] == result["expect"], (
                    f"{what}: raised {result['raised']} ({result['message']}), "
                    f"expected {result['expect']}"
                )
                assert result["match"] in result["message"], (what, result["message"])
    if done.returncode < 0:
        attack.crashed(
            kind,
            f"child killed by {signal.Signals(-done.returncode).name} during "
            f"{_last_started(lines)}",
        )


# -- build: hardening flags -------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (binutils): cannot read the build")
    return path


def test_the_extension_is_built_hardened(attack):
    """setup.py's flags reached the build: stack canaries
    (-fstack-protector-strong), glibc's checked calls (_FORTIFY_SOURCE),
    a read-only GOT bound at load (-z relro -z now) and, on x86-64, CET
    landing pads (-fcf-protection)."""
    so = native_path()
    if so is None:
        pytest.skip("the C extension is not built")
    nm, readelf = _tool("nm"), _tool("readelf")
    with attack("build: hardening flags"):
        symbols = subprocess.run(
            [nm, "-D", so], capture_output=True, text=True, check=True
        ).stdout
        imported = set(re.findall(r"\bU (\S+?)(?:@\S*)?$", symbols, re.M))
        assert "__stack_chk_fail" in imported, "no stack protector"
        # checksum.c's snprintf into a fixed buffer is checked under fortify
        fortified = [n for n in imported if n.endswith("_chk") and "stack" not in n]
        assert fortified, f"no _FORTIFY_SOURCE call among {sorted(imported)}"
        dynamic = subprocess.run(
            [readelf, "-dW", so], capture_output=True, text=True, check=True
        ).stdout
        assert re.search(r"\(FLAGS\)\s.*\bBIND_NOW\b", dynamic) or re.search(
            r"\(FLAGS_1\)\s.*\bNOW\b", dynamic
        ), "no BIND_NOW (-z now)"
        segments = subprocess.run(
            [readelf, "-lW", so], capture_output=True, text=True, check=True
        ).stdout
        assert "GNU_RELRO" in segments, "no GNU_RELRO segment (-z relro)"
        objdump = shutil.which("objdump")
        if platform.machine() in ("x86_64", "AMD64") and objdump is not None:
            code = subprocess.run(
                [objdump, "-d", "--no-show-raw-insn", so],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
            assert "endbr64" in code, "no CET landing pads (-fcf-protection)"
