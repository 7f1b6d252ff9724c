"""Honest packaging: `conveyor[engine]` without the `structured` extra gives an engine, a worker and a CLI
that import and serve, and that refuse a constrained request naming the extra it needs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from conveyor.engine.structured_output.manager import MISSING_EXTRA

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("minimal_install.py")


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def test_the_engine_extra_leaves_xgrammar_to_the_structured_extra_the_refusal_names() -> None:
    extras = _extras()
    assert "xgrammar" not in {r.name for r in extras["engine"]}
    assert "xgrammar" in {r.name for r in extras["structured"]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    match = re.search(r"pip install '(\w+)\[(\w+)\]'", MISSING_EXTRA)
    assert match is not None and match.groups() == (project, "structured"), MISSING_EXTRA


def test_an_engine_install_without_the_structured_extra_imports_serves_and_refuses_constraints(
    demo_model_dir: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(CHILD), str(demo_model_dir)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.splitlines()[-1])
    assert "xgrammar" in seen["blocked"], "the engine extra brings xgrammar in after all"
    assert seen["plain"]["finish_reason"] == "length" and len(seen["plain"]["token_ids"]) == 4
    assert seen["refused"] == {"add_request": MISSING_EXTRA, "grammar_compiler": MISSING_EXTRA,
                               "host_submit": MISSING_EXTRA}
    assert not seen["xgrammar_imported"]
