"""matplotlib is the optional `bench` extra: without it `conveyor bench` says which extra to install, in one
line on stderr, and exits 2 before doing any work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conveyor.bench.cli import main


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    out = tmp_path / "run"
    assert main(["--model", "preset:tiny", "--model-cache", str(tmp_path / "models"), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == ""
    assert "matplotlib" in lines[0] and "pip install -e '.[bench]'" in lines[0]
    assert "pip install 'conveyor[bench]'" in lines[0]
    assert not out.exists() and not (tmp_path / "models").exists()  # checked before any work


def test_help_works_without_matplotlib(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0 and "--deadline" in capsys.readouterr().out
