"""JobRunner against Postgres and an in-process EngineHost on the tiny demo model: claim, outcome, cancel of a
running job (aborted in the engine, KV blocks freed), timeout, invalid input, duplicates, shutdown requeue."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

import conveyor.worker.outcome_writer
from conveyor.core.clock import utcnow
from conveyor.core.store import jobs, keys, tenants
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.host import EngineHost
from conveyor.worker.job_runner import JobRunner
from tests.support.live_server import wait_for
from tests.support.service import RecordingPublisher
from tests.support.worker import LONG_JOB_TOKENS, add_job, get_job, lane, wait_generating


@pytest.fixture(scope="module")
def host(worker_model_dir: Path) -> Iterator[EngineHost]:
    config = EngineConfig(model=str(worker_model_dir), max_num_seqs=8, num_kv_blocks=512, request_classes=[
        RequestClassConfig("interactive", max_running=8, priority=0),
        RequestClassConfig("documents", max_running=2, priority=1),
    ])
    engine_host = EngineHost.from_config(config)
    yield engine_host
    engine_host.shutdown()


@pytest.fixture
def runner(host: EngineHost, sessions: sessionmaker[Session]) -> Iterator[JobRunner]:
    job_runner = JobRunner(host, sessions, "test-worker", cancel_poll_s=0.05)
    job_runner.start()
    yield job_runner
    job_runner.shutdown(grace_s=0.0, publish=None)
    wait_for(lambda: _kv_free(host), "the engine to free every KV block", timeout_s=30)


class Done:
    """An on_done callback that counts its calls (the caller's 'ack')."""

    def __init__(self) -> None:
        self.calls = 0
        self.event = threading.Event()

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()

    def wait(self) -> None:
        assert self.event.wait(60), "on_done was never called"


def _kv_free(host: EngineHost) -> bool:
    stats: dict[str, Any] = host.stats()
    return stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_runs_a_claimed_job_and_stores_result_usage_and_timestamps(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "Good morning! How are you", max_tokens=10)
    done = Done()

    assert runner.run(job_id, done)
    done.wait()

    job = get_job(sessions, job_id)
    assert job.status == "succeeded" and job.finish_reason in ("stop", "length")
    assert job.attempts == 1 and job.worker_id == "test-worker"
    assert job.completion_tokens is not None and 1 <= job.completion_tokens <= 10
    assert job.prompt_tokens is not None and job.prompt_tokens > 0
    assert job.started_at is not None and job.first_token_at is not None and job.finished_at is not None
    assert done.calls == 1


def test_a_job_whose_prompt_prefix_is_cached_stores_its_cached_tokens(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    prefix = " ".join(f"rule {i}: keep the queue moving" for i in range(20))
    first_id = add_job(sessions, prefix + " First.", max_tokens=3)
    second_id = add_job(sessions, prefix + " Second.", max_tokens=3)
    for job_id in (first_id, second_id):  # one after the other: the second finds the first's blocks
        done = Done()
        assert runner.run(job_id, done)
        done.wait()
    first, second = get_job(sessions, first_id), get_job(sessions, second_id)
    assert first.cached_tokens == 0, "nothing shared this prefix before"
    assert second.prompt_tokens is not None and 16 <= second.cached_tokens < second.prompt_tokens
    assert second.cached_tokens % 16 == 0, "whole KV blocks of the shared prefix"


def test_a_cached_prefix_is_shared_within_a_tenant_or_a_namespace_and_never_across(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        for tenant_id in ("tenant-a", "tenant-b"):
            keys.ensure_tenant(session, tenant_id, utcnow())
        for tenant_id in ("team-1", "team-2"):
            tenants.set_overrides(session, tenant_id, {"cache_namespace": "team"}, utcnow())
        session.commit()
    secret = " ".join(f"clause {i}: the merger closes on friday" for i in range(20))
    order = ["tenant-b", "tenant-a", "tenant-b", "team-1", "team-2"]
    ids = [add_job(sessions, secret, max_tokens=2, tenant_id=tenant_id) for tenant_id in order]
    for job_id in ids[:4]:  # one after the other: each finds what the earlier ones cached
        done = Done()
        assert runner.run(job_id, done)
        done.wait()
    done = Done()
    assert len(runner.run_next(lane("interactive"), [done])) == 1, "the fair claim salts its jobs too"
    done.wait()
    b, a, b_again, team_1, team_2 = (get_job(sessions, job_id).cached_tokens for job_id in ids)
    assert (b, a, team_1) == (0, 0, 0), "another tenant's blocks are not hits, nor are unsalted ones"
    assert b_again is not None and b_again >= 16, "a tenant still hits its own prefix"
    assert team_2 == b_again, "tenants of one namespace hit each other's prefix"


def test_a_duplicate_message_is_dropped_and_never_runs_twice(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "Numbers: 1 2 3", max_tokens=4)
    first = Done()
    assert runner.run(job_id, first)
    assert not runner.run(job_id, Done())  # the job is running: the second message is not ours to run
    first.wait()
    assert not runner.run(job_id, Done())  # and once it is done, neither
    assert get_job(sessions, job_id).attempts == 1


def test_cancel_of_a_running_job_aborts_it_in_the_engine_and_frees_its_kv_blocks(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "The model reads the prompt", "documents", max_tokens=LONG_JOB_TOKENS,
                     ignore_eos=True)
    done = Done()
    assert runner.run(job_id, done)
    wait_generating(sessions, job_id)
    aborted_before = host.stats()["totals"]["aborted_requests"]  # type: ignore[index]

    with sessions() as session:
        assert jobs.cancel(session, job_id, "default", utcnow()) is not None
    done.wait()

    wait_for(lambda: _kv_free(host), "the cancelled job's KV blocks to be freed", timeout_s=30)
    assert host.stats()["totals"]["aborted_requests"] == aborted_before + 1  # type: ignore[index]
    job = get_job(sessions, job_id)
    assert job.status == "cancelled" and job.result_text is None and job.completion_tokens is None
    assert runner.num_running == 0


def test_a_job_running_past_its_timeout_fails_with_code_timeout(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "A block table maps", "documents", max_tokens=LONG_JOB_TOKENS, ignore_eos=True,
                     timeout_s=0.3)
    done = Done()
    assert runner.run(job_id, done)
    done.wait()

    job = get_job(sessions, job_id)
    assert job.status == "failed" and job.error_code == "timeout", (job.status, job.error_code)
    assert job.result_text is None
    wait_for(lambda: _kv_free(host), "the timed-out job's KV blocks to be freed", timeout_s=30)


def test_parameters_the_engine_rejects_fail_the_job_as_invalid_request(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "Hello", max_tokens=5000)  # over the model's 4096 positions
    done = Done()
    assert runner.run(job_id, done)
    done.wait()

    job = get_job(sessions, job_id)
    assert job.status == "failed" and job.error_code == "invalid_request"
    assert job.error_message is not None and "max_tokens" in job.error_message


def test_params_that_cannot_be_read_fail_only_their_job_as_invalid_request(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    unreadable = add_job(sessions, "Hello", max_tokens=2, logprobs="all")
    fine = add_job(sessions, "Hi", max_tokens=2)
    done = [Done(), Done()]
    assert runner.run_many([(unreadable, done[0]), (fine, done[1])]) == [True, True]
    for d in done:
        d.wait()

    job = get_job(sessions, unreadable)
    assert job.status == "failed" and job.error_code == "invalid_request"
    assert job.error_message is not None and job.error_message.startswith("logprobs: ")
    assert get_job(sessions, fine).status == "succeeded"


def test_a_grammar_that_cannot_be_compiled_fails_its_job_as_invalid_request(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "Hello", max_tokens=5, structured={"regex": "(unclosed"})
    done = Done()
    assert runner.run(job_id, done)  # submitted at once: the refusal comes from the compile thread
    done.wait()

    job = get_job(sessions, job_id)
    assert job.status == "failed" and job.error_code == "invalid_request", job.error_message
    assert job.error_message is not None and "structured.regex cannot be compiled" in job.error_message


def test_a_job_waiting_for_its_grammar_takes_no_room_in_its_queue(
    host: EngineHost, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    compile_now = host._grammars._compile

    def held(seq: Any) -> None:
        assert release.wait(60)
        compile_now(seq)

    monkeypatch.setattr(host._grammars, "_compile", held)
    runner = JobRunner(host, sessions, "compiling-worker", limits={lane("interactive"): 1},
                       cancel_poll_s=0.05)
    runner.start()
    try:
        schema = {"type": "object", "properties": {"waits": {"type": "integer"}}, "required": ["waits"]}
        constrained = add_job(sessions, "The queue holds", max_tokens=20, structured={"json_schema": schema})
        constrained_done = Done()
        assert runner.run(constrained, constrained_done)
        assert runner.has_room(lane("interactive")), "a job waiting for its grammar holds no slot"
        plain, plain_done = add_job(sessions, "Good morning", max_tokens=3), Done()
        assert runner.run(plain, plain_done)
        plain_done.wait()
        assert get_job(sessions, plain).status == "succeeded"
        assert get_job(sessions, constrained).status == "running" and not constrained_done.event.is_set()
        release.set()
        constrained_done.wait()
        assert get_job(sessions, constrained).status == "succeeded"
    finally:
        release.set()
        runner.shutdown(grace_s=0.0, publish=None)
        wait_for(lambda: _kv_free(host), "the engine to free every KV block", timeout_s=30)


def test_chat_messages_are_rendered_with_the_model_chat_template(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    messages = [{"role": "user", "content": "Write a haiku about queues."}]
    job_id = add_job(sessions, None, messages=messages, max_tokens=6)
    done = Done()
    assert runner.run(job_id, done)
    done.wait()

    job = get_job(sessions, job_id)
    assert job.status == "succeeded"
    assert job.prompt_tokens == len(host.tokenizer.apply_chat_template(messages))


def test_shutdown_requeues_and_republishes_jobs_that_do_not_finish_in_the_grace_period(
    host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    runner = JobRunner(host, sessions, "stopping-worker", cancel_poll_s=0.05)
    runner.start()
    job_id = add_job(sessions, "Children play in the park", "documents", max_tokens=LONG_JOB_TOKENS,
                     ignore_eos=True)
    done = Done()
    assert runner.run(job_id, done)
    wait_generating(sessions, job_id)
    publisher = RecordingPublisher()

    requeued = runner.shutdown(grace_s=0.0, publish=publisher.publish)

    assert requeued == [job_id] and done.calls == 1
    assert publisher.published == [(job_id, lane("documents"))]
    job = get_job(sessions, job_id)
    assert job.status == "queued" and job.attempts == 1 and job.worker_id is None
    assert job.dispatched_at is not None
    wait_for(lambda: _kv_free(host), "the requeued job's KV blocks to be freed", timeout_s=30)


def test_the_per_queue_hold_admits_at_most_max_running_jobs_of_a_queue(
    host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    runner = JobRunner(host, sessions, "held-worker", limits={lane("documents"): 1, lane("interactive"): 2},
                       cancel_poll_s=0.05)
    runner.start()
    try:
        long_job = add_job(sessions, "Keys and values", "documents", max_tokens=LONG_JOB_TOKENS,
                           ignore_eos=True)
        done = Done()
        assert runner.has_room(lane("documents")) and runner.has_room(lane("interactive"))
        assert runner.run(long_job, done)
        wait_generating(sessions, long_job)

        assert not runner.has_room(lane("documents"))  # its one slot is taken ...
        assert not runner.wait_for_room(lane("documents"), 0.05)
        assert runner.has_room(lane("interactive"))  # ... while another queue keeps its own
        assert runner.has_room("no-limit")  # a queue without a limit is never held

        waiter = threading.Thread(target=lambda: runner.wait_for_room(lane("documents"), 60))
        waiter.start()
        with sessions() as session:
            jobs.cancel(session, long_job, "default", utcnow())
        done.wait()
        waiter.join(60)
        assert not waiter.is_alive() and runner.has_room(lane("documents"))  # the slot came back with the job

        choices = add_job(sessions, "Keys and values", "interactive", max_tokens=LONG_JOB_TOKENS,
                          ignore_eos=True, n=2)
        done = Done()
        assert runner.run(choices, done)
        wait_generating(sessions, choices)
        assert not runner.has_room(lane("interactive"))  # its two choices take both places
        with sessions() as session:
            jobs.cancel(session, choices, "default", utcnow())
        done.wait()
    finally:
        runner.shutdown(grace_s=0.0, publish=None)
        wait_for(lambda: _kv_free(host), "the engine to free every KV block", timeout_s=30)


class OutageStore:
    """Sessions that raise as an unreachable database does while `down` is set."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self._sessions = sessions
        self.down = threading.Event()

    def __call__(self) -> Session:
        if self.down.is_set():
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError("the database is down"))
        return self._sessions()


def test_an_outcome_waits_out_a_store_outage_of_any_length_and_keeps_the_slot_meanwhile(
    host: EngineHost, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conveyor.worker.outcome_writer, "STORE_RETRY_FIRST_WAIT_S", 0.01)
    # many retries, quickly
    monkeypatch.setattr(conveyor.worker.outcome_writer, "STORE_RETRY_MAX_WAIT_S", 0.05)
    store = OutageStore(sessions)
    runner = JobRunner(host, store, "outage-worker", limits={lane("interactive"): 1},  # type: ignore[arg-type]
                       cancel_poll_s=0.05)
    runner.start()
    try:
        job_id = add_job(sessions, "Outages end", max_tokens=8)
        done = Done()
        assert runner.run(job_id, done)
        store.down.set()
        wait_for(lambda: _kv_free(host), "the engine to finish the job", timeout_s=30)
        time.sleep(1.0)  # dozens of failed writes: a fixed retry budget would have given up by now

        assert done.calls == 0 and not runner.has_room(lane("interactive"))  # held, not dropped
        assert get_job(sessions, job_id).status == "running"
        store.down.clear()
        done.wait()
        assert get_job(sessions, job_id).status == "succeeded"
    finally:
        store.down.clear()
        runner.shutdown(grace_s=0.0, publish=None)


def test_two_attempts_of_one_job_are_held_apart_and_the_superseded_one_is_aborted(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    job_id = add_job(sessions, "The same job twice", "documents", max_tokens=LONG_JOB_TOKENS, ignore_eos=True)
    first, second = Done(), Done()
    assert runner.run(job_id, first)
    wait_generating(sessions, job_id)
    with sessions() as session:  # requeued behind this worker's back (it looked dead for a while)
        assert jobs.requeue_orphans(session, [runner.worker_id], utcnow()) == [(job_id, lane("documents"))]
    assert runner.run(job_id, second)  # attempt 2, in the same worker
    # Both are held under their own keys; the watcher (every 50 ms) may already have dropped attempt 1.
    assert {(job_id, 2)} <= runner.held_attempts() <= {(job_id, 1), (job_id, 2)}

    first.wait()  # attempt 1 is no longer the job's: the watcher aborts it, and nothing is written
    assert runner.held_attempts() == {(job_id, 2)}  # attempt 2 keeps its entry, its checks and its slot
    job = get_job(sessions, job_id)
    assert job.status == "running" and job.attempts == 2 and second.calls == 0

    with sessions() as session:
        jobs.cancel(session, job_id, "default", utcnow())
    second.wait()
    assert runner.held_attempts() == set()
    wait_for(lambda: _kv_free(host), "both attempts' KV blocks to be freed", timeout_s=30)


class Finished:
    """A FinishedSink that records each group it hears of."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []

    def finished(self, job_ids: list[str]) -> None:
        self.groups.append(list(job_ids))


def test_jobs_handed_over_together_are_claimed_in_one_statement_and_written_in_few_transactions(
    host: EngineHost, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    claims, steps = _count_calls(monkeypatch, "claim_many"), _count_calls(monkeypatch, "record_step")
    heard = Finished()
    runner = JobRunner(host, sessions, "group-worker", cancel_poll_s=0.05, finished=heard)
    runner.start()
    try:
        ids = [add_job(sessions, f"One token please {i}", max_tokens=1) for i in range(8)]
        done = [Done() for _ in ids]
        assert runner.run_many(list(zip(ids, done, strict=True))) == [True] * 8
        for d in done:
            d.wait()
    finally:
        runner.shutdown(grace_s=0.0, publish=None)

    assert len(claims) == 1  # eight jobs, one claim
    # Eight 1-token jobs finish in the engine step that prefills them (one, or two if the engine thread
    # started before the last was submitted): one write each, not one per job.
    assert 1 <= len(steps) <= 2 and sum(len(outcomes) for _, outcomes in steps) == 8
    assert all(get_job(sessions, job_id).status == "succeeded" for job_id in ids)
    assert sorted(job_id for group in heard.groups for job_id in group) == sorted(ids)


def test_every_claimed_attempt_is_held_before_the_first_is_submitted(
    runner: JobRunner, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit may take a while (a new schema compiles in the claiming thread); meanwhile the reconciler
    must see the group's other claims as held, or it requeues them as lost once dispatch_grace_s passes."""
    ids = [add_job(sessions, f"Held together {i}", max_tokens=1) for i in range(3)]
    seen: list[set[tuple[str, int]]] = []
    submit = runner.host.submit

    def submit_and_look(*args: Any, **kwargs: Any) -> Any:
        seen.append(runner.held_attempts())
        return submit(*args, **kwargs)

    monkeypatch.setattr(runner.host, "submit", submit_and_look)
    done = [Done() for _ in ids]
    assert runner.run_many(list(zip(ids, done, strict=True))) == [True] * 3
    for d in done:
        d.wait()
    assert seen[0] >= {(job_id, 1) for job_id in ids}


def test_a_job_listed_twice_or_not_queued_is_not_started(
    runner: JobRunner, sessions: sessionmaker[Session]
) -> None:
    job_id, gone = add_job(sessions, "Once only", max_tokens=1), add_job(sessions, "Cancelled", max_tokens=1)
    with sessions() as session:
        jobs.cancel(session, gone, "default", utcnow())
    first, again, cancelled = Done(), Done(), Done()

    assert runner.run_many([(job_id, first), (job_id, again), (gone, cancelled)]) == [True, False, False]
    first.wait()
    assert again.calls == 0 and cancelled.calls == 0 and get_job(sessions, job_id).attempts == 1


def test_a_group_whose_write_fails_is_written_one_by_one_and_only_the_culprit_fails(
    host: EngineHost, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = jobs.record_step

    def refuse_groups_with_the_poison(session: Session, first_tokens: Any, outcomes: Any, now: Any,
                                      *rest: Any) -> Any:
        if any(isinstance(o, jobs.Completion) and o.job_id == poison for o in outcomes):
            raise ValueError("this result cannot be stored")  # not the database being away
        return real(session, first_tokens, outcomes, now, *rest)

    monkeypatch.setattr(jobs, "record_step", refuse_groups_with_the_poison)
    runner = JobRunner(host, sessions, "isolating-worker", cancel_poll_s=0.05)
    runner.start()
    try:
        ids = [add_job(sessions, f"Group member {i}", max_tokens=1) for i in range(4)]
        poison = ids[2]
        done = [Done() for _ in ids]
        runner.run_many(list(zip(ids, done, strict=True)))
        for d in done:
            d.wait()
    finally:
        runner.shutdown(grace_s=0.0, publish=None)

    statuses = {job_id: get_job(sessions, job_id) for job_id in ids}
    assert statuses[poison].status == "failed" and statuses[poison].error_code == "engine_error"
    assert "could not store the result" in (statuses[poison].error_message or "")
    assert all(statuses[j].status == "succeeded" for j in ids if j != poison)


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Any]:
    """Wraps jobs.<name>, recording the argument after the session of every call."""
    calls: list[Any] = []
    real = getattr(jobs, name)

    def counted(session: Session, *args: Any) -> Any:
        calls.append(args[:2] if name == "record_step" else args[0])
        return real(session, *args)

    monkeypatch.setattr(jobs, name, counted)
    return calls


def test_a_claim_is_on_its_way_until_its_attempt_is_in_flight(
    runner: JobRunner, sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a claim runs (the store's answer not yet turned into an attempt in flight) the runner says
    since when, so its reconciler leaves that claim's jobs alone; once the attempt is held, it says none."""
    job_id = add_job(sessions, "Numbers: 1 2 3", max_tokens=4)
    seen: list[tuple[object, set[tuple[str, int]]]] = []
    claim_many = jobs.claim_many

    def watched_claim(*args: Any, **kwargs: Any) -> Any:
        seen.append((runner.claims_since(), runner.held_attempts()))
        return claim_many(*args, **kwargs)

    monkeypatch.setattr(jobs, "claim_many", watched_claim)
    done = Done()
    assert runner.claims_since() is None
    assert runner.run(job_id, done)
    assert runner.claims_since() is None  # the attempt is in flight (or already done)
    (since, held), = seen
    assert since is not None and since <= utcnow() and (job_id, 1) not in held
    done.wait()


def _totals(host: EngineHost) -> Any:
    return host.stats()["totals"]


def test_a_job_with_n_choices_computes_its_prompt_once_and_stores_every_choice(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    # Several KV blocks, never seen before (no earlier test cached them).
    prompt = uuid.uuid4().hex + " ".join(f"choice {i}: one prompt, many answers" for i in range(24))
    job_id = add_job(sessions, prompt, max_tokens=6, temperature=1.0, seed=7, n=3, ignore_eos=True)
    before = _totals(host)
    done = Done()
    assert runner.run(job_id, done)
    done.wait()
    job = get_job(sessions, job_id)
    assert job.status == "succeeded" and job.choices is not None and job.prompt_tokens is not None
    assert [c["index"] for c in job.choices] == [0, 1, 2]
    assert job.result_text == job.choices[0]["text"] and job.finish_reason == job.choices[0]["finish_reason"]
    assert job.completion_tokens == sum(c["completion_tokens"] for c in job.choices) == 18
    assert len({c["text"] for c in job.choices}) > 1, "each choice samples with its own seed"
    computed = _totals(host)["prefill_tokens"] - before["prefill_tokens"]
    # Choice 0 computes the prompt; the others find its full blocks cached and compute its last block (a
    # partial one, or a whole one when the prompt ends on a block boundary: a request computes its last
    # token itself).
    assert job.prompt_tokens <= computed <= job.prompt_tokens + 2 * 16, computed


def test_n_choices_with_a_seed_repeat_and_a_cancel_aborts_them_all(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    texts = []
    for _ in range(2):
        job_id = add_job(sessions, "The river is calm", max_tokens=5, temperature=1.0, seed=3, n=2)
        done = Done()
        assert runner.run(job_id, done)
        done.wait()
        texts.append([c["text"] for c in get_job(sessions, job_id).choices or []])
    assert texts[0] == texts[1] and len(texts[0]) == 2
    job_id = add_job(sessions, "The river is calm", max_tokens=LONG_JOB_TOKENS, ignore_eos=True, n=3)
    done = Done()
    assert runner.run(job_id, done)
    wait_generating(sessions, job_id)
    with sessions() as session:
        jobs.cancel(session, job_id, "default", utcnow())
    done.wait()
    assert get_job(sessions, job_id).status == "cancelled"
    wait_for(lambda: _kv_free(host), "every choice aborted and its KV blocks freed", timeout_s=30)


def test_a_jobs_priority_and_deadline_reach_the_engine(
    runner: JobRunner, host: EngineHost, sessions: sessionmaker[Session]
) -> None:
    new = jobs.NewJob(tenant_id="default", queue=lane("interactive"), prompt="The river is calm",
                      messages=None,
                      params={"max_tokens": LONG_JOB_TOKENS, "ignore_eos": True, "temperature": 0.0},
                      meta=None, webhook=None, idempotency_key=None, request_hash="t", prompt_tokens=0,
                      ttl_s=None, timeout_s=None, priority=-7, deadline_s=30.0)
    with sessions() as session:
        job = jobs.add(session, new, utcnow())
    done = Done()
    assert runner.run(job.id, done)
    wait_generating(sessions, job.id)
    seq = host.engine.scheduler.get(f"{job.id}#1")
    assert seq is not None and job.deadline_at is not None
    assert (seq.urgency.priority, seq.urgency.deadline) == (-7, job.deadline_at.timestamp())
    with sessions() as session:
        jobs.cancel(session, job.id, "default", utcnow())
    done.wait()
