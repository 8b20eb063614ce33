"""``python -m kvik``: the same command as the ``kvik`` console script."""

from __future__ import annotations

import sys

from kvik.cli.main import main

sys.exit(main())
