"""The README test borrows the fault suite's private PostgreSQL cluster and redis-server (tests/faults is
not a package: its modules are imported by name, as its own conftest does)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
