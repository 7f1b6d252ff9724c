"""worker/engine_requests.py: a completion's prompts as engine requests, choice c of prompt p at p * n + c
(its `index` in the answer), token ids as sent; each prompt's first choice scores it, each choice its own
seed."""

from __future__ import annotations

from conveyor.engine.sampling_params import SamplingParams
from conveyor.worker.engine_requests import generation_requests


def test_n_choices_of_each_prompt_in_answer_order() -> None:
    params = SamplingParams(max_tokens=1, seed=7, prompt_logprobs=1, logprobs=1)
    requests = generation_requests([[5, 6], "text", [7]], params, 2)
    assert requests.prompts == [[5, 6], [5, 6], "text", "text", [7], [7]]  # nothing added to the ids
    assert [each.seed for each in requests.params] == [7, 8] * 3  # as each prompt would alone
    assert [each.prompt_logprobs for each in requests.params] == [1, None] * 3  # its first choice scores it
    assert len(requests) == 6
