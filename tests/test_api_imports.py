"""The API process loads no torch: `conveyor api` is run for real in a fresh interpreter, up to the moment it
would start serving (uvicorn.run is replaced by a probe), and the heavy modules loaded by then are listed.
Once more as in the API image, which has no torch installed (`import torch` fails): it serves all the same.

The API image is small and starts in seconds only if nothing on this path pulls in torch, triton, the
engine or the worker (import-linter checks the imports statically; this checks what actually loads,
third-party libraries included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conveyor.core.store.migrate import upgrade

REPO_ROOT = Path(__file__).resolve().parents[1]
REDIS_SERVER = os.environ.get("CONVEYOR_TEST_REDIS", "redis://127.0.0.1:6379")  # as tests/conftest.py
HEAVY = ("torch", "triton", "celery", "conveyor.engine", "conveyor.kernels", "conveyor.worker",
         "conveyor.bench")

# Runs `conveyor api` through the CLI; records the heavy modules after the CLI's own imports, just before
# the prompt tokenizer is built (every import of the command and of conveyor.api.app done by then), and when
# the built app would be served.
PROBE = f"""
import json, sys
heavy = lambda: [name for name in {HEAVY!r} if sys.modules.get(name) is not None]
report = {{}}
import uvicorn
import conveyor.api.prompt_tokenizer as prompt_tokenizer
def serve(app, **_options):
    report["served"] = type(app).__name__
    report["serving"] = heavy()
uvicorn.run = serve
build_tokenizer = prompt_tokenizer.PromptTokenizer.__init__
def before_tokenizer(self, *given):
    report["before_tokenizer"] = heavy()
    build_tokenizer(self, *given)
prompt_tokenizer.PromptTokenizer.__init__ = before_tokenizer
from conveyor.cli.main import app
report["cli_imported"] = heavy()
report["exit"] = app(["api"], prog_name="conveyor", standalone_mode=False)
print(json.dumps(report))
"""


# What the API image is: no torch to import (a None entry in sys.modules makes `import torch` fail, as a
# missing package does, and transformers then runs without it).
WITHOUT_TORCH = "import sys; sys.modules['torch'] = None\n"


@pytest.fixture(scope="module")
def api_process(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_api(demo_model_dir, tmp_path_factory, PROBE)


@pytest.fixture(scope="module")
def api_process_without_torch(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                              ) -> dict[str, Any]:
    return _run_api(demo_model_dir, tmp_path_factory, WITHOUT_TORCH + PROBE)


def _run_api(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, probe: str) -> dict[str, Any]:
    data = tmp_path_factory.mktemp("api-imports")
    database_url = f"sqlite:///{data / 'conveyor.db'}"
    upgrade(database_url)  # the command's preflight refuses an unmigrated database
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATABASE_URL=database_url, CONVEYOR_DATA_DIR=str(data),
               CONVEYOR_BROKER_URL=f"{REDIS_SERVER}/15", CONVEYOR_MODEL=str(demo_model_dir),
               PYTHONPATH=str(REPO_ROOT))  # the preflight pings the broker; the app never starts
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.get("served") == "FastAPI", (report, done.stderr[-4000:])  # it got as far as serving
    return report


def test_conveyor_api_imports_no_torch_engine_or_worker(api_process: dict[str, Any]) -> None:
    assert api_process["cli_imported"] == []
    assert api_process["before_tokenizer"] == []


def test_conveyor_api_serves_in_the_api_image_without_torch(api_process_without_torch: dict[str, Any]
                                                            ) -> None:
    """Where torch is installed, transformers imports it while building the prompt tokenizer (transformers 5:
    configuration_utils -> modeling_rope_utils); the API image installs none, and the API needs none."""
    assert api_process_without_torch["serving"] == []
