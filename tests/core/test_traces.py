"""Trace lines and headers (core/traces.py) from stored jobs, and the export window (core/trace_window.py):
each field of a line from its row (token lengths, deadline, flags, timings), arrival order with a scheduled
job, tenants only as keyed hashes, text only when asked, the header's inventory and filters; prompts as
chains of block hashes (prefix_blocks) from the model's tokenizer, no text."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy.orm import Session, sessionmaker

from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.protocol.chat_options import ChatOptions
from conveyor.core.protocol.job_kinds import EMBEDDING
from conveyor.core.settings import Settings
from conveyor.core.store import batches, jobs, keys
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.trace_rows import TraceWindow, trace_rows
from conveyor.core.trace_prefixes import PREFIX_BLOCK_TOKENS, block_hashes, prompt_ids_by_model
from conveyor.core.trace_window import parse_time, window_bounds
from conveyor.core.traces import TraceExport, trace_header, write_lines

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
WINDOW = TraceWindow(T0, T0 + timedelta(hours=1))
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
TOOL_ANSWER = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
HEX16 = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture
def sessions(migrated_sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    db_engine = make_db_engine(migrated_sqlite_url)
    yield make_session_factory(db_engine)
    db_engine.dispose()


def add(session: Session, at: datetime, *, tenant: str = "acme", lane: str = "m:interactive",
        **fields: Any) -> str:
    keys.ensure_tenant(session, tenant, at)
    values: dict[str, Any] = dict(tenant_id=tenant, queue=lane, prompt="the prompt", messages=None,
                                  params={"max_tokens": 8}, meta=None, webhook=None, idempotency_key=None,
                                  request_hash="h", prompt_tokens=5, ttl_s=None, timeout_s=None)
    return jobs.add(session, jobs.NewJob(**{**values, **fields}), at).id


def finish(session: Session, job_id: str, started: datetime, text: str, completion_tokens: int) -> None:
    assert jobs.claim(session, job_id, "w1", started) is not None
    assert jobs.complete(session, job_id, 1, result_text=text, finish_reason="stop", prompt_tokens=5,
                         completion_tokens=completion_tokens, preemptions=1,
                         first_token_at=started + timedelta(seconds=0.5), now=started + timedelta(seconds=2))


def export_lines(sessions: sessionmaker[Session], export: TraceExport) -> list[dict[str, Any]]:
    out = io.BytesIO()
    count = write_lines(trace_rows(sessions, export.window, with_text=export.reads_prompts), export, out)
    lines = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert count == len(lines)
    return lines


def per_export(window: TraceWindow = WINDOW, with_text: bool = False, key: bytes = b"k" * 32,
               tokenizer: PromptTokenizer | None = None) -> TraceExport:
    """An export with a fixed key; with `tokenizer`, model m's prompts are hashed into prefix_blocks."""
    prompt_ids = None if tokenizer is None else prompt_ids_by_model({"m": tokenizer})
    return TraceExport(window, with_text, key, key_configured=False, prompt_ids=prompt_ids)


def test_a_line_holds_each_shape_and_flag_of_its_job(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        batch = batches.create(session, tenant_id="acme", input_url="s3://b/in.jsonl", output_url=None,
                               queue="m:documents", now=T0)
        chat = add(session, T0, lane="m:documents", prompt=None, messages=[{"role": "user", "content": "hi"}],
                   params={"max_tokens": 32, "n": 2, "lora": "support"}, priority=-1, deadline_s=30.0,
                   service_tier="flex", chat={"tools": TOOLS, "tool_choice": "auto"}, batch_id=batch.id)
        structured = add(session, T0 + timedelta(seconds=1.5),
                         params={"max_tokens": 4, "structured": {"json_object": True}})
        embedding = add(session, T0 + timedelta(seconds=2), prompt=None, kind=EMBEDDING, inputs=["a", "b"],
                        params={"encoding_format": "float"})
        finish(session, chat, T0 + timedelta(seconds=1), TOOL_ANSWER, completion_tokens=17)
    first, second, third = export_lines(sessions, per_export())
    assert first == {
        "request_id": chat, "arrival_s": 0.0, "model": "m", "group": "documents", "kind": "generation",
        "status": "succeeded", "prompt_tokens": 5, "max_tokens": 32, "output_tokens": 17, "n": 2,
        "deadline_s": 30.0, "priority": -1, "tier": "flex", "structured": False, "tools": True,
        "tool_call": True, "adapter": "support", "tenant": first["tenant"], "batch": True, "queue_s": 1.0,
        "ttft_s": 1.5, "e2e_s": 3.0, "preemptions": 1, "prefix_blocks": None}  # no tokenizer given
    assert HEX16.match(first["tenant"]) and "acme" not in first["tenant"]
    assert (second["request_id"], second["arrival_s"], second["structured"], second["tools"]) == (
        structured, 1.5, True, False)
    assert (second["status"], second["output_tokens"], second["queue_s"], second["deadline_s"]) == (
        "queued", None, None, None)
    assert (third["request_id"], third["kind"], third["max_tokens"], third["batch"]) == (
        embedding, "embedding", 0, False)
    assert not {"prompt", "messages", "inputs", "output"} & {*first, *second, *third}


def test_a_tool_offered_but_not_called_is_no_tool_call(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job = add(session, T0, chat={"tools": TOOLS, "tool_choice": "auto"})
        finish(session, job, T0, "no call here", completion_tokens=3)
    (line,) = export_lines(sessions, per_export())
    assert (line["tools"], line["tool_call"]) == (True, False)


def test_a_scheduled_job_arrives_when_due_and_lines_come_by_arrival(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        first = add(session, T0)
        later = add(session, T0 + timedelta(seconds=1), run_at=T0 + timedelta(seconds=10), deadline_s=5.0)
        between = add(session, T0 + timedelta(seconds=2))
    lines = export_lines(sessions, per_export())
    assert [(line["request_id"], line["arrival_s"]) for line in lines] == [
        (first, 0.0), (between, 2.0), (later, 10.0)]
    assert lines[2]["deadline_s"] == 5.0 and lines[2]["status"] == "scheduled"  # counted from its run_at


def test_text_only_when_asked(sessions: sessionmaker[Session]) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with sessions() as session:
        prompt_job = add(session, T0)
        add(session, T0 + timedelta(seconds=1), prompt=None, messages=messages)
        add(session, T0 + timedelta(seconds=2), prompt=None, kind=EMBEDDING, inputs=["a"], params={})
        finish(session, prompt_job, T0, "the answer", completion_tokens=2)
    texts = [{key: line[key] for key in ("prompt", "messages", "inputs", "output") if key in line}
             for line in export_lines(sessions, per_export(with_text=True))]
    assert texts == [{"prompt": "the prompt", "output": "the answer"}, {"messages": messages, "output": None},
                     {"inputs": ["a"], "output": None}]


def test_prompts_sharing_40_tokens_share_their_first_two_blocks(sessions: sessionmaker[Session],
                                                                 prompt_tokenizer: PromptTokenizer) -> None:
    common = list(range(100, 140))  # 40 tokens: blocks 1 and 2 whole, block 3 only in part
    with sessions() as session:
        first = add(session, T0, prompt=None, inputs=[[*common, *range(200, 220)]], prompt_tokens=60)
        second = add(session, T0 + timedelta(seconds=1), prompt=None, inputs=[[*common, *range(300, 316)]],
                     prompt_tokens=56)
    exported = export_lines(sessions, per_export(tokenizer=prompt_tokenizer))
    lines = {line["request_id"]: line for line in exported}
    a, b = lines[first]["prefix_blocks"], lines[second]["prefix_blocks"]
    assert (len(a), len(b)) == (60 // PREFIX_BLOCK_TOKENS, 56 // PREFIX_BLOCK_TOKENS) == (3, 3)
    assert a[:2] == b[:2] and a[2] != b[2]  # 32 <= 40 < 48
    assert all(HEX16.match(digest) for digest in a + b) and len(set(a)) == 3
    assert not {"prompt", "messages", "inputs", "output"} & {*lines[first], *lines[second]}  # read, unwritten


def test_blocks_come_from_the_prompt_as_the_model_sees_it(sessions: sessionmaker[Session],
                                                          prompt_tokenizer: PromptTokenizer) -> None:
    """A text prompt as the tokenizer encodes it at submit; a chat rendered with the model's template and the
    job's stored chat options; an embedding job has none."""
    text = "A manual excerpt about conveyor belts, repeated. " * 8
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "How fast may it run?"}]
    chat = {"add_generation_prompt": False}
    with sessions() as session:
        add(session, T0, prompt=text)
        add(session, T0 + timedelta(seconds=1), prompt=None, messages=messages, chat=chat)
        add(session, T0 + timedelta(seconds=2), prompt=None, kind=EMBEDDING, inputs=[text], params={})
    export = per_export(tokenizer=prompt_tokenizer)
    prompt_line, chat_line, embedding_line = export_lines(sessions, export)
    text_ids = prompt_tokenizer.encode_prompt(text)
    rendered = prompt_tokenizer.encode_chat(messages, ChatOptions.from_json(chat))
    assert len(text_ids) >= 4 * PREFIX_BLOCK_TOKENS and len(rendered) > len(text_ids)
    assert prompt_line["prefix_blocks"] == block_hashes(text_ids, export.hash_key)
    assert chat_line["prefix_blocks"] == block_hashes(rendered, export.hash_key)
    assert len(chat_line["prefix_blocks"]) == len(rendered) // PREFIX_BLOCK_TOKENS
    assert chat_line["prefix_blocks"][0] != prompt_line["prefix_blocks"][0]  # the template's own tokens first
    assert embedding_line["prefix_blocks"] is None


def test_block_hashes_differ_under_another_key(sessions: sessionmaker[Session],
                                               prompt_tokenizer: PromptTokenizer) -> None:
    with sessions() as session:
        add(session, T0, prompt=None, inputs=[list(range(100, 148))], prompt_tokens=48)
    (one,) = export_lines(sessions, per_export(tokenizer=prompt_tokenizer))
    (other,) = export_lines(sessions, per_export(key=b"o" * 32, tokenizer=prompt_tokenizer))
    assert len(one["prefix_blocks"]) == len(other["prefix_blocks"]) == 3
    assert not set(one["prefix_blocks"]) & set(other["prefix_blocks"])


def test_tenants_hash_alike_only_under_a_configured_key(make_settings: Callable[..., Settings]) -> None:
    configured = make_settings(trace_hash_key=SecretStr("stable"))
    a, b = (TraceExport.of(configured, WINDOW, False) for _ in range(2))
    assert a.key_configured and a.tenant_hash("acme") == b.tenant_hash("acme") != a.tenant_hash("other")
    c, d = (TraceExport.of(make_settings(), WINDOW, False) for _ in range(2))
    assert not c.key_configured and c.tenant_hash("acme") != d.tenant_hash("acme")
    assert make_settings(trace_hash_key="").trace_hash_key is None  # set but empty: unset


def test_the_header_records_window_filters_and_inventory(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(max_num_seqs=16, max_num_batched_tokens=2048,
                             queues={"interactive": {"default_deadline_s": 10}})
    window = TraceWindow(T0, T0 + timedelta(hours=1), queue="interactive", tenant="acme")
    export = TraceExport.of(settings, window, True)
    header = trace_header(settings, export, 7, T0 + timedelta(hours=2))
    assert header["conveyor_trace"] == 1 and header["version"] and header["jobs"] == 7
    assert (header["since"], header["until"]) == ("2026-01-01T12:00:00+00:00", "2026-01-01T13:00:00+00:00")
    assert header["filters"] == {"model": None, "queue": "interactive", "tenant": export.tenant_hash("acme")}
    assert header["with_text"] is True and header["tenant_hash"] == {"method": "hmac-sha256",
                                                                     "key": "per-export"}
    assert header["prefix_block_tokens"] == PREFIX_BLOCK_TOKENS == 16
    (model_id, model), = header["inventory"]["models"].items()
    assert model_id == "demo-model" and model["source"] == settings.model
    assert model["engine"] == {"max_num_seqs": 16, "max_num_batched_tokens": 2048}
    assert model["queues"]["interactive"] == {"max_running": 16, "priority": 0, "max_queued": 1000,
                                              "default_deadline_s": 10.0}
    assert header["inventory"]["settings"]["auth_enabled"] is True
    assert "acme" not in json.dumps(header) and "sqlite:" not in json.dumps(header)


NOW = datetime(2026, 12, 6, 20, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize(("given", "want"), [
    ("90s", NOW - timedelta(seconds=90)), ("30m", NOW - timedelta(minutes=30)),
    ("1h", NOW - timedelta(hours=1)), ("2d", NOW - timedelta(days=2)),
    ("2026-12-06T10:00:00Z", datetime(2026, 12, 6, 10, tzinfo=timezone.utc)),
    ("2026-12-06T12:00:00+02:00", datetime(2026, 12, 6, 10, tzinfo=timezone.utc)),
    ("2026-12-06T10:00:00", datetime(2026, 12, 6, 10, tzinfo=timezone.utc)),  # no offset: UTC
])
def test_times_are_durations_ago_or_iso_8601(given: str, want: datetime) -> None:
    assert parse_time(given, "since", NOW) == want


@pytest.mark.parametrize(("since", "until", "field"), [
    ("yesterday", None, "since"), ("1w", None, "since"), ("1h", "soon", "until"), ("1h", "2h", "until"),
    ("100000d", None, "since"),
])
def test_a_bad_window_names_its_field(since: str, until: str | None, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        window_bounds(since, until, NOW)
