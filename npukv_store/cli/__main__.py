"""``python -m npukv_store.cli``: the ``npukv`` command without its script."""

import sys

from npukv_store.cli import main

sys.exit(main())
