"""`python -m bench ...` — the same as `conveyor bench ...`."""

from __future__ import annotations

import sys

from bench.cli import main

sys.exit(main())
