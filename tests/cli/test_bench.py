"""``npukv bench``: a source checkout's ``python -m bench`` with the caller's
arguments and exit code; from an installed wheel, which has no benchmarks, one
line on stderr saying what to run instead (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from npukv_store.cli import bench, main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A working directory outside the repository (no ``bench`` there)."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_the_checkout_is_found():
    """The tests run from a source checkout: its bench/ is the one run."""
    assert bench.checkout_bench() == REPO


@pytest.mark.parametrize("argv", [["bench"], ["bench", "store", "--quick"]])
def test_an_installed_wheel_says_what_to_run_in_one_line(
    argv, tmp_path, elsewhere, monkeypatch, capfd
):
    # what an installed wheel sees: site-packages beside the package, no bench/
    monkeypatch.setattr(bench, "CHECKOUT", tmp_path / "site-packages")
    assert main(argv) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("npukv bench: the benchmarks are not in an installed wheel")
    assert "`python -m bench NAME [args]`" in err


def fake_checkout(root: Path) -> Path:
    """A checkout whose ``python -m bench`` prints its arguments and exits 3."""
    (root / "bench").mkdir(parents=True)
    (root / "setup.cfg").write_text("")
    (root / "bench" / "__init__.py").write_text("")
    (root / "bench" / "__main__.py").write_text(
        "import sys; print(sys.argv[1:]); sys.exit(3)\n"
    )
    return root


def test_a_checkout_runs_python_m_bench_with_the_arguments(
    tmp_path, elsewhere, monkeypatch, capfd
):
    monkeypatch.setattr(bench, "CHECKOUT", fake_checkout(tmp_path / "repo"))
    assert main(["bench", "echo", "--blocks", "7", "--json", "out.json"]) == 3
    assert capfd.readouterr().out.strip() == (
        "['echo', '--blocks', '7', '--json', 'out.json']"
    )
    assert main(["bench"]) == 3  # no NAME: python -m bench alone (its list)
    assert capfd.readouterr().out.strip() == "[]"


def test_an_unknown_benchmark_is_the_bench_packages_answer(elsewhere, capfd):
    """The real checkout's ``python -m bench`` judges the name (exit 2)."""
    assert main(["bench", "nosuch"]) == 2
    out, err = capfd.readouterr()
    assert "nosuch" in out + err
