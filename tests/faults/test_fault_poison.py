"""One poison request among twelve running together: only the poison fails, and the engine keeps serving.

The poison must pass the API's validation and fail in the engine. Candidates, in order:

1. `top_k` 2**70, sampled with top_p 0.9: the original poison (the sampler cannot make a tensor of it, so
   the whole engine step failed). Once the API bounds top_k it is refused with a 4xx naming the field,
   which this test asserts (the root cause is bounded), and the next candidate is tried;
2. `seed` 2**70: torch refuses it when the engine builds the request's generator; a 4xx once bounded;
3. a prompt plus `max_tokens` longer than the model's context (4096 positions): refused at submit since
   requests are judged against the model's context (422 naming max_tokens);
4. a JSON Schema whose `pattern` uses a lookbehind: a valid JSON Schema, so the API (which checks schemas
   against their meta-schema but loads no grammar compiler) accepts it, and the engine's grammar compiler
   refuses it when the worker submits the request.

The first candidate the API accepts is the poison.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from tests.support.fault_stack import Stack
from tests.support.fault_store import SETTLE_S
from tests.support.faults import check_exactly_once, describe, wait_final, wait_generating
from tests.support.traffic import long_job, short_job

pytestmark = pytest.mark.faults

HUGE = 2**70  # 1180591620717411303424
TOGETHER = 11  # good jobs running with the poison
MODEL_POSITIONS = 4096  # the suite's demo model (fault_model_dir)
LOOKBEHIND = {"type": "string", "pattern": "(?<=a)b"}  # valid JSON Schema; xgrammar refuses it
UNCOMPILABLE = {"type": "json_schema", "json_schema": {"name": "p", "schema": LOOKBEHIND}}


def _candidates() -> list[tuple[str, dict[str, Any]]]:
    return [
        # Sampled (greedy rows skip top-k/top-p), with top_p < 1 so the sampler builds its top-k tensor.
        ("top_k", long_job("poison: top_k", 400, top_k=HUGE, temperature=1.0, top_p=0.9)),
        ("seed", long_job("poison: seed", 400, seed=HUGE, temperature=1.0)),
        ("max_tokens", long_job("poison: longer than the model's context " * 4, MODEL_POSITIONS,
                                queue="documents")),
        ("response_format", long_job("poison: a pattern the grammar compiler cannot parse", 400,
                                     response_format=UNCOMPILABLE)),
    ]


def test_one_poison_among_twelve_running_together_only_the_poison_fails(stack: Stack) -> None:
    stack.start_worker()
    traffic = stack.traffic(rate=1, prefix="poison")
    good = [traffic.submit(long_job(f"together {i}: the small boats go slowly", 400)).job_id
            for i in range(TOGETHER)]
    wait_generating(stack.store, good)

    poison: str | None = None
    refused: list[str] = []
    for field_name, body in _candidates():
        sub = traffic.submit(body)
        if sub.job_id is not None:
            poison = sub.job_id
            break
        status = sub.codes[-1]
        assert isinstance(status, int) and 400 <= status < 500, (
            f"poison candidate {field_name}: expected 2xx or a 4xx refusal, got {sub.codes}")
        refused.append(field_name)
        if field_name == "top_k":  # the root cause is bounded at the API: the refusal must name the field
            assert "top_k" in json.dumps(sub.refusal), f"the 4xx for top_k should name it: {sub.refusal}"
    assert stack.store.jobs(good) and all(j.status == "running" for j in stack.store.jobs(good).values()), (
        "the good jobs should still be running when the poison arrives")

    expect = {}
    if poison is not None:
        expect[poison] = {"failed"}
        rows = wait_final(stack.store, [*good, poison], SETTLE_S)
        assert rows[poison].status == "failed", (
            f"the poison (after {refused} were refused) should fail in the engine: {describe(rows[poison])}")
        failed_good = [j for j in good if rows[j].status != "succeeded"]
        assert not failed_good, (
            f"the poison ({poison}, {rows[poison].status} {rows[poison].error_code}: "
            f"{rows[poison].error_message}) took {len(failed_good)} of the {TOGETHER} jobs running with it "
            f"down: {[(rows[j].status, rows[j].error_code, rows[j].error_message) for j in failed_good][:3]}")
    else:
        warnings.warn(f"every poison candidate was refused at the API ({refused}): isolation not exercised",
                      stacklevel=1)

    # The engine still serves after the poison.
    after = [traffic.submit(short_job(f"after {i}", 8)).job_id for i in range(2)]
    wait_final(stack.store, after, SETTLE_S)
    check_exactly_once(stack.store, traffic.accepted(), within_s=60, max_attempts=1, stack=stack,
                       expect=expect)
