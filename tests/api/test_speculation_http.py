"""Speculative decoding as the API shows it: each model's method on /v1/models, the `speculate` job field
stored as sent, and a job's drafted and accepted tokens in its usage (the jobs API) and in OpenAI's
`usage.completion_tokens_details` (answers and the streamed usage chunk). The store plays the worker's
part."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from conveyor.core.clock import utcnow
from conveyor.core.store import jobs
from tests.support.service import RecordingPublisher, Service

USER = {"role": "user", "content": "Summarize the report."}
DETAILS = {"accepted_prediction_tokens": 9, "rejected_prediction_tokens": 3}


class DraftingWorker(RecordingPublisher):
    """Runs each job to success when it is published, as a worker whose engine drafted `drafted` tokens for
    it and accepted `accepted` of them."""

    def __init__(self, session_factory: sessionmaker[Session], drafted: int, accepted: int) -> None:
        super().__init__()
        self._session_factory, self._drafted, self._accepted = session_factory, drafted, accepted

    def publish(self, job_id: str, queue: str) -> None:
        super().publish(job_id, queue)
        with self._session_factory() as session:
            job = jobs.claim(session, job_id, "drafting-worker", utcnow())
            assert job is not None
            assert jobs.complete(session, job_id, job.attempts, result_text="ok", finish_reason="stop",
                                 prompt_tokens=4, completion_tokens=11, preemptions=0, first_token_at=None,
                                 now=utcnow(), draft_tokens=self._drafted,
                                 accepted_draft_tokens=self._accepted)


def drafting(make_service: Callable[..., Service], session_factory: sessionmaker[Session], drafted: int = 12,
             accepted: int = 9, **settings: Any) -> Service:
    return make_service(publisher=DraftingWorker(session_factory, drafted, accepted), **settings)


def test_each_model_card_says_its_speculation_method(make_service: Callable[..., Service]) -> None:
    plain = make_service().client("alice").get("/v1/models").json()["data"]
    assert [card["speculative"] for card in plain] == [None]
    speculating = make_service(speculative={"method": "suffix", "num_tokens": 6}).client("alice")
    card = speculating.get("/v1/models").json()["data"][0]
    assert card["speculative"] == "suffix"
    assert speculating.get(f"/v1/models/{card['id']}").json()["speculative"] == "suffix"


def test_speculate_is_stored_only_when_turned_off_and_must_be_a_boolean(service: Service) -> None:
    alice = service.client("alice")
    off = alice.post("/v1/jobs", json={"prompt": "x", "speculate": False})
    on = alice.post("/v1/jobs", json={"prompt": "x"})
    assert off.status_code == on.status_code == 202, (off.text, on.text)
    assert service.job(off.json()["id"]).params["speculate"] is False
    assert "speculate" not in service.job(on.json()["id"]).params  # the default keeps the row's shape
    for bad in ("no", 0, None):
        refused = alice.post("/v1/jobs", json={"prompt": "x", "speculate": bad})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["field"] == "speculate"


def test_a_jobs_usage_counts_its_drafted_and_accepted_tokens(
    make_service: Callable[..., Service], session_factory: sessionmaker[Session]
) -> None:
    alice = drafting(make_service, session_factory).client("alice")
    job_id = alice.post("/v1/jobs", json={"prompt": "x", "max_tokens": 11}).json()["id"]
    usage = alice.get(f"/v1/jobs/{job_id}", params={"wait": 10}).json()["usage"]
    assert usage == {"prompt_tokens": 4, "completion_tokens": 11, "cached_tokens": 0, "draft_tokens": 12,
                     "accepted_draft_tokens": 9}


def test_openai_usage_names_accepted_and_rejected_drafts_as_predicted_output_tokens(
    make_service: Callable[..., Service], session_factory: sessionmaker[Session]
) -> None:
    alice = drafting(make_service, session_factory).client("alice")
    chat = alice.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 11})
    text = alice.post("/v1/completions", json={"prompt": "x", "max_tokens": 11})
    assert chat.status_code == text.status_code == 200, (chat.text, text.text)
    for usage in (chat.json()["usage"], text.json()["usage"]):
        assert usage["completion_tokens"] == 11 and usage["completion_tokens_details"] == DETAILS
    streamed = alice.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 11, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200, streamed.text
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens_details"] == DETAILS


def test_openai_usage_has_no_draft_details_when_nothing_was_drafted(
    make_service: Callable[..., Service], session_factory: sessionmaker[Session]
) -> None:
    alice = drafting(make_service, session_factory, drafted=0, accepted=0).client("alice")
    usage = alice.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 11}).json()["usage"]
    assert usage == {"prompt_tokens": 4, "completion_tokens": 11, "total_tokens": 15,
                     "prompt_tokens_details": {"cached_tokens": 0}}
