"""`conveyor trace export` against the embedded service with auth on (HTTP -> store -> engine -> store ->
GET /v1/admin/trace -> the CLI's file): a known mix of jobs comes back as exactly those jobs' shapes (token
lengths, max_tokens, n, groups, deadlines, output tokens) and no text; with --with-text, the texts. Only an
admin may export: a tenant's key is refused (403, no file), no key is 401, and tenants appear only as keyed
hashes. Bad windows and filters name their field. Prompts that share a long prefix share the leading hashes of
their prefix_blocks, with no text in the trace."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.cli.main import app as cli
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.settings.service import load_settings
from conveyor.core.store import keys
from conveyor.core.store.database import make_db_engine, make_session_factory
from tests.support.live_server import WAIT_S, serving
from tests.support.service import Service

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
ADMIN_TOKEN = "admin-token-for-traces"
GREEDY = {"temperature": 0, "ignore_eos": True}  # every choice writes exactly max_tokens
MIX: list[tuple[str, dict[str, Any]]] = [  # (tenant, job body)
    ("alice", {"prompt": "Hi", "queue": "interactive", "max_tokens": 3}),
    ("alice", {"prompt": "A longer prompt about queues, workers and deadlines.", "queue": "interactive",
               "max_tokens": 5, "deadline_s": 30}),
    ("alice", {"prompt": "Two choices, please.", "queue": "documents", "max_tokens": 4, "n": 2}),
    ("bob", {"messages": [{"role": "user", "content": "Summarise the report."}], "queue": "documents",
             "max_tokens": 2, "deadline_s": 120.5}),
]
HEX16 = re.compile(r"^[0-9a-f]{16}$")
runner = CliRunner()


@dataclass
class Embedded:
    url: str
    keys: dict[str, str]  # tenant (and "ops", an admin) -> API key

    def headers(self, who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[who]}"}


@pytest.fixture
def embedded(make_settings: Callable[..., Settings], migrated_sqlite_url: str,
             prompt_tokenizer: PromptTokenizer) -> Iterator[Embedded]:
    from conveyor.worker.embedded import EmbeddedRuntime

    settings = make_settings(database_url=migrated_sqlite_url, admin_token=ADMIN_TOKEN, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    application = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer,
                             runtime=runtime)
    db_engine = make_db_engine(migrated_sqlite_url)
    with make_session_factory(db_engine)() as session:
        made = {tenant: keys.create_key(session, tenant, utcnow(), admin=tenant == "ops")[1]
                for tenant in ("alice", "bob", "ops")}
    db_engine.dispose()
    with serving(application) as url:
        yield Embedded(url, made)


def run_mix(service: Embedded) -> list[dict[str, Any]]:
    """Submits MIX in order and waits for each job to finish; the jobs as GET shows them."""
    submitted = []
    for tenant, body in MIX:
        r = httpx.post(service.url + "/v1/jobs", json={**body, **GREEDY}, headers=service.headers(tenant))
        assert r.status_code == 202, r.text
        submitted.append((tenant, r.json()["id"]))
    return [wait_done(service, tenant, job_id) for tenant, job_id in submitted]


def wait_done(service: Embedded, tenant: str, job_id: str) -> dict[str, Any]:
    while True:
        job: dict[str, Any] = httpx.get(f"{service.url}/v1/jobs/{job_id}", params={"wait": 30},
                                        headers=service.headers(tenant), timeout=WAIT_S).json()
        if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
            assert job["status"] == "succeeded", job
            return job


def export(url: str, key: str | None, out: Path, *extra: str) -> Any:
    given = ["--api-key", key] if key is not None else []
    return runner.invoke(cli, ["trace", "export", "--since", "1h", "--url", url, "--out", str(out),
                               *given, *extra])


def read_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    return header, lines


def test_an_admin_exports_the_mix_as_shapes_and_with_text_the_texts(embedded: Embedded, tmp_path: Path,
                                                                   ) -> None:
    done = run_mix(embedded)
    result = export(embedded.url, embedded.keys["ops"], tmp_path / "trace.jsonl")
    assert result.exit_code == 0, result.output + result.stderr
    assert f"exported 4 jobs to {tmp_path / 'trace.jsonl'}" in result.stderr

    header, lines = read_trace(tmp_path / "trace.jsonl")
    assert header["conveyor_trace"] == 1 and header["jobs"] == 4 and header["with_text"] is False
    assert header["filters"] == {"model": None, "queue": None, "tenant": None}
    assert header["tenant_hash"] == {"method": "hmac-sha256", "key": "per-export"}
    assert set(header["inventory"]["models"]) == {"demo-model"}
    assert header["inventory"]["models"]["demo-model"]["engine"]["max_num_seqs"] == 8
    assert [line["request_id"] for line in lines] == [job["id"] for job in done]  # in arrival order
    for line, job, (_tenant, body) in zip(lines, done, MIX, strict=True):
        n = body.get("n", 1)
        assert (line["model"], line["group"], line["kind"], line["status"]) == (
            "demo-model", body["queue"], "generation", "succeeded")
        assert (line["prompt_tokens"], line["max_tokens"], line["n"], line["output_tokens"]) == (
            job["usage"]["prompt_tokens"], body["max_tokens"], n, body["max_tokens"] * n)
        assert line["deadline_s"] == body.get("deadline_s")
        assert HEX16.match(line["tenant"]) and not {"prompt", "messages", "inputs", "output"} & set(line)
    assert lines[0]["prompt_tokens"] < lines[1]["prompt_tokens"]
    assert lines[0]["arrival_s"] == 0.0 and lines[-1]["arrival_s"] > 0
    tenants = [line["tenant"] for line in lines]
    assert tenants[:3] == [tenants[0]] * 3 and tenants[3] != tenants[0]
    assert "alice" not in (tmp_path / "trace.jsonl").read_text()

    texts = export(embedded.url, embedded.keys["ops"], tmp_path / "texts.jsonl", "--with-text")
    assert texts.exit_code == 0, texts.output + texts.stderr
    header, lines = read_trace(tmp_path / "texts.jsonl")
    assert header["with_text"] is True
    for line, job, (_tenant, body) in zip(lines, done, MIX, strict=True):
        asked = {key: line[key] for key in ("prompt", "messages") if key in line}
        assert asked == {key: body[key] for key in ("prompt", "messages") if key in body}
        assert line["output"] == job["result"]["text"]

    bobs = export(embedded.url, ADMIN_TOKEN, tmp_path / "bob.jsonl", "--tenant", "bob",
                  "--queue", "documents")
    assert bobs.exit_code == 0, bobs.output + bobs.stderr
    header, lines = read_trace(tmp_path / "bob.jsonl")  # the admin token may export too
    assert [line["request_id"] for line in lines] == [done[3]["id"]]
    assert HEX16.match(header["filters"]["tenant"]) and header["filters"]["queue"] == "documents"


def test_a_tenant_key_cannot_export_and_no_key_is_unauthorized(service: Service, tmp_path: Path) -> None:
    tenant_key = keys_of(service, "alice")
    trace = tmp_path / "trace.jsonl"
    with serving(service.http.app) as url:
        refused = export(url, tenant_key, trace)
        anonymous = export(url, None, trace)
        assert not trace.exists() and not (tmp_path / "trace.jsonl.part").exists()
        admin_key = keys_of(service, "ops", admin=True)
        allowed = export(url, admin_key, trace)
        printed = runner.invoke(cli, ["trace", "export", "--since", "1h", "--url", url,
                                      "--api-key", admin_key])
    assert refused.exit_code == 2 and "HTTP 403" in refused.stderr and "admin API key" in refused.stderr
    assert anonymous.exit_code == 2 and "HTTP 401" in anonymous.stderr
    assert allowed.exit_code == 0 and "exported 0 jobs" in allowed.stderr, allowed.stderr
    header, lines = read_trace(trace)
    assert header["jobs"] == 0 and lines == []
    assert printed.exit_code == 0 and json.loads(printed.stdout)["jobs"] == 0  # no --out: stdout
    assert "exported 0 jobs to stdout" in printed.stderr


@pytest.mark.parametrize(("query", "status", "field"), [
    ({"since": "yesterday"}, 422, "since"), ({"since": "1h", "until": "2h"}, 422, "until"),
    ({"since": "1h", "queue": "a:b"}, 422, "queue"), ({"since": "1h", "model": "nope"}, 404, "model"),
])
def test_a_bad_window_or_filter_names_its_field(service: Service, query: dict[str, str], status: int,
                                                field: str) -> None:
    admin = service.client_with_key(keys_of(service, "ops", admin=True))
    r = admin.get("/v1/admin/trace", params=query)
    assert r.status_code == status and r.json()["error"]["field"] == field, r.text


def test_the_route_streams_ndjson_with_the_header_first(service: Service) -> None:
    alice = service.client("alice")
    job_id = alice.post("/v1/jobs", json={"prompt": "x", "max_tokens": 2}).json()["id"]  # queued: no worker
    admin = service.client_with_key(keys_of(service, "ops", admin=True))
    r = admin.get("/v1/admin/trace", params={"since": "1h", "tenant": "alice"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
    header, line = (json.loads(text) for text in r.text.splitlines())
    assert header["jobs"] == 1 and (line["request_id"], line["status"]) == (job_id, "queued")
    assert service.http.get("/v1/admin/trace", params={"since": "1h"}).status_code == 401


MANUAL = "Section 4 of the conveyor manual: belts run at most two metres a second, guards stay closed. " * 4


def test_prompts_sharing_a_prefix_share_their_leading_block_hashes_and_no_text(
    service: Service, prompt_tokenizer: PromptTokenizer,
) -> None:
    questions = ["How fast may the belt run when it carries the heaviest crates of the whole warehouse?",
                 "Which of the guards must stay closed while the belt is being cleaned by the night shift?"]
    prompts = [MANUAL + question for question in questions]  # each question longer than a block
    alice = service.client("alice")
    for prompt in prompts:  # queued (no worker): its prompt is stored all the same
        assert alice.post("/v1/jobs", json={"prompt": prompt, "max_tokens": 2}).status_code == 202
    admin = service.client_with_key(keys_of(service, "ops", admin=True))
    r = admin.get("/v1/admin/trace", params={"since": "1h"})
    assert r.status_code == 200, r.text
    header, *lines = (json.loads(text) for text in r.text.splitlines())
    assert header["prefix_block_tokens"] == 16 and header["with_text"] is False
    first, second = (line["prefix_blocks"] for line in lines)
    ids = [prompt_tokenizer.encode_prompt(prompt) for prompt in prompts]  # as submit counts them
    shared = next(i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y) // 16
    assert shared >= 3 and [len(first), len(second)] == [len(i) // 16 for i in ids]
    assert first[:shared] == second[:shared] and first[shared] != second[shared]
    assert [line["prompt_tokens"] for line in lines] == [len(i) for i in ids]
    assert "conveyor manual" not in r.text and not {"prompt", "output"} & {*lines[0], *lines[1]}


def keys_of(service: Service, tenant: str, admin: bool = False) -> str:
    with service.session_factory() as session:
        return keys.create_key(session, tenant, utcnow(), admin=admin)[1]


def test_conveyor_tune_on_the_exported_mix_writes_a_sheet_per_change_and_a_snippet_serve_loads(
    embedded: Embedded, tmp_path: Path,
) -> None:
    """The issue's loop end to end: traffic -> export -> tune (two parameters of two values each)."""
    run_mix(embedded)
    trace, out = tmp_path / "trace.jsonl", tmp_path / "tune"
    assert export(embedded.url, embedded.keys["ops"], trace).exit_code == 0
    result = runner.invoke(cli, ["tune", "--trace", str(trace), "--out", str(out), "--repeats", "2",
                                 "--param", "max_num_seqs=2,4", "--param", "queues.documents.max_running=1,2",
                                 "--no-progress"])
    assert result.exit_code == 0, result.output

    report = json.loads((out / "tune-report.json").read_text())
    assert report["baseline"]["configuration"] == {"max_num_seqs": 8, "queues.documents.max_running": 4}
    changes = sorted((step["parameter"], step["to"]) for step in report["steps"])
    assert changes == [("max_num_seqs", 2), ("max_num_seqs", 4), ("queues.documents.max_running", 1),
                       ("queues.documents.max_running", 2)]
    assert len(list((out / "sheets").glob("*.md"))) == 4  # one decision sheet per change
    recommended = report["recommended"]["configuration"]
    assert "## Recommended settings" in (out / "tune-report.md").read_text()
    loaded = load_settings(out / "settings.toml")  # what `conveyor serve --config` reads
    seqs_changed = "max_num_seqs" in report["changes"]  # an unchanged setting is left out of the snippet
    assert loaded.max_num_seqs == (recommended["max_num_seqs"] if seqs_changed else None)
    assert loaded.queues["documents"].max_running == recommended["queues.documents.max_running"]
    assert set(loaded.queues) >= {"interactive", "documents"}
