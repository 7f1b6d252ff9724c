"""The tuner's resume file: every finished run, by configuration, so an interrupted `conveyor tune` keeps
what it measured and a second invocation continues.

`tune-state.json` in the out dir holds the identity of the tuning (the trace's sha256, the parameter list,
the model, the load and the seed) and `runs`: configuration key -> the summaries of its finished repeats
(experiment.run_summary's, one per repeat, in order). A run is saved as soon as it ends; a half-done
configuration keeps its finished repeats. Decisions are not stored: they are derived from the runs again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

STATE_FILE = "tune-state.json"
FORMAT = 1
ELSEWHERE = "use another --out, or --fresh to start over there"


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class TuneState:
    """The finished runs of one tuning; `add_run` writes the file at once (atomically: a tmp file renamed)."""

    def __init__(self, path: Path, identity: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
        self.path = path
        self.identity = identity
        self.runs = runs

    @classmethod
    def open(cls, out_dir: Path, identity: dict[str, Any], fresh: bool) -> TuneState:
        """The state in out_dir when it is of this identity, else a new one. ValueError when out_dir holds
        another tuning (another trace, parameter list, model, load or seed) and `fresh` is not set."""
        path = out_dir / STATE_FILE
        if fresh or not path.is_file():
            return cls(path, identity, {})
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"out: {path} is not a tuning state ({exc}); {ELSEWHERE}") from exc
        if saved.get("format") != FORMAT or not isinstance(saved.get("runs"), dict):
            raise ValueError(f"out: {path} is not a tuning state of this version; {ELSEWHERE}")
        differs = [k for k in sorted({*identity, *saved.get("identity", {})})
                   if _canonical(identity.get(k)) != _canonical(saved.get("identity", {}).get(k))]
        if differs:
            raise ValueError(
                f"out: {out_dir} holds a tuning of another {', '.join(differs)} (the runs there are not "
                f"comparable); {ELSEWHERE}"
            )
        return cls(path, identity, saved["runs"])

    def finished(self, key: str) -> list[dict[str, Any]]:
        return list(self.runs.get(key, []))

    def add_run(self, key: str, summary: dict[str, Any]) -> None:
        self.runs.setdefault(key, []).append(summary)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        document = {"format": FORMAT, "identity": self.identity, "runs": self.runs}
        tmp.write_text(json.dumps(document, indent=1, default=str))
        tmp.replace(self.path)  # a run interrupted while writing leaves the previous file whole


def _canonical(value: Any) -> str:
    """JSON as the file holds it (tuples become lists), for comparing a new identity with a saved one."""
    return json.dumps(value, sort_keys=True, default=str)
