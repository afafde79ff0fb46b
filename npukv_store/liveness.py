"""Whether a process that left something behind is still alive.

Runs in: any process. Used to tell a crashed writer's leftovers (tmp files,
orphan chunks, staging rings, save claims) from a live writer's work in
progress.

    pid_alive(pid)  - whether ``pid`` is a live process; total: never raises
    safe_pid(value) - a pid read from a file, a file name or a record, bounded,
                      or None when it cannot be a pid

Every pid here comes from something another process wrote (a ring header, a
tmp file's name, a claim record, a chunk's creator), so it is untrusted: a
co-tenant can write 2**32 - 1 or a 5000-digit name, and ``os.kill`` raises
OverflowError for pids >= 2**31. Such values are "not a live pid", which
makes the thing they guard a leftover, never a crash.
"""

from __future__ import annotations

import os

#: Largest pid Linux can hand out: pid_max is at most PID_MAX_LIMIT = 2**22
#: (4194304) on 64-bit kernels, and pids are below pid_max.
PID_MAX = 1 << 22
#: Digits of the longest pid text parsed: more than PID_MAX needs, few enough
#: that int() never meets its digit limit or builds a huge number.
_PID_DIGITS = 10


def safe_pid(value: object) -> int | None:
    """``value`` as a pid in ``1..PID_MAX``, or None.

    Accepts an int (not a bool) or the ASCII decimal text of one (str or
    bytes: no sign, spaces, underscores or other digits, at most 10 digits),
    as written by ``str(os.getpid())``.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        # int() alone would take " 12", "1_2", "+12" and non-ASCII digits, and
        # raise on 5000 digits: only what str(os.getpid()) writes is a pid.
        if not (0 < len(value) <= _PID_DIGITS and value.isascii() and value.isdigit()):
            return None
        value = int(value)
    if not isinstance(value, int):
        return None
    return value if 1 <= value <= PID_MAX else None


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host. Never raises.

    A pid out of ``1..PID_MAX`` (0 and negatives name process groups to
    ``kill``; 2**31 and up overflow it) is no process: False. A reused pid
    reads as alive: its leftovers then wait for an age limit, which wastes
    space for a while but never deletes live work.
    """
    if safe_pid(pid) is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    except (OSError, OverflowError, ValueError):
        # Cannot tell: alive is the answer that never deletes live work.
        return True
    return True
