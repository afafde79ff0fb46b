"""``python -m bench peers``'s pure parts (bench/peers.py): the ratios, the
verdicts of its behaviour rows, the targets and the keys its JSON carries. No
vLLM, no timing."""

from __future__ import annotations

import argparse

from bench import peers
from bench.harness import peers as hp
from bench.report import Report

NONE = [[1, 2, 3], [4, 5, 6]]


def _report(tokens, loaded, error=None):
    if error:
        return {"error": error}
    return {
        "results": [
            {"tokens": t, "loaded_tokens": n, "ttft_s": 0.1}
            for t, n in zip(tokens, loaded, strict=True)
        ]
    }


def test_ratios_are_ours_over_each_peer_and_none_where_unmeasured():
    got = peers.ratios({"npukv": 100.0, "lmcache": 250.0, "example": 80.0, "x": None})
    assert got == {
        "ours_over_lmcache": 0.4,
        "ours_over_example": 1.25,
        "ours_over_x": None,
    }
    assert peers.ratios({"npukv": None, "example": 80.0}) == {"ours_over_example": None}


def test_spread_is_median_min_max_of_the_runs():
    assert peers.spread([3.0, 1.0, 2.0]) == {
        "median": 2.0, "min": 1.0, "max": 3.0, "runs": [3.0, 1.0, 2.0],
    }  # fmt: skip
    assert peers.spread([])["median"] is None


def test_bounded_needs_a_capacity_and_disk_under_twice_it():
    mib = 1 << 20
    assert peers.bounded_verdict(30 * mib, None, 48 * mib)["status"] == "fail"
    assert peers.bounded_verdict(17 * mib, 16 * mib, 48 * mib)["status"] == "pass"
    assert peers.bounded_verdict(40 * mib, 16 * mib, 48 * mib)["status"] == "fail"


def test_corrupt_passes_only_with_equal_tokens_from_a_process_that_ran():
    # a claim at scheduling that the worker then refused: tokens say recomputed
    claimed = peers.corrupt_verdict(_report(NONE, [960, 960]), NONE, 1920)
    assert claimed["status"] == "pass"
    assert "1920 of 1920" in claimed["reason"]
    wrong = peers.corrupt_verdict(_report([[9, 9, 9], [4, 5, 6]], [0, 0]), NONE, 1920)
    assert wrong["status"] == "fail"
    crashed = peers.corrupt_verdict(_report([], [], error="rc 1"), NONE, 1920)
    assert crashed["status"] == "fail"


def test_verdict_and_targets():
    assert peers.verdict(None, "why")["status"] == "skipped"
    rows = {
        "npukv": {
            "tokens_equal_none": True,
            "restart": peers.verdict(True, ""), "bounded": peers.verdict(True, ""),
            "kill9": peers.verdict(None, ""), "corrupt": peers.verdict(False, ""),
        }
    }  # fmt: skip
    got = peers.targets(rows, {"ours_over_lmcache": 0.7, "ours_over_example": 0.9})
    assert got["ttft_vs_lmcache"]["met"] is False
    assert got["ttft_vs_example"]["met"] is True
    assert got["restart"]["met"] is True
    assert got["kill9"]["met"] is None
    assert got["corrupt"]["met"] is False
    assert got["tokens_equal_none"]["met"] is True


def test_fs_tier_rows_from_a_direct_drive():
    found = {
        "load_equal": True, "corrupt_load": "loaded without an error",
        "corrupt_bytes_differ": True, "disk_bytes_one_round": 1 << 20,
        "disk_bytes_after_3x_more": 4 << 20, "fsync_calls_in_io_py": 0,
    }  # fmt: skip
    rows = peers.fs_tier_rows(found)
    assert [rows[b]["status"] for b in peers.BEHAVIOURS] == [
        "pass", "fail", "skipped", "fail",
    ]  # fmt: skip
    assert set(peers.fs_tier_rows({"error": "x"})) == set(peers.BEHAVIOURS)


def test_the_report_carries_the_keys_the_docs_name(tmp_path):
    args = argparse.Namespace(bench="peers", argv=["--quick"], quick=True)
    report = Report(args)
    row = {
        "ttft_hit_ms": 1.0, "ttft_hit_warm_ms": 1.0, "tokens_loaded": 960,
        "tokens_equal_none": True, "disk_bytes": 1,
        **{b: peers.verdict(True, "") for b in peers.BEHAVIOURS},
    }  # fmt: skip
    report.data.update(peers={"npukv": row}, **peers.ratios({"npukv": 1.0}))
    keys = set(report.json()["peers"]["npukv"])
    assert {
        "ttft_hit_ms", "ttft_hit_warm_ms", "tokens_loaded", "tokens_equal_none",
        "disk_bytes", "restart", "bounded", "kill9", "corrupt",
    } <= keys  # fmt: skip


def test_corrupt_damages_the_largest_data_file_in_place(tmp_path):
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "data.mdb").write_bytes(b"i" * 10_000)
    (tmp_path / "small.bin").write_bytes(b"s" * 100)
    chunk = tmp_path / "chunk.bin"
    chunk.write_bytes(bytes(1000))
    assert hp.largest_data_file(tmp_path) == chunk
    offset, length = hp.corrupt(chunk)
    data = chunk.read_bytes()
    assert len(data) == 1000
    assert data[offset : offset + length] == b"\x7f" * length
    assert data[:offset] == bytes(offset)


def test_fs_tier_vs_ours_ratios_and_empty_without_ours():
    found = {
        "blocks": 15, "block_bytes": 1 << 19, "load_cold_s": 0.010,
        "load_warm_s": 0.002, "disk_bytes_after_3x_more": 30 << 20,
        "corrupt_load": "loaded without an error", "corrupt_bytes_differ": True,
        "ours": {
            "load_cold_s": 0.005, "load_warm_s": 0.004, "capacity_bytes": 15 << 19,
            "disk_bytes_after_3x_more": 8 << 20, "corrupt_blocks_refused": 14,
            "corrupt_blocks_loaded": 1, "corrupt_loaded_equal": True,
        },
    }  # fmt: skip
    got = peers.fs_tier_vs_ours(found)
    assert got["ours_over_fs_cold"] == 0.5
    assert got["ours_over_fs_warm"] == 2.0
    assert got["fs_disk_mib_after_3x"] == 30.0
    assert "damaged bytes loaded" in got["fs_corrupt"]
    assert peers.fs_tier_vs_ours({"error": "x"}) == {}
