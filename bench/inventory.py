"""The inventory recorded with every result: software version and commit, model and its config hash,
hardware, memory, torch version, and every engine and queue parameter."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from conveyor.engine.cpu_threads import ThreadChoice, cpu_budget

CHECKOUT = Path(__file__).resolve().parents[1]  # bench/inventory.py -> the repository root


def inventory(model_path: str | None, params: dict[str, Any],
              thread_choice: ThreadChoice | None = None) -> dict[str, Any]:
    return {
        "conveyor_version": _version(),
        "git_commit": _git_commit(),
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": _model(model_path),
        "device": _device(),
        "memory_bytes": _memory_bytes(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_threads": _cpu_threads(thread_choice),
        "torch_version": torch.__version__,
        "transformers_version": _package_version("transformers"),
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "parameters": params,
    }


def _cpu_threads(choice: ThreadChoice | None) -> dict[str, Any]:
    """The CPUs this process may use, and the measured thread choice (None: --threads, --set num_threads, a
    GPU or the HTTP target, where nothing was measured)."""
    budget = cpu_budget()
    return {
        "available_cpus": budget.available,
        "affinity_cpus": budget.affinity_cpus,
        "cgroup_quota_cpus": budget.cgroup_quota,
        "choice": None if choice is None else {
            "threads": choice.threads,
            "reason": choice.reason,
            "timings_ms": {str(n): round(ms, 4) for n, ms in sorted(choice.timings_ms.items())},
        },
    }


def _version() -> str | None:
    """The installed package's version, else the one in the checkout's pyproject.toml."""
    installed = _package_version("conveyor")
    if installed is not None:
        return installed
    pyproject = CHECKOUT / "pyproject.toml"
    if not pyproject.is_file():
        return None
    found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
    return found.group(1) if found else None


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(CHECKOUT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(CHECKOUT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _model(model_path: str | None) -> dict[str, Any]:
    if model_path is None:
        return {"path": None}
    config = Path(model_path) / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"path": str(Path(model_path).resolve()), "config_sha256": digest}


def _device() -> dict[str, Any]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return {"type": "cuda", "name": props.name, "memory_bytes": props.total_memory}
    return {"type": "cpu", "name": _cpu_name() or platform.processor() or platform.machine()}


def _cpu_name() -> str | None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def _memory_bytes() -> int | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None
