"""conveyor.bench.tenant_isolation over real HTTP against an embedded service (uvicorn, SQLite, the demo
model): it times the victim's rounds and reports how the hostile job ended. The figures themselves live in
the README."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.bench.tenant_isolation import main, run
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import new_api_key, serving

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, dtype="float32", device="cpu",
              attention_backend="torch")


def test_the_victims_rounds_are_timed_and_the_costly_job_reported(
    sqlite_url: str, make_settings: Callable[..., Any], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer, capsys: Any,
) -> None:
    from conveyor.worker.embedded import EmbeddedRuntime

    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(demo_model_dir),
                             grammar_compile_timeout_s=0.5, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime)
    victim, hostile = new_api_key(sqlite_url, "tenant-b"), new_api_key(sqlite_url, "tenant-a")
    with serving(app) as url:
        report = run(url, victim, hostile, jobs=3, rounds=2, properties=1500)
        assert len(report.alone_s) == len(report.beside_s) == 2 and min(report.alone_s + report.beside_s) > 0
        assert report.hostile["status"] == "failed"
        assert report.hostile["error"]["code"] == "invalid_request"
        assert main(["--url", url, "--victim-key", victim, "--hostile-key", hostile, "--jobs", "2",
                     "--rounds", "1", "--properties", "1500"]) == 0
    printed = capsys.readouterr().out
    assert "victim's jobs alone: median" in printed and "costly job: failed invalid_request" in printed
    assert "grammar_compile_timeout_s" in printed  # the second run: refused at once, by the same message
