"""Fabricated GPU-check stages for tests/bench/test_gpu_check.py. Each runs in a spawned process, which
imports this module to find it: it stays light (no torch), so a stage starts in well under a second."""

from __future__ import annotations

import subprocess
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conveyor.bench.gpu_check_stages import Plan


def stage_passes(plan: Plan) -> dict[str, Any]:
    return {"ok": True, "problems": [], "value": 7}


def stage_raises(plan: Plan) -> dict[str, Any]:
    raise RuntimeError("the device fell over")


def stage_check_fails(plan: Plan) -> dict[str, Any]:
    return {"ok": False, "problems": ["hf-cb: 3 of 4 requests completed"]}


def stage_hangs(plan: Plan) -> dict[str, Any]:
    """Starts a helper process (as the service stage starts a server), then never returns."""
    helper = subprocess.Popen(["sleep", "120"])
    (plan.out_dir / "helper.pid").write_text(str(helper.pid))
    time.sleep(120)
    return {"ok": True, "problems": []}
