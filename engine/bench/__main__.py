"""`python -m engine.bench ...` — the same as `conveyor bench ...`."""

from __future__ import annotations

import sys

from engine.bench.cli import main

sys.exit(main())
