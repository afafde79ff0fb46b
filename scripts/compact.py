#!/usr/bin/env python3
"""The maintenance job of an npukv cache directory, safe while servers run.

    scripts/compact.py CACHE_DIR [--dry-run] [--target FRACTION]
                       [--min-live FRACTION] [--verify] [--json] [--as-owner]

Run as root, it refuses a directory root does not own; ``--as-owner`` makes
it the directory's owner (uid and gid) before it touches anything.

A thin shim over :mod:`npukv_store.maintenance` (``npukv compact`` is the same);
``--help`` lists every option and the exit codes (0 clean, 1 problems found and
fixed, 2 unusable arguments or directory).
"""

from __future__ import annotations

import sys

from npukv_store.cli.compact import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="compact.py"))
