"""End to end with the Mooncake Store tier: real vLLM processes (CPU build)
over throwaway mooncake_master processes; greedy tokens must equal a
no-connector baseline whatever the tier holds or does.

    two nodes      B, with an empty cache_dir, loads what A (still alive: its
                   segment holds the values) put
    restarts       a long-lived pool (MooncakePool) holds the values: a
                   restarted process with a wiped cache_dir hits them
    master faults  the master is killed between prompts of one process and
                   restarted: local serving goes on (steps given remote_timeout_ms,
                   the longest one printed), the tier comes back by itself
    namespaces     another model on the same master finds nothing
    corruption     a live value overwritten (same length, one byte flipped)
                   is caught by its checksums and recomputed

Every vLLM run is its own process (bench/harness/runs.py, in-process engine, so
the harness counts the tokens our connector claims), with ``--shutdown`` so
that the connector's close() logs its "longest scheduler step" line. Runs that
must stay alive, or that a test acts in the middle of, pause at gate files
(the harness's ``--pause-after-warmup`` and ``--pause-before``).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.harness import runs
from tests.support.mooncake import MooncakeMaster, MooncakePool, require_mooncake

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (pip install .[vllm])")

pytestmark = pytest.mark.e2e

BLOCK = 32
TIMEOUT_MS = 20.0  # remote_timeout_ms (the default, named in every run)
#: blocks of the harness's warm-up prompt (sent first by every run)
WARMUP_BLOCKS = runs.WARMUP_TOKENS // BLOCK
#: the fault test's prompts: group 1 (master up), group 2 (killed: a local
#: hit, then new prompts), group 3 (restarted)
GROUP1 = ["q0", "q1"]
GROUP2 = ["p1", "q2", "q3", "q4", "q5"]
GROUP3 = [f"q{i}" for i in range(6, 22)]  # room for the breaker's back-off
PACE_S = (0.5, 1.25)  # at most this long between prompts of group 2, group 3
STEP_LINE = re.compile(
    r"the longest scheduler step spent ([\d.]+) ms on its lookups "
    r"\(remote_timeout_ms ([\d.]+)\)"
)
DOWN = "remote tier is down"
BACK = "remote tier is back"


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(23)
    found = {
        "p1": [rng.randrange(3, 2048) for _ in range(201)],
        "p3": [rng.randrange(3, 2048) for _ in range(300)],
        "p5": [rng.randrange(3, 2048) for _ in range(170)],
    }
    for i in range(22):  # short new prompts: 2 full blocks each
        found[f"q{i}"] = [rng.randrange(3, 2048) for _ in range(70)]
    return found


PROMPTS = _prompts()


def _full_hit(name: str) -> int:
    return (len(PROMPTS[name]) - 1) // BLOCK * BLOCK  # the last token is computed


def _blocks(names: list[str]) -> int:
    """Full blocks the harness saves for ``names`` (and its warm-up prompt)."""
    return WARMUP_BLOCKS + sum(len(PROMPTS[n]) // BLOCK for n in names)


def _remote(master: MooncakeMaster, segment: str | int) -> dict[str, Any]:
    return {
        "remote_store": "mooncake",
        "remote_secret_file": master.secret_file,  # the nodes' shared secret
        "mooncake_master": master.address,
        "mooncake_segment_size": segment,
        "remote_timeout_ms": TIMEOUT_MS,
    }


def _problems(log: str) -> list[str]:
    """Our connector's WARNING and ERROR lines in a run's log."""
    return [
        line
        for line in log.splitlines()
        if "npukv_store" in line and (" WARNING " in line or " ERROR " in line)
    ]


def _longest_step_ms(log: str) -> tuple[float, float]:
    """The shutdown line's (longest step ms, remote_timeout_ms)."""
    found = STEP_LINE.findall(log)
    assert len(found) == 1, "no (or more than one) longest-step line in the log"
    return float(found[0][0]), float(found[0][1])


def _stats(cache_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "npukv_store.cli", "stats", "--json", str(cache_dir)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    stats: dict[str, Any] = json.loads(out.stdout)
    return stats


def _verify(cache_dir: Path) -> None:
    verify = subprocess.run(
        [sys.executable, "-m", "npukv_store.cli", "verify", str(cache_dir)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _names(master: MooncakeMaster) -> set[str]:
    """The names of our values the master holds (keyed: ``npukv/<32 hex>``,
    which tell neither the namespace nor the block, format.md 6.1)."""
    return {key for key in master.stored_keys() if key.startswith("npukv/")}


def run(
    work: Path, name: str, names: list[str], *, model: str = "model", **kw: Any
) -> dict[str, Any]:
    """One vLLM process over the named prompts; its report."""
    if kw.get("cache_dir") is not None:
        kw["args"] = ("--shutdown", *kw.get("args", ()))
    prompts = [PROMPTS[n] for n in names]
    return runs.run(work, name, prompts, model=work / model, **kw)


class Gated:
    """A vLLM process that pauses at gate files: after its warm-up (``ready``,
    released by ``go``), before each prompt index of ``pause_before``
    (``before-I``, ``go-I``) and after its prompts (``done``, ``exit``)."""

    def __init__(
        self,
        work: Path,
        name: str,
        names: list[str],
        *,
        model: str = "model",
        pause_before: list[int] | tuple[int, ...] = (),
        **kw: Any,
    ) -> None:
        self.work, self.name = work, name
        self.gate = work / f"{name}.gate"
        self.gate.mkdir()
        args = ["--shutdown", "--pause-after-warmup", str(self.gate)]
        for index in pause_before:
            args += ["--pause-before", str(index)]
        self.proc = runs.start(
            work, name, [PROMPTS[n] for n in names], model=work / model,
            args=tuple(args), **kw,
        )  # fmt: skip

    def log(self) -> str:
        return (self.work / f"{self.name}.log").read_text(errors="replace")

    def wait(self, gate: str, timeout: float = 240.0) -> None:
        """Until the process writes ``gate``; fails if it exits first."""
        deadline = time.monotonic() + timeout
        while not (self.gate / gate).exists():
            if self.proc.poll() is not None:
                pytest.fail(
                    f"vLLM run {self.name} exited ({self.proc.returncode}) before "
                    f"{gate}:\n{self.log()[-6000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM run {self.name}: no {gate} within {timeout:g} s")
            time.sleep(0.02)

    def release(self, gate: str) -> None:
        (self.gate / gate).touch()

    def pace(self, indices: range, done: Callable[[], bool], pace_s: float) -> None:
        """Release the prompts ``indices`` one by one: at most ``pace_s``
        apart, at once when ``done()`` holds (polled meanwhile)."""
        for index in indices:
            self.wait(f"before-{index}")
            deadline = time.monotonic() + pace_s
            while not done() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.release(f"go-{index}")

    def finish(self) -> dict[str, Any]:
        self.release("exit")
        return runs.finish(self.work, self.name, self.proc)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _needs_mooncake() -> None:
    """Before ``work`` builds its model (autouse fixtures come first)."""
    require_mooncake()  # skips cleanly here, fails under CI


@pytest.fixture(scope="module")
def baseline(work: Path) -> dict[str, list[int]]:
    """Every prompt computed from scratch, no connector, no prefix cache."""
    names = list(PROMPTS)
    report = run(work, "baseline", names, args=("--no-prefix-caching",))
    assert all(n == 0 for n in runs.cached(report))
    return dict(zip(names, runs.tokens(report), strict=True))


@pytest.fixture(scope="module")
def node_a(work: Path, baseline: dict[str, list[int]]) -> Iterator[MooncakeMaster]:
    """A master, and node A alive at its ``done`` gate after computing p1 and
    p3 into its own segment (its values vanish when it exits); the master."""
    master = MooncakeMaster(work).start()
    node = Gated(work, "node_a", ["p1", "p3"], cache_dir=work / "cache_a",
                 extra=_remote(master, "256MiB"))  # fmt: skip
    try:
        node.wait("ready")
        node.release("go")
        node.wait("done")
        master.wait_keys_settle(at_least=_blocks(["p1", "p3"]))
        yield master
        report = node.finish()
        assert runs.tokens(report) == [baseline["p1"], baseline["p3"]]
    finally:
        node.kill()
        master.stop()


@pytest.fixture(scope="module")
def pooled(work: Path, baseline: dict[str, list[int]]) -> Iterator[dict[str, Any]]:
    """A master and a MooncakePool; one vLLM process (contributing no
    segment: its values live in the pool) computed p1 and p3 and exited.
    Yields the master, the pool, the process's cache_dir (wiped) and a copy
    of what that held (``stored``)."""
    master = MooncakeMaster(work).start()
    pool = MooncakePool(master, work, segment_size=256 << 20)
    try:
        pool.start()
        cache = work / "cache_restart"
        first = run(work, "restart_1", ["p1", "p3"], cache_dir=cache,
                    extra=_remote(master, 0))  # fmt: skip
        assert runs.tokens(first) == [baseline["p1"], baseline["p3"]]
        assert runs.external(first) == [0, 0]
        master.wait_keys_settle(at_least=_blocks(["p1", "p3"]))
        stored = work / "stored_p1_p3"
        shutil.copytree(cache, stored)
        shutil.rmtree(cache)
        yield {"master": master, "pool": pool, "cache": cache, "stored": stored}
    finally:
        pool.stop()
        master.stop()


# -- tests ----------------------------------------------------------------------------


def test_second_node_loads_what_the_first_put(work, baseline, node_a):
    """B (another process, an empty cache_dir of its own) hits every full
    block A put, loads them from A's segment, and promotes them locally."""
    master = node_a
    keys = master.key_count()
    cache = work / "cache_b"
    report = run(work, "node_b", ["p1", "p3"], cache_dir=cache,
                 extra=_remote(master, "256MiB"))  # fmt: skip
    assert runs.external(report) == [_full_hit("p1"), _full_hit("p3")]
    assert runs.tokens(report) == [baseline["p1"], baseline["p3"]]
    # every block verified and copied: no load failed, nothing recomputed
    assert _problems(report["log"]) == []
    # B computed no full block (all hits), so what its store holds was staged
    # from the remote loads (remote_promote), checksums and all
    assert _stats(cache)["blocks"] == _blocks(["p1", "p3"])
    _verify(cache)
    assert master.key_count() == keys  # B put nothing: the tier had it all


def test_restarted_process_hits_the_pool(work, baseline, pooled):
    """The process that computed the prompts is gone and its cache_dir wiped:
    a new process (same cache_dir path, empty) hits the pool's values."""
    master = pooled["master"]
    report = run(work, "restart_2", ["p1", "p3"], cache_dir=pooled["cache"],
                 extra=_remote(master, 0))  # fmt: skip
    assert runs.external(report) == [_full_hit("p1"), _full_hit("p3")]
    assert runs.tokens(report) == [baseline["p1"], baseline["p3"]]
    assert _problems(report["log"]) == []
    assert pooled["pool"].running


def test_master_killed_and_restarted_mid_run(work, baseline, pooled):
    """One process over three groups of prompts: the master is killed after
    the first (its puts were in), and restarted (same ports, empty) after the
    second, once the tier was seen down. Every answer equals the baseline, the
    local hit of group 2 is served while the master is dead, the steps were
    given remote_timeout_ms, and the tier comes back by itself (one "down"
    line, one "back" line; the new master receives puts again). The longest
    step's time is printed, not bounded: that no step waits for the master
    (each lookup given at most the budget, none on the scheduler's thread)
    is asserted where its calls can be watched, tests/remote/
    test_connector_remote.py."""
    cache = work / "cache_faults"
    shutil.copytree(pooled["stored"], cache)  # p1 is a local hit
    master = MooncakeMaster(work).start()
    names = GROUP1 + GROUP2 + GROUP3
    g2, g3 = len(GROUP1), len(GROUP1) + len(GROUP2)
    node = Gated(work, "faults", names, cache_dir=cache,
                 extra=_remote(master, "64MiB"),
                 pause_before=range(g2, len(names)))  # fmt: skip
    try:
        node.wait("ready")
        node.release("go")
        node.wait(f"before-{g2}")
        master.wait_keys_settle(at_least=2 * len(GROUP1))  # the tier worked
        master.stop()
        node.pace(range(g2, g3), lambda: DOWN in node.log(), PACE_S[0])
        node.wait(f"before-{g3}")
        deadline = time.monotonic() + 10
        while DOWN not in node.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert DOWN in node.log(), "the tier was never seen down"
        master.start()
        restarted = time.monotonic()
        seen: dict[str, float] = {}

        def back() -> bool:
            if "back" not in seen and BACK in node.log():
                seen["back"] = time.monotonic() - restarted
            if "back" in seen and "puts" not in seen and master.key_count() > 0:
                seen["puts"] = time.monotonic() - restarted
            return "puts" in seen

        node.pace(range(g3, len(names)), back, PACE_S[1])
        node.wait("done")
        back()
        assert "back" in seen, "the tier did not come back"
        assert "puts" in seen, "the restarted master received no puts"
        report = node.finish()
    finally:
        node.kill()
        master.stop()
    assert runs.tokens(report) == [baseline[n] for n in names]
    external = runs.external(report)
    assert external[g2] == _full_hit("p1")  # local serving with the master dead
    log = report["log"]
    assert log.count(DOWN) == 1, _problems(log)
    assert log.count(BACK) == 1, _problems(log)
    longest, timeout = _longest_step_ms(log)
    assert timeout == TIMEOUT_MS  # the budget its steps were given
    print(
        f"\nfaults: longest step {longest:.2f} ms (budget {timeout:g}); back "
        f"{seen['back']:.2f} s after the restart, puts in at {seen['puts']:.2f} s"
    )


def test_another_model_on_the_same_master_finds_nothing(work, baseline, node_a):
    """Model 2 (same shape, other weights, other path) after A's model 1 on
    one master, same prompts: no external token, model 2's own answers, and
    the master then holds the two models' values side by side (none of
    model 1's was replaced)."""
    master = node_a
    runs.build_model(work / "model2", args=("--seed", "1"))
    reference = run(work, "baseline_2", ["p1", "p3"], model="model2",
                    args=("--no-prefix-caching",))  # fmt: skip
    before = _names(master)
    assert before
    node = Gated(
        work, "model_2", ["p1", "p3"], model="model2", cache_dir=work / "cache_m2",
        extra=_remote(master, "256MiB"),
    )  # fmt: skip
    try:
        node.wait("ready")
        node.release("go")
        node.wait("done")
        master.wait_keys_settle(at_least=2 * _blocks(["p1", "p3"]))
        both = _names(master)
        report = node.finish()
    finally:
        node.kill()
    assert runs.external(report) == [0, 0]
    assert runs.tokens(report) == runs.tokens(reference)
    # the other weights answer otherwise: model 1's KV would have shown
    assert runs.tokens(reference) != [baseline["p1"], baseline["p3"]]
    assert before < both
    assert len(both - before) >= _blocks(["p1", "p3"])  # model 2's own values


def test_corrupt_remote_value_is_recomputed(work, baseline, pooled):
    """One live value in the pool overwritten with the same bytes but one
    flipped in its last layer's data (only that layer's checksum can tell):
    the next process claims the hit, the load's verification rejects that
    block (one warning naming it), it is recomputed, the answer is right."""
    master = pooled["master"]
    before = set(master.stored_keys())
    blocks = len(PROMPTS["p5"]) // BLOCK
    run(work, "corrupt_put", ["p5"], cache_dir=work / "cache_c1",
        extra=_remote(master, 0))  # fmt: skip
    master.wait_keys_settle(at_least=len(before) + blocks)
    new = sorted(set(master.stored_keys()) - before)
    assert len(new) == blocks  # the warm-up's blocks were in already
    victim = new[0]
    flip = subprocess.run(
        [sys.executable, "-c", FLIP_ONE_BYTE, master.address, victim],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert flip.returncode == 0, flip.stdout + flip.stderr[-3000:]
    cache = work / "cache_c2"
    report = run(work, "corrupt_get", ["p5"], cache_dir=cache,
                 extra=_remote(master, 0))  # fmt: skip
    assert runs.external(report) == [_full_hit("p5")]  # present: claimed
    assert runs.tokens(report) == [baseline["p5"]]
    problems = _problems(report["log"])
    caught = [line for line in problems if f"remote value {victim} is not" in line]
    assert len(caught) == 1, problems
    _verify(cache)  # nothing corrupt was promoted


#: Run as a child (its own Mooncake client, no segment): read one value, flip
#: its last byte, write it back under the same key (upsert), check it reads so.
FLIP_ONE_BYTE = """
import sys
from mooncake.store import MooncakeDistributedStore
master, key = sys.argv[1], sys.argv[2]
client = MooncakeDistributedStore()
assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
value = bytearray(client.get(key))
assert value, f"no value under {key}"
value[-1] ^= 0xFF
assert client.upsert(key, bytes(value)) == 0
assert client.get(key) == bytes(value)
client.close()
"""
