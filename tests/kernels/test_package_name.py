"""The import name `kernels` is Conveyor's in this environment. Hugging Face publishes a distribution with the
same top-level package (transformers 5.25 requires it); installed beside Conveyor, it is found before the
editable install's finder, so the `conveyor` command and its workers import the wrong `kernels` and fail."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_no_installed_distribution_provides_a_top_level_kernels_package() -> None:
    others = sorted(set(importlib.metadata.packages_distributions().get("kernels", [])) - {"conveyor"})
    assert not others, (
        f"{others} install a top-level package named `kernels`, which shadows Conveyor's (pyproject.toml "
        "keeps transformers below the version that requires Hugging Face's `kernels`)")


def test_kernels_resolves_to_this_repository_outside_it(tmp_path: Path) -> None:
    """As the `conveyor` command sees it: started elsewhere, the repository is not first on sys.path."""
    found = subprocess.run([sys.executable, "-c", "import kernels; print(kernels.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        pytest.fail(f"`import kernels` failed outside the repository:\n{found.stderr[-2000:]}")
    assert Path(found.stdout.strip()).resolve().is_relative_to(REPO_ROOT / "kernels"), found.stdout
