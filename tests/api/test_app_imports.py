"""The API process stands on the core alone: importing its application module loads no torch, no engine,
no worker and no Celery (import-linter checks the same statically in `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "triton", "celery", "conveyor.engine", "conveyor.kernels", "conveyor.worker",
         "conveyor.bench", "conveyor.cli")


def test_importing_the_api_app_leaves_torch_the_engine_and_the_worker_unloaded() -> None:
    probe = (
        "import json, sys; import conveyor.api.app; "
        f"print(json.dumps([name for name in {HEAVY!r} if name in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
