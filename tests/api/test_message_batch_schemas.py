"""A Message Batch's create body (api/schemas/message_batches.py): Anthropic's custom_id rules (1 to 64 of
[a-zA-Z0-9_-], unique within the batch) and its request limits, judged before anything is stored; each
request's params are not judged here (its line is, when read)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.api.schemas.message_batches import MAX_REQUESTS, MessageBatchCreate


def _create(*custom_ids: str, params: Any = None) -> MessageBatchCreate:
    sent = {} if params is None else params
    requests = [{"custom_id": custom_id, "params": sent} for custom_id in custom_ids]
    return MessageBatchCreate.model_validate({"requests": requests})


@pytest.mark.parametrize("custom_id", ["a", "A-z_0-9", "x" * 64, "-", "_"])
def test_custom_ids_anthropic_accepts(custom_id: str) -> None:
    assert _create(custom_id).requests[0].custom_id == custom_id


@pytest.mark.parametrize("custom_id", ["", "x" * 65, "has space", "dot.ted", "slash/", "é", "a\n", "a\x00"])
def test_custom_ids_anthropic_refuses(custom_id: str) -> None:
    with pytest.raises(ValidationError) as refused:
        _create(custom_id)
    assert refused.value.errors()[0]["loc"] == ("requests", 0, "custom_id")


def test_a_duplicate_custom_id_refuses_the_whole_batch_naming_both_requests() -> None:
    with pytest.raises(ValidationError, match=r"requests\[3\]\.custom_id: 'b' is already the custom_id of "
                                              r"requests\[1\]"):
        _create("a", "b", "c", "b")
    assert len(_create("a", "B", "b").requests) == 3  # case matters


def test_params_are_an_object_kept_as_sent() -> None:
    params = {"model": "m", "max_tokens": 4, "messages": [], "anything": {"judged": "later"}}
    assert _create("a", params=params).requests[0].params == params
    with pytest.raises(ValidationError):
        _create("a", params=["not", "an", "object"])


def test_one_to_max_requests() -> None:
    with pytest.raises(ValidationError):
        MessageBatchCreate.model_validate({"requests": []})
    assert len(_create(*(f"r{i}" for i in range(MAX_REQUESTS))).requests) == MAX_REQUESTS
    with pytest.raises(ValidationError, match="at most 100000"):
        _create(*(f"r{i}" for i in range(MAX_REQUESTS + 1)))
    with pytest.raises(ValidationError):
        MessageBatchCreate.model_validate({"requests": [{"custom_id": "a", "params": {}}], "extra": 1})
