"""The npukv operator CLI against real directories filled through the store:
stats (dead rows, capacity, both text forms), inspect (namespace, chunk, the
old one-argument form), verify (--fast, --fix), rebuild-index, bench, --help
and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npukv_store import KVStore, StoreConfig
from npukv_store.cli import main
from npukv_store.cli import render as cli_render
from npukv_store.store.format_checks import parse_header
from tests.support.blocks import block_tensors, tiny_spec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# Another server: puts tokens [start, stop) into a directory, then exits.
CHILD_PUT = """
import sys
from npukv_store import KVStore, StoreConfig
from tests.support.blocks import block_tensors, tiny_spec
root, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with KVStore(StoreConfig(cache_dir=root), tiny_spec()) as store:
    keys = store.keys_for(range(start, stop))
    store.put(keys, block_tensors(store.spec, keys))
print(store.namespace)
"""


def fill(root, tokens=range(64), **config):
    """Put ``tokens`` in this process; returns (keys, the chunk file)."""
    with KVStore(StoreConfig(cache_dir=root, **config), tiny_spec()) as store:
        keys = store.keys_for(tokens)
        store.put(keys, block_tensors(store.spec, keys))
        chunks = os.path.join(root, store.namespace, "chunks")
    return keys, os.path.join(chunks, os.listdir(chunks)[0])


def fill_in_child(root, start, stop):
    """Put tokens in a process that then exits; returns (its pid, its chunk)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_PUT, root, str(start), str(stop)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    namespace = child.communicate()[0].strip()
    assert child.returncode == 0
    chunks = os.path.join(root, namespace, "chunks")
    (name,) = os.listdir(chunks)
    return child.pid, os.path.join(chunks, name)


def header_of(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        return parse_header(fd, path)
    finally:
        os.close(fd)


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def overlapping(tmp_path):
    """Two chunks with 4 shared keys: a (4 blocks, ours) and b (8 blocks, from
    another server's directory), joined by rebuild-index: b's first 4 rows are
    dead, a won them (first commit wins, rebuilds go oldest first)."""
    root = str(tmp_path / "c")
    keys, chunk_a = fill(root, range(64))
    # the other server shares our keys: its directory starts with our secret
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    shutil.copy2(os.path.join(root, "secret"), other / "secret")
    _, chunk_b = fill_in_child(str(other), 0, 128)
    chunk_b = shutil.copy(chunk_b, os.path.dirname(chunk_a))
    return root, keys, chunk_a, chunk_b


def test_stats_counts_dead_rows_and_rebuild_adopts_chunks(overlapping, capsys):
    root, _, chunk_a, chunk_b = overlapping
    assert main(["rebuild-index", root]) == 0
    assert "2 chunks, 8 blocks" in capsys.readouterr().out
    size_a, size_b = os.path.getsize(chunk_a), os.path.getsize(chunk_b)
    used, dead = size_a + size_b, size_b * 4 // 8
    stats = run_json(capsys, "stats", root, "--capacity", "1MiB")
    assert stats["capacity_bytes"] == 1 << 20
    assert (stats["used_bytes"], stats["dead_bytes"]) == (used, dead)
    assert stats["live_bytes"] == used - dead
    assert stats["fragmentation"] == pytest.approx(dead / used)
    assert (stats["chunks"], stats["blocks"]) == (2, 8)
    assert stats["oldest_ns"] == int(header_of(chunk_a).metadata["npukv_created_ns"])
    assert stats["newest_ns"] == int(header_of(chunk_b).metadata["npukv_created_ns"])
    assert (stats["quarantined_files"], stats["quarantine_dir"]) == (0, None)
    namespace = header_of(chunk_a).namespace
    assert stats["namespaces"] == {
        namespace: {
            "model": "tiny-llama", "dtype": "float16", "block_size": 16,
            "tp_rank": 0, "tp_size": 1, "chunks": 2, "blocks": 8,
            "bytes": used, "dead_bytes": dead,
            "oldest_ns": stats["oldest_ns"], "newest_ns": stats["newest_ns"],
        }
    }  # fmt: skip
    # deprecated aliases: scripts/demo_vllm.py reads them
    assert (stats["num_blocks"], stats["num_chunks"], stats["total_bytes"]) == (
        8,
        2,
        used,
    )
    chunk = run_json(capsys, "inspect", root, chunk_b)
    assert (chunk["live_rows"], chunk["num_blocks"]) == (4, 8)
    assert main(["verify", root]) == 0  # dead rows are space, not damage


@pytest.mark.parametrize("use_rich", [True, False])
def test_stats_text(overlapping, capsys, monkeypatch, use_rich):
    monkeypatch.setattr(cli_render, "USE_RICH", use_rich)
    root, _, chunk_a, chunk_b = overlapping
    assert main(["rebuild-index", root]) == 0
    capsys.readouterr()
    used = os.path.getsize(chunk_a) + os.path.getsize(chunk_b)
    dead = os.path.getsize(chunk_b) // 2
    assert main(["stats", root]) == 0
    out = capsys.readouterr().out
    assert f"({used:,} bytes)" in out
    assert f"({dead:,} bytes)" in out
    assert f"{100 * dead / used:.1f}% of used is dead" in out
    row = next(line for line in out.splitlines() if "tiny-llama" in line)
    assert row.split()[:7] == [
        header_of(chunk_a).namespace[:12], "tiny-llama", "float16", "16", "0/1",
        "2", "8",
    ]  # fmt: skip
    assert all(line == line.rstrip() for line in out.splitlines())


def test_stats_capacity_is_the_servers(tmp_path, capsys):
    root = str(tmp_path / "c")
    KVStore(StoreConfig(cache_dir=root), tiny_spec()).close()  # no commit yet
    assert run_json(capsys, "stats", root)["capacity_bytes"] is None
    assert main(["stats", root]) == 0
    assert "unknown" in capsys.readouterr().out
    fill(root, capacity="64MiB")
    assert run_json(capsys, "stats", root)["capacity_bytes"] == 64 << 20
    assert run_json(capsys, "stats", root, "--capacity", "1GB")["capacity_bytes"] == (
        10**9
    )


def pairs_of(out, title):
    """label -> value of the ``label  value`` lines of section ``title``."""
    lines = out.splitlines()
    start = lines.index(title) + 1
    rows = {}
    for line in lines[start:]:
        if not line.strip():
            break
        label, _, value = line.strip().partition("  ")
        rows[label] = value.strip()
    return rows


def table_rows(out, title):
    """The cells of each row of table ``title`` (headers and rule left out)."""
    lines = out.splitlines()
    start = lines.index(title) + 1
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if set(line.strip()) <= {"─", "-"}:
            continue
        rows.append(line.split())
    return rows


@pytest.mark.parametrize("use_rich", [True, False])
def test_stats_admission_declined_lost_hits_and_per_tenant(
    tmp_path, capsys, monkeypatch, use_rich
):
    """Second sight declines a block the first time a save brings it: stats
    count it (JSON and text); the same block brought again is written and
    counted as a lost hit; another tenant's decline makes a per-tenant table."""
    monkeypatch.setattr(cli_render, "USE_RICH", use_rich)
    root = str(tmp_path / "c")
    config = StoreConfig(cache_dir=root, admission="second_sight")
    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(16))
        assert store.put(keys, block_tensors(store.spec, keys)).stored == 0
    default = "0" * 16
    zero = dict.fromkeys(
        ("admitted_blocks", "declined_blocks", "lost_hit_blocks",
         "wasted_write_blocks", "written_bytes"), 0,
    )  # fmt: skip
    found = run_json(capsys, "stats", root)["admission"]
    assert found["tenants"] == {default: {**zero, "declined_blocks": 1}}
    assert (found["declined_blocks"], found["admitted_blocks"]) == (1, 0)
    assert (found["lost_hit_blocks"], found["written_bytes"]) == (0, 0)
    assert found["ghost_blocks"] == 1
    assert found["budget_left_bytes"] is None
    assert found["auto_choice"] == "second sight"  # no shadow hit yet
    assert main(["stats", root]) == 0
    out = capsys.readouterr().out
    rows = pairs_of(out, "admission")
    assert rows["declined blocks"] == "1"
    assert rows["admitted blocks"] == "0"
    assert rows["auto's choice"] == "second sight"
    assert "write budget left" not in rows
    assert "admission by tenant" not in out  # one tenant

    with KVStore(config, tiny_spec()) as store:
        keys = store.keys_for(range(16))
        assert store.put(keys, block_tensors(store.spec, keys)).stored == 1
        written = store.counters.snapshot()["put_bytes"]
        other = store.tenant("b")
        keys = store.keys_for(range(100, 116))
        assert (
            store.put(keys, block_tensors(store.spec, keys), tenant=other).stored == 0
        )
    found = run_json(capsys, "stats", root)["admission"]
    assert found["tenants"] == {
        default: {**zero, "admitted_blocks": 1, "declined_blocks": 1,
                  "lost_hit_blocks": 1, "written_bytes": written},
        other.hex(): {**zero, "declined_blocks": 1},
    }  # fmt: skip
    assert (found["declined_blocks"], found["lost_hit_blocks"]) == (2, 1)
    assert (found["admitted_blocks"], found["written_bytes"]) == (1, written)
    assert found["ghost_blocks"] == 2  # a written block stays: seen before
    assert main(["stats", root]) == 0
    out = capsys.readouterr().out
    rows = pairs_of(out, "admission")
    assert rows["declined blocks"] == "2"
    assert rows["lost hits (declined, asked again)"] == "1"
    assert rows["written"].endswith(f"({written:,} bytes)")
    by_tenant = {row[0]: row[1:5] for row in table_rows(out, "admission by tenant")}
    assert by_tenant == {
        default: ["1", "1", "1", "0"],
        other.hex(): ["0", "1", "0", "0"],
    }
    assert all(line == line.rstrip() for line in out.splitlines())


def test_stats_admission_counts_writes_evicted_unread(tmp_path, capsys):
    """Blocks written and evicted before any read are wasted writes, counted
    directory-wide; written bytes are the puts' bytes."""
    root = str(tmp_path / "c")
    config = StoreConfig(cache_dir=root, capacity="20KiB", evict_grace_s=0)
    with KVStore(config, tiny_spec()) as store:
        for start in range(0, 400, 100):
            keys = store.keys_for(range(start, start + 16))
            assert store.put(keys, block_tensors(store.spec, keys)).stored == 1
        counters = store.counters.snapshot()
    assert counters["evicted_chunks"] >= 1
    found = run_json(capsys, "stats", root)["admission"]
    assert found["wasted_write_blocks"] == counters["evicted_chunks"]
    assert found["wasted_write_blocks"] == counters["wasted_write_blocks"]
    assert (found["admitted_blocks"], found["declined_blocks"]) == (4, 0)
    assert found["written_bytes"] == counters["put_bytes"]


class FakeAdmissionIndex:
    def __init__(self, hits_all, hits_second_sight, writes_all, budget=None):
        self.state = {
            "shadow_hits_all": hits_all,
            "shadow_hits_second_sight": hits_second_sight,
            "shadow_asks": 400.0,
            "shadow_writes_all": writes_all,
            "shadow_writes_second_sight": 20.0,
            "tables": {"ghost": 42, "processes": 2},
            "budget": budget,
            "tenants": {"0000000000000000": {"declined_blocks": 3}},
        }  # fmt: skip

    def admission_report(self):
        return self.state


@pytest.mark.parametrize(
    ("hits_all", "hits_second_sight", "writes_all", "choice"),
    # write-all only while each write it adds brings over 0.1 hit more
    [(0.0, 0.0, 0.0, "second sight"), (106.0, 100.0, 70.0, "write-all"),
     (105.0, 100.0, 70.0, "second sight"), (50.0, 100.0, 20.0, "second sight")],
)  # fmt: skip
def test_auto_choice_is_write_all_only_by_a_margin(
    hits_all, hits_second_sight, writes_all, choice, capsys, monkeypatch
):
    from npukv_store.cli.reports import admission_report

    monkeypatch.setattr(cli_render, "USE_RICH", False)
    budget = {"tokens_bytes": 3072.5, "updated_ns": 10**18}
    found = admission_report(
        FakeAdmissionIndex(hits_all, hits_second_sight, writes_all, budget)
    )
    assert found["auto_choice"] == choice
    assert (found["ghost_blocks"], found["budget_left_bytes"]) == (42, 3072.5)
    assert found["tenants"]["0000000000000000"]["admitted_blocks"] == 0
    assert found["declined_blocks"] == 3
    sections = cli_render._admission_sections({"admission": found})
    cli_render.emit(sections)
    rows = pairs_of(capsys.readouterr().out, "admission")
    assert rows["auto's choice"] == choice
    assert rows["write budget left"] == "3.00 KiB (3,072 bytes) at 2001-09-09T01:46:40Z"
    assert rows["ghost"] == "42 blocks remembered (scores from 2 processes)"


def test_no_admission_section_until_a_server_keeps_admission_state(tmp_path, capsys):
    """``admission: all`` without a budget keeps nothing: the JSON has the
    zeros, the text no admission section (a fresh directory's stats stay as
    they were)."""
    root = str(tmp_path / "c")
    fill(root, range(32), admission="all")
    found = run_json(capsys, "stats", root)["admission"]
    assert (found["tenants"], found["admitted_blocks"]) == ({}, 0)
    assert main(["stats", root]) == 0
    assert "auto's choice" not in capsys.readouterr().out
    fill(root, range(100, 132))  # auto: counts what it admits
    assert run_json(capsys, "stats", root)["admission"]["admitted_blocks"] == 2
    assert main(["stats", root]) == 0
    assert pairs_of(capsys.readouterr().out, "admission")["admitted blocks"] == "2"


def test_inspect_namespace_and_chunk(tmp_path, capsys):
    root = str(tmp_path / "c")
    keys, chunk = fill(root)
    namespace = header_of(chunk).namespace
    spec = tiny_spec()
    report = run_json(capsys, "inspect", root, namespace[:6].upper())
    assert report["namespace"] == namespace
    assert (report["model"], report["block_size"], report["chunks"]) == (
        "tiny-llama",
        16,
        1,
    )
    assert report["layout"]["layers"] == 3
    assert report["layout"]["block_bytes"] == spec.block_bytes == 3 * 2 * 512
    (group,) = report["layout"]["groups"]
    assert group["row_bytes"] == 1024
    assert [p["name"] for p in group["parts"]] == ["k", "v"]
    assert main(["inspect", root, namespace]) == 0
    assert "block bytes" in capsys.readouterr().out

    report = run_json(capsys, "inspect", root, chunk, "--keys", "2")
    assert report["keys"] == [k.hex() for k in keys[:2]]
    assert (report["live_rows"], report["checksums"]) == (4, [4, 3])
    old_form = run_json(capsys, "inspect", chunk)  # ``npukv inspect CHUNK_FILE``
    assert old_form["keys"][0] == keys[0].hex()
    assert old_form["live_rows"] == 4  # its directory found from its path
    assert main(["inspect", chunk]) == 0
    assert "U64 [4 rows x 3 layers]" in capsys.readouterr().out


def test_inspect_plan_shows_each_route_and_why(tmp_path, capsys):
    """A chunk the page cache holds is read from it; dropped from the cache,
    its first read would go around it (tiny rows: unaligned, so buffered)."""
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    assert "read_plan" not in run_json(capsys, "inspect", root, chunk)
    fd = os.open(chunk, os.O_RDONLY)
    try:
        os.pread(fd, os.fstat(fd).st_size, 0)  # every page in the cache
        warm = run_json(capsys, "inspect", root, chunk, "--plan")["read_plan"]
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = run_json(capsys, "inspect", root, chunk, "--plan")["read_plan"]
    finally:
        os.close(fd)
    assert warm[0].startswith("cached   layers 0-2")
    assert "wholly in the page cache" in warm[0]
    if not any(line.startswith("cached") for line in cold):  # not tmpfs
        assert cold[0].startswith("engine   layers 0-2")
    assert main(["inspect", root, chunk, "--plan"]) == 0
    assert "read plan (first read, now)" in capsys.readouterr().out


def test_verify_fast_skips_data_checksums_only(tmp_path, capsys):
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    start = header_of(chunk).data_start
    with open(chunk, "r+b") as handle:  # flip one bit of row 0, layer 0
        handle.seek(start + 100)
        byte = handle.read(1)[0]
        handle.seek(start + 100)
        handle.write(bytes([byte ^ 0x01]))
    assert main(["verify", root, "--fast"]) == 0
    assert "0 problem(s)" in capsys.readouterr().out
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"chunk {chunk}: row 0 layer 0 checksum", f"1 problem(s) in {root}"]

    with open(chunk, "r+b") as handle:  # a short file: --fast sees that
        handle.truncate(os.path.getsize(chunk) - 8)
    assert main(["verify", root, "--fast"]) == 1
    assert chunk in capsys.readouterr().out


def test_verify_fix_removes_leftovers_of_dead_writers(tmp_path, capsys):
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    dead_pid, foreign = fill_in_child(str(tmp_path / "other"), 64, 128)
    orphan = shutil.copy(foreign, os.path.dirname(chunk))  # its creator is dead
    tmp = os.path.join(root, "tmp", f"{dead_pid}-00ab.tmp")
    Path(tmp).write_bytes(b"half a chunk")
    assert main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert f"orphan chunk {orphan}" in out
    assert f"tmp garbage {tmp}" in out
    assert main(["verify", root, "--fix"]) == 1  # found (and fixed) problems
    assert "fixed: removed 2 crash leftover(s)" in capsys.readouterr().out
    assert not os.path.exists(orphan)
    assert not os.path.exists(tmp)
    assert os.path.exists(chunk)
    assert main(["verify", root]) == 0


def test_verify_fix_quarantines_a_bad_chunk(tmp_path, capsys):
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    with open(chunk, "r+b") as handle:
        handle.seek(header_of(chunk).data_start)
        handle.write(b"\xff" * 8)
    assert main(["verify", root, "--fast", "--fix"]) == 0  # data not read
    capsys.readouterr()
    assert main(["verify", root, "--fix"]) == 1
    out = capsys.readouterr().out
    chunk_name = os.path.basename(chunk).split(".")[0]
    namespace = os.path.basename(os.path.dirname(os.path.dirname(chunk)))
    assert f"fixed: quarantined {namespace}/{chunk_name}" in out
    assert not os.path.exists(chunk)
    assert os.listdir(os.path.join(root, "quarantine")) != []
    assert main(["verify", root]) == 0  # its rows are gone: the rest checks out


def test_stats_inspect_verify_rebuild(tmp_path, capsys):
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    with open(chunk, "r+b") as handle:  # damage one data byte
        handle.seek(header_of(chunk).data_start + 5)
        handle.write(b"\xaa\xbb")
    assert main(["verify", root]) == 1
    assert "checksum" in capsys.readouterr().out
    shutil.rmtree(os.path.join(root, "index"))
    assert main(["rebuild-index", root]) == 0
    assert "1 chunks, 4 blocks" in capsys.readouterr().out
    assert run_json(capsys, "stats", root)["num_blocks"] == 4


@pytest.mark.parametrize(
    "command",
    ["stats", "inspect", "verify", "rebuild-index", "compact", "gc", "bench", None],
)
def test_help_names_exit_codes(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"] if command else ["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes" in out
    assert "2  unusable arguments or directory" in out


def bad_inputs(tmp_path):
    root = str(tmp_path / "c")
    _, chunk = fill(root)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(os.urandom(3000))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    return {
        "missing dir": (["stats", str(tmp_path / "nope")], "no such directory"),
        "a file": (["verify", chunk], "is a file"),
        "no marker": (["stats", str(plain)], "no NPUKV_STORE marker"),
        "no marker rebuild": (["rebuild-index", str(plain)], "no NPUKV_STORE"),
        "bad capacity": (["stats", root, "--capacity", "12XB"], "--capacity"),
        "garbage chunk": (["inspect", root, str(garbage)], "does not fit"),
        "unknown namespace": (["inspect", root, "zz"], "no namespace"),
        "dir alone": (["inspect", root], "expected DIR NAMESPACE|CHUNK_FILE"),
        "compact missing": (["compact", str(tmp_path / "nope")], "no such dir"),
    }


def test_bad_input_is_one_line_on_stderr(tmp_path, capsys):
    for name, (argv, message) in bad_inputs(tmp_path).items():
        capsys.readouterr()
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1, (name, err)
        assert message in err, (name, err)
        assert err.startswith(f"npukv {argv[0]}: ")
