"""Run as a script (`python tests/engine/minimal_install.py MODEL_DIR`): what `pip install 'conveyor[engine]'`
gives, simulated in this environment, then used.

Every installed distribution that the project's base dependencies plus its `engine` extra do not bring in
(transitively, extras and markers included) is made unimportable first: xgrammar (the `structured` extra),
triton, the test tools. Then the engine, the worker and the CLI are imported, a tiny model serves a plain
request, and a constrained one is offered to the engine, its grammar compiler and an EngineHost. Prints one
JSON object with what happened; the test reads it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "conveyor"
EXTRA = "engine"
IMPORTED = ["conveyor.engine", "conveyor.engine.llm_engine", "conveyor.engine.host", "conveyor.worker.model",
            "conveyor.worker.job_runner", "conveyor.cli.main"]


def claimed_requirements() -> list[Requirement]:
    """The base dependencies and the extra's, as pyproject.toml declares them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"][EXTRA]]


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """Canonical names of the installed distributions those requirements bring in, transitively."""
    wanted = list(requirements)
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    while wanted:
        req = wanted.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (a marker excluded it, or another platform's)
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in [*req.extras, ""]):
                wanted.append(dep)
    return names


def block_unclaimed(allowed: set[str]) -> list[str]:
    """Makes every top-level module of an installed distribution outside `allowed` unimportable (None in
    sys.modules: `import` raises ModuleNotFoundError, importlib.util.find_spec answers None)."""
    blocked = []
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in sys.modules or not module.isidentifier():
            continue
        if not {canonicalize_name(d) for d in dists} & allowed:
            sys.modules[module] = None  # type: ignore[assignment]
            blocked.append(module)
    return sorted(blocked)


def refusal(action: object) -> str | None:
    """The ValueError message `action()` raised, or None if it did not raise one."""
    try:
        action()  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)
    return None


def main(model_dir: str) -> None:
    blocked = block_unclaimed(installed_closure(claimed_requirements()) | {PROJECT})
    for name in IMPORTED:
        importlib.import_module(name)
    from conveyor.engine import EngineConfig, EngineHost, LLMEngine, SamplingParams, StructuredOutput

    config = EngineConfig(model=model_dir, device="cpu", attention_backend="torch", num_kv_blocks=32,
                          max_model_len=128)
    engine = LLMEngine(config)
    engine.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({out.request_id: out for out in engine.step()})
    constrained = SamplingParams(max_tokens=4, structured=StructuredOutput(choice=["yes", "no"]))
    refused = {
        "add_request": refusal(lambda: engine.add_request("constrained", [5], constrained)),
        "grammar_compiler": refusal(lambda: engine.grammar_compiler),
    }
    host = EngineHost(engine)
    refused["host_submit"] = refusal(lambda: host.submit("constrained", [5], constrained))
    host.shutdown()
    print(json.dumps({
        "blocked": blocked,
        "plain": {"token_ids": outputs["plain"].token_ids, "finish_reason": outputs["plain"].finish_reason},
        "refused": refused,
        "xgrammar_imported": sys.modules.get("xgrammar") is not None,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
