"""The first-hour steps of the README and of the pages that promise to run are run as written on a fresh copy
of the repository, so the documentation cannot drift from the code: the README's Quickstart (`make serve`: a
new .venv, then the embedded service), its curl session and its `make docs`, the engine example
(docs/guides/engine.md), Ctrl-C, and docs/getting-started/postgres-redis.md on a PostgreSQL cluster and a
redis-server of the test's own, from createuser to a finished job. The other pages say why their blocks are
not run (tests/docs/test_site.py).
`make test`, the Quickstart's other command, is what CI runs (`.ci/run`).

The blocks run exactly as the README prints them, except for ports: the test's servers listen on free ports
(the machine's own PostgreSQL, Redis and port 8000 may be busy), so `:8000`, `:5432` and `:6379` are replaced
by those ports (and PGPORT set for createuser/createdb) before a block runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.support.doc_pages import ENGINE_PAGE, POSTGRES_REDIS_PAGE
from tests.support.fault_servers import FaultPostgres, FaultRedis, find_postgres_bin
from tests.support.live_server import free_port

pytestmark = pytest.mark.readme

REPO_ROOT = Path(__file__).resolve().parents[2]
# A new .venv (pip), the CPU kernels, and SmolLM2-135M-Instruct converted from its GGUF file (under a minute
# quiet), on a loaded 2-core machine.
SETUP_AND_START_S = 720.0
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"  # what `make serve` serves with no model configured
CONVERTED = "data/models/gguf"  # where the first start converts its GGUF file (data_dir/models)
# This machine's pip configuration names package folders that are absent: pip's complaint is about the
# machine, not the project, and no user of the README sees it.
MACHINE_PIP_NOISE = re.compile(r"^WARNING: Location 'file://\S+' is ignored: it is neither a file nor")
ALARMS = re.compile(r"Traceback|Warning|WARNING|deprecat|\*\*\*|Terminated|Interrupt|Error", re.IGNORECASE)


README = "README.md"


def doc_blocks(path: str, section: str | None = None) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of a Markdown file, or of its `## {section}` part only."""
    body = (REPO_ROOT / path).read_text()
    if section is not None:
        start = body.index(f"\n## {section}\n")
        end = body.find("\n## ", start + 1)
        body = body[start:end if end != -1 else len(body)]
    return re.findall(r"^```(\w+)\n(.*?)^```$", body, flags=re.MULTILINE | re.DOTALL)


def only_block(path: str, section: str | None, language: str) -> str:
    blocks = [code for lang, code in doc_blocks(path, section) if lang == language]
    assert len(blocks) == 1, f"{path} {section or ''}: expected one {language} block, found {len(blocks)}"
    return blocks[0]


def commands(block: str) -> list[str]:
    """The block's command lines, comments and blank lines dropped."""
    lines = (line.split("  #")[0].strip() for line in block.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def with_ports(block: str, ports: dict[int, int]) -> str:
    for usual, ours in ports.items():
        block = re.sub(rf":{usual}\b", f":{ours}", block)
    return block


def alarms(output: str) -> list[str]:
    return [line for line in output.splitlines() if ALARMS.search(line) and not MACHINE_PIP_NOISE.match(line)]


def converted_folders(root: Path) -> list[Path]:
    """The folders the default model's GGUF file was converted into under `root` (their lock files aside)."""
    return sorted(p for p in (root / CONVERTED).glob(f"{DEFAULT_MODEL_ID}*") if p.is_dir())


def clean_env(**extra: str) -> dict[str, str]:
    """The environment a newcomer's shell has: none of a developer's (or the suite's) CONVEYOR_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONVEYOR_", "VIRTUAL_ENV", "PYTHON"))}
    return {**env, **extra}


def run_bash(script: str, cwd: Path, env: dict[str, str], timeout_s: float
             ) -> subprocess.CompletedProcess[str]:
    """Runs a README block in a new session under `set -euo pipefail`; its `&` servers are killed with the
    session once the block's last command is done. Output goes to a file: those servers would hold a pipe
    open after the block ends."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out.seek(0)
            pytest.fail(f"the README block did not finish within {timeout_s:.0f} s:\n{out.read()[-4000:]}")
        finally:
            _kill_group(proc.pid)
        out.seek(0)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), "")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


@dataclass
class Served:
    """`make serve` running in the fresh copy."""

    root: Path
    port: int
    proc: subprocess.Popen[str]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def fresh_copy() -> Iterator[Path]:
    """The repository as a clone would have it (tracked and not-ignored files), without .venv or data/."""
    root = Path(tempfile.mkdtemp(prefix="conveyor-readme-"))
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def served(fresh_copy: Path) -> Iterator[Served]:
    assert commands(only_block(README, "Quickstart", "bash")) == ["make serve", "make test"]
    port = free_port()
    log = fresh_copy / "make-serve.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(["make", "serve"], cwd=fresh_copy, env=clean_env(CONVEYOR_PORT=str(port)),
                                stdout=sink, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    served = Served(fresh_copy, port, proc, log)
    try:
        _wait_ready(served)
        yield served
    finally:
        _kill_group(proc.pid)


def _wait_ready(served: Served) -> None:
    deadline = time.monotonic() + SETUP_AND_START_S
    while time.monotonic() < deadline:
        assert served.proc.poll() is None, f"make serve exited {served.proc.returncode}:\n{served.output()}"
        try:
            if httpx.get(f"http://127.0.0.1:{served.port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"make serve was not ready within {SETUP_AND_START_S:.0f} s:\n{served.output()[-4000:]}")


def test_ci_runs_the_quickstart_test_command() -> None:
    assert commands(only_block(README, "Quickstart", "bash"))[1] == "make test"
    assert re.search(r"^make test$", (REPO_ROOT / ".ci/run").read_text(), flags=re.MULTILINE)


def test_make_serve_sets_up_without_triton_and_starts_quietly(served: Served) -> None:
    site = next((served.root / ".venv/lib").glob("python3*/site-packages"))
    assert (site / "torch").is_dir(), "make serve should install torch"
    assert not (site / "triton").exists(), "make serve should not install triton"
    output = served.output()
    assert not alarms(output), "make serve printed alarms:\n" + "\n".join(alarms(output))
    assert f"http://127.0.0.1:{served.port}" in output, f"the start should say where it listens:\n{output}"
    start = [line for line in output.splitlines() if f"starting on http://127.0.0.1:{served.port}" in line]
    assert start and DEFAULT_MODEL_ID in start[0], f"the start should name {DEFAULT_MODEL_ID}:\n{output}"
    converted = converted_folders(served.root)
    assert len(converted) == 1, f"the first start should convert the GGUF file once into {CONVERTED}"
    files = sorted(p.name for p in converted[0].iterdir())
    assert {"config.json", "model.safetensors"} <= set(files), f"{converted[0]} is not whole: {files}"


def test_curl_session_runs_as_written(served: Served) -> None:
    block = with_ports(only_block(README, "A curl session", "bash"), {8000: served.port})
    done = run_bash(block, served.root, clean_env(), timeout_s=120)
    assert done.returncode == 0, f"the curl session failed ({done.returncode}):\n{done.stdout}"
    out = done.stdout
    answer, _, rest = out.partition("\n")
    assert "paris" in answer.lower(), f"the first line should be the chat answer, naming Paris:\n{out}"
    assert re.match(r"job_[0-9a-f]{32}\n", rest), f"the second line should be the job id:\n{out}"
    assert '"status": "succeeded"' in out and "event: job" in out, out
    assert '"cancelled"' in out or '"succeeded"' in out.split("event: job")[-1], out
    assert '["queued",["cancelled"]]' in out, out  # the scheduled job, cancelled, then retried
    assert not re.search(r'"error":\s*\{', out), out


def test_engine_example_runs_as_written(served: Served) -> None:
    example = only_block(ENGINE_PAGE, None, "python")
    done = subprocess.run([str(served.root / ".venv/bin/python"), "-c", example],
                          cwd=served.root, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"(length|stop)", done.stdout), done.stdout
    assert "paris" in done.stdout.lower(), f"the example's answer should name Paris:\n{done.stdout}"
    assert len(converted_folders(served.root)) == 1, "the example should reuse make serve's converted folder"


def test_make_docs_builds_the_site_as_written(served: Served) -> None:
    block = only_block(README, "Documentation site", "bash")
    assert commands(block) == ["make docs"]
    done = run_bash(block, served.root, clean_env(), timeout_s=300)
    assert done.returncode == 0, f"make docs failed ({done.returncode}):\n{done.stdout[-4000:]}"
    for page in ("index.html", "reference/settings/index.html", "reference/metrics/index.html"):
        assert (served.root / "site" / page).is_file(), f"no {page}:\n{done.stdout[-2000:]}"


def test_ctrl_c_stops_make_serve_cleanly(served: Served) -> None:
    os.killpg(served.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
    code = served.proc.wait(timeout=60)
    output = served.output()
    # make itself got the SIGINT too and ends by it, silently, once the server it waits for has exited.
    assert code in (0, -signal.SIGINT), f"make serve exited {code} on Ctrl-C:\n{output[-3000:]}"
    assert "Finished server process" in output, f"the server should shut down, not die:\n{output[-3000:]}"
    assert not alarms(output), "make serve printed alarms on Ctrl-C:\n" + "\n".join(alarms(output))


def test_postgres_and_redis_steps_run_as_written(served: Served) -> None:
    pg = FaultPostgres(find_postgres_bin())
    redis = FaultRedis(Path(tempfile.mkdtemp(prefix="conveyor-readme-redis-")))
    try:
        pg.init()
        _drop_conveyor_database(pg.port)  # the page creates the role and the database itself
        redis.start()
        api_port = free_port()
        block = with_ports(only_block(POSTGRES_REDIS_PAGE, None, "bash"),
                           {5432: pg.port, 6379: redis.port, 8000: api_port})
        env = clean_env(PGPORT=str(pg.port), CONVEYOR_PORT=str(api_port),
                        CONVEYOR_URL=f"http://127.0.0.1:{api_port}")
        done = run_bash(block, served.root, env, timeout_s=300)
        assert done.returncode == 0, f"the PostgreSQL/Redis steps failed ({done.returncode}):\n{done.stdout}"
        assert '"status": "succeeded"' in done.stdout, done.stdout
    finally:
        redis.stop()
        pg.destroy()


def _drop_conveyor_database(port: int) -> None:
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", autocommit=True) as conn:
        conn.execute('DROP DATABASE IF EXISTS "conveyor"')
