"""The benchmarks' one frame (bench/report.py) and ``python -m bench``: every
report opens with the same header, percentiles agree with numpy's, and the
listing finds every benchmark module without importing it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import ROOT, report
from bench.__main__ import benchmarks, main

#: the benchmarks the docs name (README, docs/RESULTS.md)
DOCUMENTED = {
    "store", "io", "index", "vllm", "serve", "remote", "cold_hit", "device_check",
}  # fmt: skip


@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50),
    st.floats(0.0, 1.0),
)
def test_pct_is_numpys_linear_percentile(values, q):
    assert report.pct(values, q) == pytest.approx(
        float(np.percentile(values, q * 100)), rel=1e-9, abs=1e-6
    )


def test_pct_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no values"):
        report.pct([], 0.5)


def test_ratio_and_gbps():
    assert report.ratio(3.0, 2.0) == 1.5
    assert report.ratio(3.0, 0.0) == 0.0  # no baseline measured
    assert report.gbps(2e9, 0.5) == 4.0


def test_every_report_opens_with_the_one_header(tmp_path):
    args = report.parse_args(
        "demo", lambda p: p.add_argument("--n", type=int), ["--quick", "--n", "3"]
    )
    result = report.Report(args)
    result.data["rows"] = [{"n": args.n}]
    result.write_json(tmp_path / "out.json")
    written = json.loads((tmp_path / "out.json").read_text())
    assert list(written)[: len(report.HEADER_KEYS)] == list(report.HEADER_KEYS)
    assert written["bench"] == "demo"
    assert written["quick"] is True
    assert written["argv"] == ["--quick", "--n", "3"]
    assert written["rows"] == [{"n": 3}]


def test_a_benchmark_key_may_not_shadow_the_header():
    result = report.Report(report.parse_args("demo", lambda p: None, []))
    result.data["host"] = "elsewhere"
    with pytest.raises(AssertionError, match="shadow the header"):
        result.json()


def test_table_aligns_columns_and_spans_captions():
    text = report.table(["name", "GB/s"], [["a", "1.5"], ["group"], ["bbb", "10.25"]])
    head, rule, first, caption, last = text.splitlines()
    assert len(rule) == len("name") + 2 + len("10.25")
    assert caption == "group"
    assert first.endswith("  1.5")
    assert last.startswith("bbb")
    assert len(first) == len(last)


def test_the_listing_finds_every_documented_benchmark():
    found = benchmarks()
    assert set(found) >= DOCUMENTED, sorted(DOCUMENTED - set(found))
    assert all(found[name] for name in DOCUMENTED), "a benchmark has no docstring"
    assert "report" not in found
    assert "host" not in found


def test_an_unknown_name_is_one_line_and_exit_2(capsys):
    assert main(["nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "found 'nosuch', expected one of:" in err


def test_python_m_bench_lists_them_from_the_repository_root():
    listed = subprocess.run(
        [sys.executable, "-m", "bench"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    for name in DOCUMENTED:
        assert f"  {name} " in listed.stdout
