"""Whether a process that left something behind is still alive.

Runs in: any process. Used to tell a crashed writer's leftovers (tmp files,
orphan chunks, staging rings) from a live writer's work in progress.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host.

    A reused pid reads as alive: its leftovers then wait for an age limit, which
    wastes space for a while but never deletes live work.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True
