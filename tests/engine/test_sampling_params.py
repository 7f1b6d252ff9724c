from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation() -> None:
    params = SamplingParams(stop="###")
    assert params.max_tokens == 16 and params.temperature == 1.0 and not params.greedy
    assert params.stop == ["###"]
    assert SamplingParams(temperature=0).greedy


def test_validate_catches_later_mutation() -> None:
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        params.validate()
