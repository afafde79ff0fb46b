"""npukv_store's benchmarks, and the harnesses that tests and benchmarks share.

``python -m bench`` lists the benchmarks, ``python -m bench NAME [--quick]
[--json PATH] ...`` runs one (bench/__main__.py). A benchmark is a module here
with ``add_args(parser)`` and ``run(args) -> Report`` (bench/report.py: one
JSON header, tables, percentiles, GB/s); bench/harness/ holds what tests use
too: a real vLLM run, a served vLLM, the memory connector, tiny models, a
Mooncake master. Not shipped in the wheel: it imports from the repository
root, as ``tests`` does.
"""

from __future__ import annotations

from pathlib import Path

#: The repository root: a child process that imports ``bench`` (a harness run
#: by ``python -m``) needs it on PYTHONPATH.
ROOT = Path(__file__).resolve().parents[1]
