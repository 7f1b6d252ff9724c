"""Conveyor installs as one import package, `conveyor`, beside anything: its wheel holds `conveyor/` alone, no
file of it is another distribution's, and installed (not editable) it serves a job with Hugging Face's
`kernels` (which the newest transformers requires) in the same environment, run from outside the repository.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
import tomllib

from tests.support.live_server import free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[1]
# conveyor.<folder>
FOLDERS = ("api", "bench", "checkpoints", "cli", "core", "engine", "kernels", "migrations", "worker")
START_S = 180.0  # a hang guard for a model load on a busy machine


def source_files() -> list[Path]:
    """What a clean clone holds (and, in a working copy, the files not yet added), the way git sees it."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    return [REPO_ROOT / name for name in listed if name and (REPO_ROOT / name).is_file()]


def test_every_folder_of_the_package_is_listed_in_pyproject_and_nothing_else() -> None:
    """Folders of code and of data files alike: setuptools warns of an unlisted folder it could import."""
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {path.parent.relative_to(REPO_ROOT) for path in source_files()
               if path.relative_to(REPO_ROOT).parts[0] in FOLDERS}
    assert listed == {"conveyor"} | {".".join(("conveyor", *folder.parts)) for folder in folders}


def test_no_module_imports_a_folder_as_a_top_level_package() -> None:
    """Run from the repository root, `import core` would work and then fail wherever Conveyor is installed."""
    found = []
    for path in source_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[0] in FOLDERS]
    assert not found, "\n".join(found)


def test_transformers_carries_no_upper_bound() -> None:
    requirements = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    transformers = next(r for r in requirements if r.startswith("transformers"))
    assert "<" not in transformers and "==" not in transformers, transformers


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources, so that no build output lands in the repository."""
    source = tmp_path_factory.mktemp("source")
    for path in source_files():
        target = source / path.relative_to(REPO_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    return next(out.glob("conveyor-*.whl"))


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_conveyor_alone(wheel: Path) -> None:
    names = wheel_names(wheel)
    with zipfile.ZipFile(wheel) as archive:
        top_level = archive.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode()
    assert top_level.split() == ["conveyor"]
    assert {name.split("/")[0] for name in names} == {"conveyor", wheel.name.split("-py3")[0] + ".dist-info"}
    assert not [name for name in names if name.startswith(("conveyor/tests/", "conveyor/docs/"))]
    # What runs from files rather than imports: the migrations, the console's pages, the C++ kernels' sources,
    # the shipped chat templates.
    assert "conveyor/migrations/script.py.mako" in names
    assert any(name.startswith("conveyor/migrations/versions/0001_") for name in names)
    assert "conveyor/api/console/templates/base.html" in names
    assert "conveyor/kernels/csrc/cpu_kernels.h" in names
    assert "conveyor/checkpoints/chat_templates/chatml-tools.jinja" in names
    assert "conveyor/__main__.py" in names and "conveyor/kernels/__init__.py" not in names


def test_no_file_of_the_wheel_belongs_to_an_installed_distribution(wheel: Path) -> None:
    """Installed in either order, neither overwrites the other: no path is claimed twice. The test
    environment holds the newest transformers, so Hugging Face's `kernels` too."""
    importlib.metadata.version("kernels")  # raises where it is missing: the check would prove nothing
    ours = {name for name in wheel_names(wheel) if not name.startswith("conveyor-")}
    theirs = {str(file) for dist in importlib.metadata.distributions() if dist.metadata["Name"] != "conveyor"
              for file in dist.files or ()}
    assert not ours & theirs, sorted(ours & theirs)[:20]


def test_the_installed_wheel_serves_a_job_beside_hugging_face_kernels(
        wheel: Path, demo_model_dir: Path, tmp_path: Path) -> None:
    """The wheel installed into a folder of its own, ahead of this environment's packages (transformers,
    Hugging Face's `kernels`, torch); `conveyor serve` run from a folder outside the repository."""
    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile",
                                "--disable-pip-version-check", "-q", "--target", str(target), str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(PYTHONPATH=str(target), CONVEYOR_DATA_DIR=str(tmp_path / "data"),
               CONVEYOR_MODEL=str(demo_model_dir), CONVEYOR_NUM_THREADS="1")
    probe = ("import conveyor, kernels, transformers.integrations.hub_kernels; "
             "from kernels import get_kernel; print(conveyor.__file__); print(kernels.__file__)")
    where = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-4000:]
    conveyor_file, kernels_file = map(Path, where.stdout.split())
    assert conveyor_file.is_relative_to(target)
    assert Path(importlib.metadata.distribution("kernels").locate_file("kernels")) == kernels_file.parent

    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor", "serve", "--port", url.rsplit(":", 1)[1]],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _ready(url, proc, log), "the installed conveyor serve to answer", timeout_s=START_S)
        job = httpx.post(f"{url}/v1/jobs", json={"prompt": "Hello", "max_tokens": 4}, timeout=30).json()
        done = httpx.get(f"{url}/v1/jobs/{job['id']}", params={"wait": 60}, timeout=90).json()
        assert (done["status"], done["usage"]["completion_tokens"]) == ("succeeded", 4), done
    finally:
        proc.terminate()
        proc.wait(60)


def _ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
