"""The fault suite's accounting: trials and counters per fault kind, the
summary table at the end of the run, and docs/benchmarks/faults.json.

Every test here is marked ``@pytest.mark.fault("<kind>")`` (a kind of
tests/faults/kinds.py) and takes the ``fault`` fixture, a :class:`FaultTrial`
that runs its trials and counts, over all of them:

    wrong_kv_served      reads that returned True with bytes that differ from
                         what was stored (in vLLM: a prompt whose greedy tokens
                         differ from the no-connector baseline)
    durable_blocks_lost  blocks stored before the fault (put returned stored,
                         or put_async + flush and a lookup found them) that do
                         not read back right from a fresh handle after it,
                         where the fault does not destroy that block's own
                         chunk file by design (the test says which blocks)
    process_crashes      a process that died with a code or signal the test
                         did not inject, or a traceback where one clear error
                         line was expected; for the power-loss kinds, a crash
                         state that a fresh process refused to open

and, not a failure, ``crash_states``: the crash states the power-loss kinds
checked (tests/faults/test_power_loss.py), each opened by a fresh process.

A test fails as soon as any of its counters is not 0 (checked right after its
body runs), so the totals of a green run are 0.

Two forms. Each test runs as ``[quick]`` (a few trials, no vLLM; part of the
default run) and as ``[full]`` (more trials; marked ``faults``, so only
``pytest -m faults`` runs it), and the kinds that need real vLLM have only a
``[full]`` form. docs/benchmarks/faults.json is rewritten only by a full run in
which every registered kind ran (``pytest -m faults tests/faults``); any run
also writes its summary to the path in ``NPUKV_FAULTS_JSON`` when that is set.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.faults.kinds import KINDS, register_all

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS_JSON = ROOT / "docs" / "benchmarks" / "faults.json"
COUNTERS = ("wrong_kv_served", "durable_blocks_lost", "process_crashes")


@dataclass
class Tally:
    """One kind's counts in one form (quick or full), over all its tests."""

    trials: int = 0
    crash_states: int = 0  # power-loss crash states checked (not a failure)
    wrong_kv_served: int = 0
    durable_blocks_lost: int = 0
    process_crashes: int = 0
    outcomes: list[str] = field(default_factory=list)

    def result(self) -> str:
        if not self.outcomes:
            return "not run"
        for outcome in ("failed", "xfailed", "skipped", "xpassed"):
            if outcome in self.outcomes:
                return outcome
        return "passed"


#: (kind, form) -> its tally, for the whole session
TALLIES: dict[tuple[str, str], Tally] = {}


class FaultTrial:
    """The ``fault`` fixture: one test's trials and counters (see the module
    docstring). ``full`` is True in the full form."""

    def __init__(self, kind: str, form: str) -> None:
        self.kind = kind
        self.form = form
        self.full = form == "full"
        self.tally = TALLIES.setdefault((kind, form), Tally())
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.problems: list[str] = []
        self.trials_run = 0

    def trials(self, quick: int, full: int) -> Iterator[int]:
        """Trial numbers: ``quick`` of them in the quick form, ``full`` in the
        full one; each one counts as a trial of this kind."""
        for number in range(full if self.full else quick):
            self.trials_run += 1
            self.tally.trials += 1
            yield number

    def _count(self, counter: str, n: int, problem: str) -> None:
        if n:
            self.counts[counter] += n
            setattr(self.tally, counter, getattr(self.tally, counter) + n)
            self.problems.append(f"{counter} += {n}: {problem}")

    def served(
        self, spec: Any, keys: Sequence[bytes], out: dict[str, Any], ok: Sequence[bool]
    ) -> int:
        """Count the hits of one read whose bytes are wrong; returns the hits."""
        from tests.support.blocks import verify_read

        wrong = verify_read(spec, keys, out, ok)
        self._count("wrong_kv_served", len(wrong), "; ".join(wrong[:3]))
        return sum(ok)

    def read_back(self, store: Any, keys: Sequence[bytes]) -> list[bool]:
        """Read ``keys`` into zeroed buffers; counts wrong hits; the bools."""
        from tests.support.blocks import empty_blocks

        keys = list(keys)
        if not keys:
            return []
        out = empty_blocks(store.spec, len(keys))
        ok = list(store.read(keys, out))
        self.served(store.spec, keys, out, ok)
        return ok

    def durable(self, store: Any, keys: Sequence[bytes], where: str = "") -> None:
        """Every one of ``keys`` (stored before the fault, not destroyed by it)
        must read back with its bytes; each that does not is a lost block."""
        keys = list(dict.fromkeys(keys))
        ok = self.read_back(store, keys)
        lost = [k.hex()[:12] for k, hit in zip(keys, ok, strict=True) if not hit]
        self._count(
            "durable_blocks_lost",
            len(lost),
            f"{where} {len(lost)} of {len(keys)} durable blocks miss: {lost[:4]}",
        )

    def wrong(self, n: int, what: str) -> None:
        """Count ``n`` wrong answers found another way (vLLM's tokens)."""
        self._count("wrong_kv_served", n, what)

    def lost(self, n: int, what: str) -> None:
        self._count("durable_blocks_lost", n, what)

    def crashed(self, what: str, n: int = 1) -> None:
        self._count("process_crashes", n, what)

    def checked_states(self, n: int) -> None:
        """``n`` more power-loss crash states checked (the ``crash_states``
        count of this kind; what went wrong in them goes to the counters)."""
        self.tally.crash_states += n

    def process(
        self,
        name: str,
        rc: int | None,
        log: str,
        *,
        expect_rc: int = 0,
        clean: bool | None = None,
    ) -> None:
        """A subprocess ended: a crash unless it exited with ``expect_rc`` and,
        where one clear error is expected (``clean``; by default for the P4
        kinds), printed no traceback. Elsewhere a traceback in a logged
        warning is noise, not a crash: the process went on."""
        if clean is None:
            clean = KINDS[self.kind].promise == "P4"
        if rc != expect_rc:
            self.crashed(f"{name} exited {rc}, expected {expect_rc}: {log[-2000:]}")
        elif clean and "Traceback (most recent call last)" in log:
            start = log.index("Traceback (most recent call last)")
            self.crashed(f"{name} printed a traceback: {log[start : start + 2000]}")

    def verdict(self) -> str | None:
        if any(self.counts.values()):
            return "; ".join(self.problems)
        if self.trials_run == 0:
            return "the test ran no trial (fault.trials was never iterated)"
        return None


def _kind_of(node: Any) -> str | None:
    marker = node.get_closest_marker("fault")
    return None if marker is None else str(marker.args[0])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fault(kind): the fault kind a test checks (tests/faults/kinds.py)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fault" not in metafunc.fixturenames:
        return
    kind = KINDS.get(_kind_of(metafunc.definition) or "")  # None: marked per param
    forms = [pytest.param("full", marks=pytest.mark.faults, id="full")]
    if kind is None or not kind.full_only:
        forms.insert(0, pytest.param("quick", id="quick"))
    metafunc.parametrize("fault_form", forms)


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    for item in items:
        if "fault" not in getattr(item, "fixturenames", ()):
            continue
        kind = _kind_of(item)
        if kind not in KINDS:
            raise pytest.UsageError(
                f"{item.nodeid}: fault kind {kind!r} is not in tests/faults/"
                "kinds.py; expected @pytest.mark.fault(<registered kind>)"
            )


@pytest.fixture
def fault(request: pytest.FixtureRequest, fault_form: str) -> FaultTrial:
    kind = _kind_of(request.node)
    assert kind is not None
    return FaultTrial(kind, fault_form)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    result = yield
    trial = getattr(item, "funcargs", {}).get("fault")
    if isinstance(trial, FaultTrial):
        verdict = trial.verdict()
        if verdict is not None:
            raise AssertionError(f"fault kind {trial.kind}: {verdict}")
    return result


#: nodeid -> (kind, form, outcome): the worst outcome of each test's phases
OUTCOMES: dict[str, tuple[str, str, str]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[Any]:
    report = yield
    kind = _kind_of(item)
    callspec = getattr(item, "callspec", None)
    form = callspec.params.get("fault_form") if callspec is not None else None
    phase_counts = report.when == "call" or report.failed or report.skipped
    if kind is not None and form is not None and phase_counts:
        outcome = report.outcome
        if hasattr(report, "wasxfail"):  # a known issue failed, or did not
            outcome = "xfailed" if report.skipped else "xpassed"
        previous = OUTCOMES.get(item.nodeid)
        if previous is None or previous[2] != "failed":
            OUTCOMES[item.nodeid] = (kind, form, outcome)
    return report


def summary(form: str) -> dict[str, Any]:
    """The faults.json body for ``form``'s tallies."""
    kinds = []
    for name, entry in register_all().items():
        tally = TALLIES.get((name, form), Tally())
        tally.outcomes = [o for k, f, o in OUTCOMES.values() if (k, f) == (name, form)]
        kinds.append(
            {
                "kind": name,
                "promise": entry.promise,
                "fault": entry.fault,
                "expected": entry.expected,
                "trials": tally.trials,
                "crash_states": tally.crash_states,
                "result": tally.result(),
                **{c: getattr(tally, c) for c in COUNTERS},
            }
        )
    return {
        "form": form,
        "fault_kinds": len(KINDS),
        "kinds": kinds,
        "trials": sum(k["trials"] for k in kinds),
        "crash_states": sum(k["crash_states"] for k in kinds),
        # known issues (strict xfails, the fix asked for) keep their own
        # counts in their entries; the totals are those of the promises held
        **{c: sum(k[c] for k in kinds if k["result"] != "xfailed") for c in COUNTERS},
        "kinds_not_run": [
            k["kind"] for k in kinds if k["result"] in ("not run", "skipped")
        ],
        "known_issues": [k["kind"] for k in kinds if k["result"] == "xfailed"],
        "commit": _git_commit(),
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True, timeout=10, check=False,
        )  # fmt: skip
        return out.stdout.strip()
    except OSError:
        return ""


def pytest_terminal_summary(terminalreporter: Any) -> None:
    forms = sorted({f for _, f, _ in OUTCOMES.values()}, key=["quick", "full"].index)
    for form in forms:
        body = summary(form)
        ran = [k for k in body["kinds"] if k["result"] != "not run"]
        if not ran:
            continue
        write = terminalreporter.write_line
        terminalreporter.section(f"fault suite ({form} form)")
        write(f"{'kind':38} {'promise':7} {'trials':>6} {'states':>6}  result")
        for k in ran:
            states = k["crash_states"] or ""  # blank: not a power-loss kind
            write(
                f"{k['kind']:38} {k['promise']:7} {k['trials']:>6} {states:>6}  "
                f"{k['result']}"
            )
        write(
            f"{len(ran)} of {body['fault_kinds']} kinds, {body['trials']} trials, "
            f"{body['crash_states']} crash states: "
            + ", ".join(f"{c} {body[c]}" for c in COUNTERS)
        )
        path = os.environ.get("NPUKV_FAULTS_JSON")
        targets = [Path(path)] if path else []
        if form == "full" and not body["kinds_not_run"]:
            targets.append(DOCS_JSON)
        for target in targets:
            target.write_text(json.dumps(body, indent=1) + "\n")
            write(f"wrote {target}")
