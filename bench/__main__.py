"""`python -m conveyor.bench ...` — the same as `conveyor bench ...`."""

from __future__ import annotations

import sys

from conveyor.bench.cli import main

sys.exit(main())
