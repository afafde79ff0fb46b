"""The power-loss harness (issue 40): run a workload on a cache directory
mounted through RecordFS, then open every sampled crash state of its log with
a fresh process and count what was lost, served wrong or refused.

    fuse_missing()   - why the harness cannot run here ("" when it can)
    record()         - mount, run workload steps (each a list of concurrent
                       processes), unmount: the log
    check_states()   - every state checked in a fresh process: a Report
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.power import checks, crashstates, workload

ROOT = Path(__file__).resolve().parents[2]
#: every step of a workload and every mount gets this long, then fails
DEADLINE_S = 120
WORKLOAD = "tests.power.workload"


def fuse_missing(workdir: str) -> str:
    """Why RecordFS cannot mount here ("" when it can): tried on an empty
    directory under ``workdir``."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (a container without the FUSE device)"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libfuse3.so.3 missing
        return f"mfusepy unusable ({exc}; pip install mfusepy, apt-get install fuse3)"
    backing = os.path.join(workdir, "probe-backing")
    mountpoint = os.path.join(workdir, "probe-mnt")
    os.makedirs(backing, 0o700, exist_ok=True)
    os.makedirs(mountpoint, 0o700, exist_ok=True)
    try:
        with mounted(backing, mountpoint, os.path.join(workdir, "probe.log")):
            pass
    except RuntimeError as exc:
        return f"cannot mount FUSE here ({exc})"
    return ""


@contextlib.contextmanager
def mounted(backing: str, mountpoint: str, log_path: str) -> Iterator[None]:
    """RecordFS on ``mountpoint`` for the body; unmounted (lazily if it must
    be) and its process gone afterwards, whatever happens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.power.recordfs", backing, mountpoint, log_path],
        cwd=ROOT, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"RecordFS did not mount: {proc.stderr.read().decode()[-2000:]}"
                    if proc.poll() is not None
                    else "RecordFS did not mount in 30 s"
                )
            time.sleep(0.05)
        yield
    finally:
        if os.path.ismount(mountpoint):
            for flag in ("-u", "-uz"):  # lazily if a process still holds it
                done = subprocess.run(
                    ["fusermount3", flag, mountpoint], timeout=30, check=False
                )
                if done.returncode == 0:
                    break
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            subprocess.run(["fusermount3", "-uz", mountpoint], timeout=30, check=False)
        if proc.stderr is not None:
            proc.stderr.close()


def record(
    steps: Sequence[Sequence[tuple[str, ...]]], workdir: str, mutation: str = ""
) -> list[tuple]:
    """Run ``steps`` on a fresh cache directory (the mount's root): each step
    is a list of argument tuples (after CACHE_DIR: tests/power/workload.py),
    one workload process each, run together; the
    next step starts when they have all exited 0. ``mutation``: a sync the
    workload leaves out (tests/power/workload.py MUTABLE). Returns the log."""
    env = dict(os.environ, NPUKV_POWER_MUTATION=mutation)
    backing = os.path.join(workdir, "backing")
    mountpoint = os.path.join(workdir, "mnt")
    log_path = os.path.join(workdir, "log.pkl")
    os.mkdir(backing, 0o700)
    os.mkdir(mountpoint, 0o700)
    unknown = [a[0] for step in steps for a in step if a[0] not in workload.KINDS]
    if unknown:
        raise ValueError(f"workload kinds: found {unknown}, expected {workload.KINDS}")
    with mounted(backing, mountpoint, log_path):
        for step in steps:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", WORKLOAD, mountpoint, *args],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )  # fmt: skip
                for args in step
            ]
            failed = []
            for p in procs:
                try:
                    out, _ = p.communicate(timeout=DEADLINE_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, _ = p.communicate(timeout=30)
                if p.returncode != 0:
                    failed.append(f"rc {p.returncode}: {out.decode()[-3000:]}")
            if failed:
                raise RuntimeError("workload failed: " + "\n".join(failed))
    with open(log_path, "rb") as f:
        return pickle.load(f)


@dataclass
class Report:
    states: int = 0
    by_how: dict[str, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def bad(self) -> int:
        return len(self.lost) + len(self.wrong) + len(self.refused) + len(self.problems)

    def summary(self) -> str:
        lines = [
            f"{self.states} crash states {self.by_how} in {self.seconds:.1f} s: "
            f"{len(self.lost)} lost, {len(self.wrong)} wrong, "
            f"{len(self.refused)} refused, {len(self.problems)} problems"
        ]
        for what in ("lost", "wrong", "refused", "problems"):
            lines += [f"  {what}: {line}" for line in getattr(self, what)[:5]]
        return "\n".join(lines)


def _run_forked(
    log: list[tuple],
    state: crashstates.CrashState,
    before: list[str],
    every: list[str],
    tmp: str,
) -> tuple[int, int]:
    """Fork a fresh process that materialises and checks ``state``; it writes
    its pickled Verdict to a pipe. Returns (pid, read end)."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # 3.12+: fork() in a threaded process
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 0
        try:
            os.close(read_end)
            root = os.path.join(tmp, f"state-{os.getpid()}")
            try:
                crashstates.materialise(crashstates.replay(log, state.kept), root)
                verdict = checks.check_state(root, before, every)
            finally:
                shutil.rmtree(root, ignore_errors=True)
        except BaseException:
            verdict = checks.Verdict(
                refused="the check itself failed: " + traceback.format_exc(limit=6)
            )
        try:
            with os.fdopen(write_end, "wb") as f:
                pickle.dump(verdict, f)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def _collect(pid: int, read_end: int, deadline: float) -> checks.Verdict:
    """The child's verdict; a child past ``deadline`` is killed and counted
    as a refusal."""
    chunks = []
    with os.fdopen(read_end, "rb", buffering=0) as f:
        while True:
            left = deadline - time.monotonic()
            ready = select.select([f], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return checks.Verdict(refused="the check ran past its deadline")
            chunk = f.read(1 << 16)
            if not chunk:  # EOF: the child closed it, exiting
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    raw = b"".join(chunks)
    if not raw:
        return checks.Verdict(refused=f"the checking process died (status {status})")
    return pickle.loads(raw)


def check_states(
    log: list[tuple], states: Sequence[crashstates.CrashState], workers: int = 0
) -> Report:
    """Each state materialised and checked in a fresh (forked) process, up to
    ``workers`` at once (default: one per CPU)."""
    started = time.monotonic()
    marks = [(i, op[1]) for i, op in enumerate(log) if op[0] == "mark"]
    every = [label for _, label in marks]
    report = Report()
    workers = workers or max(1, os.cpu_count() or 1)
    running: dict[int, tuple[crashstates.CrashState, int, float]] = {}
    pending = list(states)[::-1]
    with tempfile.TemporaryDirectory(prefix="npukv-power-") as tmp:
        while pending or running:
            while pending and len(running) < workers:
                state = pending.pop()
                before = [label for i, label in marks if i < state.point]
                pid, read_end = _run_forked(log, state, before, every, tmp)
                running[pid] = (state, read_end, time.monotonic() + DEADLINE_S)
            # the oldest first: its pipe's EOF comes when it exits
            pid = next(iter(running))
            state, read_end, deadline = running.pop(pid)
            verdict = _collect(pid, read_end, deadline)
            where = f"[{state.how} point {state.point}/{len(log)}]"
            report.states += 1
            report.by_how[state.how] = report.by_how.get(state.how, 0) + 1
            report.lost += [f"{where} {x}" for x in verdict.lost]
            report.wrong += [f"{where} {x}" for x in verdict.wrong]
            if verdict.refused:
                report.refused.append(f"{where} {verdict.refused}")
            report.problems += [f"{where} {x}" for x in verdict.problems]
    report.seconds = time.monotonic() - started
    return report


def describe(log: Sequence[tuple]) -> str:
    counts: dict[str, int] = {}
    for op in log:
        counts[op[0]] = counts.get(op[0], 0) + 1
    return f"{len(log)} operations {counts}"
