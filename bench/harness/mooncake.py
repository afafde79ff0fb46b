"""A throwaway Mooncake Store master and pool, for the tier's tests
(tests/remote, tests/e2e/test_remote.py) and its benchmark (bench/remote.py).

    mooncake_unavailable()  why the tier cannot run here (None when it can);
                            tests/support/mooncake.py's require_mooncake()
                            skips a test on it (fails it under CI)
    MooncakeMaster          one mooncake_master process on two free loopback
                            ports; metrics(): key_count(), stored_keys(),
                            capacity_bytes(); kill(), restart() on the same ports
    MooncakePool            a long-lived mooncake_client process that
                            contributes a segment to a master's pool (the
                            values put into it outlive the clients that put them)
    free_ports()            distinct loopback ports free right now

Every process dies with the thread that started it (die_with_parent) and is
SIGKILLed by stop().
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from bench.harness.processes import die_with_parent

WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
HOST = "127.0.0.1"

# The Debian package that ships each shared library store.so links against,
# for the fix named in mooncake_unavailable()'s reason.
_LIB_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libnl-3.so.200": "libnl-3-200",
    "libnl-route-3.so.200": "libnl-route-3-200",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libssl.so.3": "libssl3",
    "libcrypto.so.3": "libssl3",
}

# A proxy from the environment (http_proxy without no_proxy=127.0.0.1) would
# swallow the loopback health check, so the opener ignores proxies.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_master_binary() -> str | None:
    """The mooncake_master next to sys.executable (the venv's bin), else on PATH."""
    # Not resolved: .venv/bin/python is a symlink to the base interpreter,
    # and the wheel installs its entry point beside the link.
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mooncake_master")


def find_client_binary() -> str | None:
    """The mooncake_client (a standalone client contributing a segment) next
    to sys.executable, else on PATH."""
    beside = Path(sys.executable).parent / "mooncake_client"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mooncake_client")


def import_failure_reason(error_text: str) -> str:
    """The one-line reason (with its fix) for a failed `import mooncake.store`,
    given the error it printed."""
    lines = [line.strip() for line in error_text.strip().splitlines() if line]
    last = lines[-1] if lines else "no error output"
    if "No module named 'mooncake" in error_text:
        return (
            f"the Mooncake wheel is not installed ({last}): "
            f"run scripts/setup_env.sh or pip install {WHEEL}"
        )
    for lib, package in _LIB_PACKAGES.items():
        if lib in error_text:
            return (
                f"import mooncake.store needs {lib}, which is missing: "
                f"run scripts/setup_env.sh or apt-get install {package}"
            )
    return f"import mooncake.store failed: {last} (run scripts/setup_env.sh)"


@functools.cache
def mooncake_unavailable() -> str | None:
    """None when mooncake.store imports and mooncake_master is found, else why not."""
    # In a child process: a missing shared library must never take down the
    # caller (pytest's collection, a benchmark), and the child leaves no
    # Mooncake state in this process.
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import mooncake.store"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"could not probe `import mooncake.store`: {error}"
    if probe.returncode != 0:
        return import_failure_reason(probe.stderr)
    if find_master_binary() is None:
        return (
            f"mooncake_master is neither in {Path(sys.executable).parent} nor on "
            f"PATH: run scripts/setup_env.sh or pip install {WHEEL}"
        )
    return None


def free_ports(count: int) -> list[int]:
    """count distinct TCP ports that are free on 127.0.0.1 right now."""
    # All sockets stay bound until every port is picked, so the kernel cannot
    # hand out the same port twice.
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind((HOST, 0))
            ports.append(sock.getsockname()[1])
        return ports


def _port_bindable(port: int) -> bool:
    # SO_REUSEADDR as the master's own listeners use it: a socket in TIME_WAIT
    # does not block the bind, a live listener (say, a master left over) does.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _port_accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


_P = TypeVar("_P", bound="_ChildProcess")


class _ChildProcess:
    """What a Mooncake process has: its Popen, its log, stop() by
    SIGKILL, and the context-manager form (start() on entry)."""

    log_path: Path
    _proc: subprocess.Popen[bytes] | None = None

    def start(self: _P, timeout: float = 10.0) -> _P:
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        """The PID of the running process; None when none runs."""
        return self._proc.pid if self.running and self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """SIGKILL the process and reap it; a no-op when none runs."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(no log: {error})"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self: _P) -> _P:
        return self if self.running else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def secret_file(path: str | os.PathLike[str]) -> str:
    """``path``: 32 random bytes, 0600, made once and published whole by a
    link (several processes may ask at once); the tier's remote_secret_file."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(os.urandom(32))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    return str(path)


class MooncakeMaster(_ChildProcess):
    """One mooncake_master process on 127.0.0.1, logging to log_dir.

    The two ports are picked once, here, and kept across restart() so that
    clients set up against `address` reconnect to the new process.
    """

    START_TIMEOUT = 10.0
    START_ATTEMPTS = 5

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        client_ttl: int = 3,
        default_kv_lease_ttl: int = 1000,
        binary: str | None = None,
    ) -> None:
        picked = free_ports(2)
        self.rpc_port = rpc_port or picked[0]
        self.metrics_port = metrics_port or picked[1]
        self.client_ttl = client_ttl
        self.default_kv_lease_ttl = default_kv_lease_ttl
        self.log_path = Path(log_dir) / f"mooncake_master-{self.rpc_port}.log"
        self._binary = binary or find_master_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # processes launched so far, for tests of restart()

    @property
    def secret_file(self) -> str:
        """The ``remote_secret_file`` its clients share, beside the log, made
        on first use: one trust domain per log directory, so that a master
        started again (or another one) in the same directory serves the
        same key domain, as a restarted master of one cluster does."""
        return secret_file(Path(self.log_path).with_name("tier.secret"))

    def command(self) -> list[str]:
        """The command line start() runs."""
        return [
            str(self._binary),
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            f"--client_ttl={self.client_ttl}",
            f"--default_kv_lease_ttl={self.default_kv_lease_ttl}",
            "--enable_metric_reporting=false",
        ]

    @property
    def address(self) -> str:
        """The master's RPC address, as MooncakeDistributedStore.setup() takes it."""
        return f"{HOST}:{self.rpc_port}"

    def healthy(self) -> bool:
        """Whether GET /health answers 200 within 1 s."""
        url = f"http://{HOST}:{self.metrics_port}/health"
        try:
            with _OPENER.open(url, timeout=1) as response:
                return bool(response.status == 200)
        except (OSError, http.client.HTTPException):
            return False

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus text (GET /metrics) as ``{"name{labels}":
        value}``; OSError when it does not answer."""
        url = f"http://{HOST}:{self.metrics_port}/metrics"
        with _OPENER.open(url, timeout=2) as response:
            text = response.read().decode(errors="replace")
        found = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                found[name] = float(value)
        return found

    def key_count(self) -> int:
        """The objects the master holds (the gauge master_key_count)."""
        return int(self.metrics().get("master_key_count", 0))

    def capacity_bytes(self) -> int:
        """The bytes of every segment mounted with the master, together."""
        return int(
            sum(
                value
                for name, value in self.metrics().items()
                if name.startswith("segment_total_capacity_bytes")
            )
        )

    def stored_keys(self) -> list[str]:
        """Every key the master holds (GET /get_all_keys)."""
        url = f"http://{HOST}:{self.metrics_port}/get_all_keys"
        with _OPENER.open(url, timeout=2) as response:
            text = response.read().decode(errors="replace")
        return [line.strip() for line in text.splitlines() if line.strip()]

    def wait_keys_settle(
        self, *, quiet_s: float = 1.5, timeout: float = 30.0, at_least: int = 1
    ) -> int:
        """Poll key_count() until it has not moved for ``quiet_s`` and is at
        least ``at_least``; returns it (RuntimeError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            count = self.key_count()
            now = time.monotonic()
            if count != last:
                last, since = count, now
            elif count >= at_least and now - since >= quiet_s:
                return count
            time.sleep(0.1)
        raise RuntimeError(
            f"master_key_count did not settle at >= {at_least} within "
            f"{timeout:g} s (last {last})"
        )

    def start(self, timeout: float = START_TIMEOUT) -> MooncakeMaster:
        """Launch the master and wait until it serves; RuntimeError (with the
        log's tail) when it does not within timeout seconds."""
        if self.running:
            raise RuntimeError(f"mooncake_master already runs (pid {self.pid})")
        if self._binary is None:
            raise RuntimeError(mooncake_unavailable() or "mooncake_master not found")
        # A few tries, for a port that the killed process's sockets still hold
        # for a moment (the new master would exit at bind); a master that runs
        # but never turns healthy is not retried.
        for attempt in range(1, self.START_ATTEMPTS + 1):
            problem, retry = self._start_once(timeout)
            if not problem:
                return self
            if not retry or attempt == self.START_ATTEMPTS:
                break
            time.sleep(0.5)
        raise RuntimeError(
            f"mooncake_master on {self.address} did not start: {problem}\n"
            f"--- {self.log_path} (tail)\n{self.log_tail()}"
        )

    def _start_once(self, timeout: float) -> tuple[str, bool]:
        """Launch one process: ("", _) once it serves, else (what went wrong,
        whether another try may help), the process then stopped."""
        busy = [p for p in (self.rpc_port, self.metrics_port) if not _port_bindable(p)]
        if busy:
            return f"port(s) {busy} in use", True
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"=== start {self.starts}: {self._binary}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                code = self._proc.returncode
                self.stop()
                return f"it exited with status {code}", True
            # /health answers before the RPC listener is up (and even when its
            # bind then fails), so wait for both, and for the process to live.
            if self.healthy() and _port_accepts(self.rpc_port) and self.running:
                return "", False
            time.sleep(0.05)
        self.stop()
        return f"no healthy answer within {timeout:g} s", False

    def kill(self) -> None:  # reads better in a fault test: master.kill()
        self.stop()

    def restart(self, timeout: float = START_TIMEOUT) -> MooncakeMaster:
        """stop(), then start() on the same ports. The new master is empty:
        it keeps no objects or mounted segments of the old one."""
        self.stop()
        return self.start(timeout)

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"MooncakeMaster({self.address}, metrics {self.metrics_port}, {state})"


class MooncakePool(_ChildProcess):
    """One mooncake_client process contributing ``segment_size`` bytes to
    ``master``'s pool, logging to log_dir: values put by clients that
    contribute nothing themselves (``mooncake_segment_size: 0``) live here and
    outlive those clients. After a master restart it mounts its segment again
    by itself (wait_mounted())."""

    START_TIMEOUT = 20.0

    def __init__(
        self,
        master: MooncakeMaster,
        log_dir: str | os.PathLike[str],
        *,
        segment_size: int = 256 << 20,
        binary: str | None = None,
    ) -> None:
        self.master = master
        self.segment_size = segment_size
        self.port = free_ports(1)[0]
        self.log_path = Path(log_dir) / f"mooncake_pool-{self.port}.log"
        self._binary = binary or find_client_binary()
        self._proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        """The command line start() runs."""
        return [
            str(self._binary),
            f"-global_segment_size={self.segment_size}",
            f"-master_server_address={self.master.address}",
            "-metadata_server=P2PHANDSHAKE",
            f"-host={HOST}",
            f"-port={self.port}",
            "-protocol=tcp",
        ]

    def start(self, timeout: float = START_TIMEOUT) -> MooncakePool:
        """Launch the client and wait until the master counts its segment;
        RuntimeError (with the log's tail) when it does not within timeout s."""
        if self.running:
            raise RuntimeError(f"mooncake_client already runs (pid {self.pid})")
        if self._binary is None:
            raise RuntimeError(
                f"mooncake_client is neither in {Path(sys.executable).parent} nor "
                f"on PATH: run scripts/setup_env.sh or pip install {WHEEL}"
            )
        before = self.master.capacity_bytes()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        try:
            self._wait_capacity(before + self.segment_size, timeout)
        except RuntimeError:
            self.stop()
            raise
        return self

    def wait_mounted(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the master counts at least this pool's bytes (after a
        master restart the client mounts its segment again by itself)."""
        self._wait_capacity(self.segment_size, timeout)

    def _wait_capacity(self, target: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                code = self._proc.returncode if self._proc else None
                raise RuntimeError(
                    f"mooncake_client exited with status {code}\n"
                    f"--- {self.log_path} (tail)\n{self.log_tail()}"
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                if self.master.capacity_bytes() >= target:
                    return
            time.sleep(0.1)
        raise RuntimeError(
            f"the master did not count mooncake_client's {self.segment_size} B "
            f"segment within {timeout:g} s\n"
            f"--- {self.log_path} (tail)\n{self.log_tail()}"
        )

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"MooncakePool({self.master.address}, {self.segment_size} B, {state})"
