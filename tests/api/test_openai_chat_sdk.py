"""The OpenAI-compatible synchronous surface driven by the official `openai` SDK over real HTTP: an embedded
server (uvicorn on an ephemeral port, the tiny demo model, SQLite, auth on) for chat, streaming, completions
and models; a worker-less server for the error classes the SDK raises (400, 401, 404, 429)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conveyor.api.app import create_app
from conveyor.api.prompt_tokenizer import PromptTokenizer
from conveyor.core.clock import utcnow
from conveyor.core.settings import Settings
from conveyor.core.store import jobs
from conveyor.core.store.database import make_db_engine, make_session_factory
from conveyor.core.store.migrate import upgrade
from tests.support.live_server import WAIT_S, new_api_key, serving, wait_for
from tests.support.service import RecordingPublisher

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=192, block_size=16, dtype="float32",
              device="cpu", attention_backend="torch")
QUEUES = {"interactive": {"max_output_tokens": 900}}
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
MESSAGES: list[Any] = [{"role": "user", "content": "Write a haiku about queues."}]
MAX_MODEL_LEN = 80  # the worker-less server's


@dataclass
class Server:
    url: str
    key: str
    model: str
    database_url: str
    runtime: Any = None
    settings: Settings | None = None

    def client(self, key: str | None = None, timeout: float = WAIT_S) -> openai.OpenAI:
        base_url = self.url + "/v1"
        return openai.OpenAI(base_url=base_url, api_key=key or self.key, max_retries=0, timeout=timeout)

    def job(self, job_id: str) -> Any:
        db_engine = make_db_engine(self.database_url)
        try:
            with make_session_factory(db_engine)() as session:
                job = jobs.get(session, job_id)
                assert job is not None, job_id
                return job
        finally:
            db_engine.dispose()


@pytest.fixture(scope="module")
def embedded(
    tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, prompt_tokenizer: PromptTokenizer
) -> Iterator[Server]:
    from conveyor.worker.embedded import EmbeddedRuntime

    tmp = tmp_path_factory.mktemp("openai-embedded")
    url = f"sqlite:///{tmp / 'conveyor.db'}"
    upgrade(url)
    settings = Settings(data_dir=tmp, database_url=url, model=str(demo_model_dir), auth_enabled=True,
                        queues=QUEUES, reconcile_interval_s=0.2, dispatch_grace_s=0.5, worker_heartbeat_s=0.2,
                        cancel_poll_s=0.1, **ENGINE)
    runtime = EmbeddedRuntime(settings)
    app = create_app(settings, publisher=runtime.publisher, tokenizer=prompt_tokenizer, runtime=runtime,
                     token_stream=runtime.token_stream)
    with serving(app) as base:
        yield Server(base, new_api_key(url, "alice"), demo_model_dir.name, url, runtime, settings)


@pytest.fixture
def workerless(
    sqlite_url: str, make_settings: Callable[..., Settings], demo_model_dir: Path,
    prompt_tokenizer: PromptTokenizer,
) -> Iterator[Server]:
    """No worker: jobs stay queued. Auth on, one queued job allowed in `interactive`."""
    upgrade(sqlite_url)
    settings = make_settings(database_url=sqlite_url, model=str(demo_model_dir),
                             queues={"interactive": {"max_queued": 1, "max_output_tokens": 64}},
                             max_model_len=MAX_MODEL_LEN)
    app = create_app(settings, publisher=RecordingPublisher(), tokenizer=prompt_tokenizer)
    with serving(app) as base:
        yield Server(base, new_api_key(sqlite_url, "bob"), demo_model_dir.name, sqlite_url)


def job_id_of(completion_id: str) -> str:
    return completion_id.split("-", 1)[1]


def test_chat_streamed_deltas_join_to_the_non_streamed_greedy_text(embedded: Server) -> None:
    client = embedded.client()
    whole = client.chat.completions.create(model=embedded.model, messages=MESSAGES, seed=7, **GREEDY)
    assert whole.object == "chat.completion" and whole.model == embedded.model
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert embedded.job(job_id_of(whole.id)).status == "succeeded"

    chunks = list(client.chat.completions.create(model=embedded.model, messages=MESSAGES, seed=7, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) >= 2, "text must arrive in several deltas while the job runs"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    # The same prompt again: equal counts, except that it may find more of its prompt in the prefix cache.
    details = {"prompt_tokens_details"}
    assert chunks[-1].usage.model_dump(exclude=details) == whole.usage.model_dump(exclude=details)


def test_a_repeated_prompt_reports_its_cached_tokens_in_openai_usage(embedded: Server) -> None:
    client = embedded.client()
    words = " ".join(f"line{i} of the shared instructions" for i in range(24))
    messages: list[Any] = [{"role": "user", "content": f"{words}. Summarise them."}]
    first = client.chat.completions.create(model=embedded.model, messages=messages, **GREEDY)
    again = client.chat.completions.create(model=embedded.model, messages=messages, **GREEDY)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    cached_first = first.usage.prompt_tokens_details.cached_tokens or 0
    cached_again = again.usage.prompt_tokens_details.cached_tokens or 0
    prompt_tokens = again.usage.prompt_tokens
    # The second computes at most its last KV block (16 tokens) again; the first found at most a shared
    # chat-template prefix of earlier tests.
    assert prompt_tokens - 16 <= cached_again < prompt_tokens and cached_first < cached_again
    assert again.choices[0].message.content == first.choices[0].message.content
    assert embedded.job(job_id_of(again.id)).cached_tokens == cached_again


def test_streamed_text_with_a_stop_string_matches_the_non_streamed_cut(embedded: Server) -> None:
    client = embedded.client()
    free = client.chat.completions.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    text = free.choices[0].message.content or ""
    stop = text[6:9]  # somewhere inside the greedy text: both answers must end just before it
    assert len(stop) == 3, text
    whole = client.chat.completions.create(model=embedded.model, messages=MESSAGES, stop=[stop], **GREEDY)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == text[: text.index(stop)]
    chunks = list(client.chat.completions.create(model=embedded.model, messages=MESSAGES, stop=[stop],
                                                 stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].usage is None


def test_text_completions_plain_and_streamed(embedded: Server) -> None:
    client = embedded.client()
    prompt = "The queue holds jobs until a worker is free."
    whole = client.completions.create(model=embedded.model, prompt=prompt, **GREEDY)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    parts = list(client.completions.create(model=embedded.model, prompt=prompt, stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_chat_and_completion_logprobs_in_openai_shape(embedded: Server) -> None:
    client = embedded.client()
    plain = client.chat.completions.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None  # not asked for

    chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None and len(logprobs.content) == 12
    stored = embedded.job(job_id_of(chat.id)).logprobs
    for token, kept in zip(logprobs.content, stored, strict=True):
        assert (token.token, token.logprob) == (kept["text"], pytest.approx(kept["logprob"]))
        assert token.bytes == list(token.token.encode())
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the sampled token is the best one
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)
    assert chat.choices[0].message.content == plain.choices[0].message.content

    prompt = "The queue holds jobs until a worker is free."
    text = client.completions.create(model=embedded.model, prompt=prompt, logprobs=2, **GREEDY)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == 12
    assert all(len(alternatives) <= 2 for alternatives in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]


def test_logprobs_are_refused_when_streaming(workerless: Server) -> None:
    client = workerless.client()
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=workerless.model, messages=MESSAGES, max_tokens=4, stream=True,
                                       logprobs=True)
    assert chat.value.param == "logprobs" and "stream" in chat.value.message
    with pytest.raises(openai.BadRequestError) as text:
        client.completions.create(model=workerless.model, prompt="Hi", max_tokens=4, stream=True, logprobs=1)
    assert text.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as top_only:
        client.chat.completions.create(model=workerless.model, messages=MESSAGES, max_tokens=4,
                                       top_logprobs=2)
    assert top_only.value.param == "top_logprobs"


def test_models_list_and_retrieve(embedded: Server) -> None:
    client = embedded.client()
    listed = client.models.list()
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [(embedded.model, "model", "conveyor")]
    assert client.models.retrieve(embedded.model).id == embedded.model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"


def test_a_client_that_disconnects_mid_stream_cancels_its_job(embedded: Server) -> None:
    client = embedded.client()
    stream = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=900,
                                            stream=True, extra_body={"ignore_eos": True})
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    stream.close()
    job_id = job_id_of(first.id)
    wait_for(lambda: embedded.job(job_id).status != "running", "the job to leave running")
    job = embedded.job(job_id)
    assert job.status == "cancelled" and job.result_text is None
    host = embedded.runtime.host
    wait_for(lambda: host.stats()["kv_blocks_used"] == 0, "the engine to free the job's KV blocks")


def test_sdk_error_classes(workerless: Server) -> None:
    client = workerless.client()
    with pytest.raises(openai.AuthenticationError) as unauthorized:
        workerless.client("cvk_not-a-key").chat.completions.create(model=workerless.model, messages=MESSAGES)
    assert unauthorized.value.status_code == 401 and unauthorized.value.type == "authentication_error"

    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model=workerless.model, messages=MESSAGES, max_tokens=65)
    assert too_many.value.param == "max_tokens" and too_many.value.code == "max_tokens_too_large"
    with pytest.raises(openai.BadRequestError) as bad_field:
        client.chat.completions.create(model=workerless.model, messages=MESSAGES, temperature=3)
    assert bad_field.value.param == "temperature" and bad_field.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as two:
        client.completions.create(model=workerless.model, prompt="Hi", n=17)
    assert two.value.param == "n"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"

    db_engine = make_db_engine(workerless.database_url)
    with make_session_factory(db_engine)() as session:  # the one job the interactive queue may hold
        jobs.add(session, jobs.NewJob(
            tenant_id="bob", queue="demo-model:interactive", prompt="Hi", messages=None, params={}, meta=None,
            webhook=None, idempotency_key=None, request_hash="x", prompt_tokens=1, ttl_s=None, timeout_s=None,
        ), utcnow())
    db_engine.dispose()
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(model=workerless.model, messages=MESSAGES, max_tokens=4)
    assert full.value.code == "queue_full" and full.value.response.headers["retry-after"] == "2"


def test_a_request_beyond_the_models_context_is_a_400_at_submit(embedded: Server) -> None:
    client = embedded.client()
    # ~200 prompt tokens + 900 exceed the model's 1024 positions: with no max_model_len configured, the API
    # judges it against the model's own (its config.json), streamed or not, before any job exists.
    prompt = "word " * 200
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=embedded.model, prompt=prompt, max_tokens=900, stream=stream)
        assert refused.value.code == "context_too_long" and "max_model_len (1024)" in refused.value.message
        assert refused.value.param == "max_tokens"


def test_a_job_cancelled_through_the_jobs_api_ends_its_stream_with_an_error(embedded: Server) -> None:
    client = embedded.client()
    stream = client.chat.completions.create(model=embedded.model, messages=MESSAGES, max_tokens=900,
                                            stream=True, extra_body={"ignore_eos": True})
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    job_id = job_id_of(first.id)
    cancelled = httpx.post(f"{embedded.url}/v1/jobs/{job_id}/cancel",
                           headers={"Authorization": f"Bearer {embedded.key}"})
    assert cancelled.status_code == 200, cancelled.text
    with pytest.raises(openai.APIError) as ended:
        list(stream)
    assert ended.value.code == "cancelled"


def test_a_plain_request_whose_client_times_out_is_cancelled(
    workerless: Server, prompt_tokenizer: PromptTokenizer
) -> None:
    client = workerless.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):  # no worker: the job stays queued until the client gives up
        client.chat.completions.create(model=workerless.model, messages=MESSAGES)
    db_engine = make_db_engine(workerless.database_url)
    sessions = make_session_factory(db_engine)

    def submitted() -> list[Any]:
        with sessions() as session:
            return jobs.page(session, "bob", limit=2)

    try:  # on a loaded machine the client may give up before the server has stored the job: it still will
        wait_for(lambda: bool(submitted()), "the job to be stored")
        [job] = submitted()
        job_id, params = job.id, job.params
    finally:
        db_engine.dispose()
    wait_for(lambda: workerless.job(job_id).status == "cancelled", "the job to be cancelled")
    # Without max_tokens a chat asks for as many tokens as fit: the queue's cap within max_model_len.
    assert params["max_tokens"] == min(64, MAX_MODEL_LEN - prompt_tokenizer.count_messages(MESSAGES))


def test_a_batch_through_files_and_batches_answers_like_the_synchronous_route(embedded: Server) -> None:
    client = embedded.client()
    sampling: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}
    body = {"model": embedded.model, "messages": MESSAGES, "ignore_eos": True, **sampling}
    line = {"custom_id": "haiku", "method": "POST", "url": "/v1/chat/completions", "body": body}
    # Once first, so that the batch line and the synchronous call below both find the prompt's first block
    # in the prefix cache (their usage is compared, cached_tokens included), whichever of this module's
    # tests ran on this server before (under pytest-xdist, maybe none).
    client.chat.completions.create(model=embedded.model, messages=MESSAGES, **sampling,
                                   extra_body={"ignore_eos": True})
    uploaded = client.files.create(file=("haiku.jsonl", (json.dumps(line) + "\n").encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert batch.id in [b.id for b in client.batches.list().data]

    def closed() -> bool:
        return client.batches.retrieve(batch.id).status in ("completed", "failed", "cancelled", "expired")

    wait_for(closed, f"batch {batch.id} to close")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id, done
    [result] = [json.loads(r) for r in client.files.content(done.output_file_id).text.splitlines()]
    batched = result["response"]["body"]

    chat = client.chat.completions.create(model=embedded.model, messages=MESSAGES, **sampling,
                                          extra_body={"ignore_eos": True})
    assert batched["choices"][0]["message"]["content"] == chat.choices[0].message.content
    assert chat.usage is not None and batched["usage"] == chat.usage.model_dump(exclude_none=True)
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    batched_tokens = batched["choices"][0]["logprobs"]["content"]  # the line asked for logprobs
    assert [t["token"] for t in batched_tokens] == [t.token for t in chat.choices[0].logprobs.content]
    assert [len(t["top_logprobs"]) for t in batched_tokens] == [2] * 8


class BreakingStream:
    """A token stream whose subscriptions fail after their first event (a Redis connection dropping)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failures = 0

    async def subscribe(self, job_id: str) -> Any:
        stream, subscription = self, await self.inner.subscribe(job_id)

        class Breaking:
            calls = 0

            async def get(self, timeout_s: float) -> Any:
                self.calls += 1
                if self.calls > 1:
                    stream.failures += 1
                    raise ConnectionError("token stream: connection lost")
                return await subscription.get(timeout_s)

            async def close(self) -> None:
                await subscription.close()

        return Breaking()


def test_a_broken_token_stream_falls_back_to_the_store(
    embedded: Server, prompt_tokenizer: PromptTokenizer
) -> None:
    assert embedded.settings is not None
    breaking = BreakingStream(embedded.runtime.token_stream)
    app = create_app(embedded.settings, publisher=embedded.runtime.publisher, tokenizer=prompt_tokenizer,
                     token_stream=breaking)  # shares the running embedded worker
    want = embedded.client().chat.completions.create(model=embedded.model, messages=MESSAGES, **GREEDY)
    with serving(app) as base:
        client = Server(base, embedded.key, embedded.model, embedded.database_url).client()
        chunks = list(client.chat.completions.create(model=embedded.model, messages=MESSAGES, stream=True,
                                                     **GREEDY))
    assert breaking.failures == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def _sse_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    """A streamed completion's chunks, as a vLLM benchmarking client reads them (`data: ` lines, [DONE])."""
    chunks, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            continue
        chunks.append(json.loads(line.removeprefix("data: ")))
    assert done, "the stream must end with [DONE]"
    return chunks


def test_a_vllm_benchmark_client_loop_runs_unmodified(embedded: Server) -> None:
    """What a benchmarking client written for vLLM does: check /health, read the model from /v1/models, then
    stream chat and completions with usage in every chunk, and send some without streaming."""
    headers = {"Authorization": f"Bearer {embedded.key}"}
    with httpx.Client(base_url=embedded.url, headers=headers, timeout=WAIT_S) as http:
        wait_for(lambda: http.get("/health").status_code == 200, "the server to report a live worker")
        model = http.get("/v1/models").json()["data"][0]["id"]
        options = {"include_usage": True, "continuous_usage_stats": True}
        requests = [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Once"})]
        for path, prompt in requests:
            body = {"model": model, **prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            streamed = {**body, "stream": True, "stream_options": options}
            with http.stream("POST", path, json=streamed) as response:
                assert response.status_code == 200, response.read()
                chunks = _sse_chunks(response)
            usages = [chunk["usage"] for chunk in chunks]
            assert all(u is not None for u in usages), "continuous_usage_stats: usage in every chunk"
            generated = [u["completion_tokens"] for u in usages]
            assert generated == sorted(generated) and generated[-1] == 12, generated
            assert len(set(generated)) >= 3, f"the count should grow while the job streams: {generated}"
            prompt_tokens = {u["prompt_tokens"] for u in usages}
            assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0
            assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
            whole = http.post(path, json=body)
            assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 12
        # include_usage alone keeps OpenAI's shape: one usage chunk at the end, none before it.
        plain = {"model": model, "messages": MESSAGES, "max_tokens": 4, "stream": True,
                 "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=plain) as response:
            chunks = _sse_chunks(response)
        assert [c.get("usage") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


def test_vllm_text_options_reach_the_engine(embedded: Server) -> None:
    """include_stop_str_in_output keeps the matched stop string; skip_special_tokens is stored for the
    engine only when it differs from the default."""
    client = embedded.client()
    full = client.completions.create(model=embedded.model, prompt="The queue", **GREEDY).choices[0].text
    stop = full[4:7]
    assert len(stop) == 3 and full.find(stop) >= 1
    body = {**GREEDY, "stop": [stop]}
    cut = client.completions.create(model=embedded.model, prompt="The queue", **body)
    extra = {**GREEDY["extra_body"], "include_stop_str_in_output": True, "skip_special_tokens": False}
    kept = client.completions.create(model=embedded.model, prompt="The queue",
                                     **{**body, "extra_body": extra})
    assert cut.choices[0].text == full[: full.find(stop)]
    assert kept.choices[0].text == full[: full.find(stop) + len(stop)]
    params = embedded.job(job_id_of(kept.id)).params
    assert params["include_stop_str_in_output"] is True and params["skip_special_tokens"] is False
    assert "skip_special_tokens" not in embedded.job(job_id_of(cut.id)).params
