"""lm-evaluation-harness, unmodified, against Conveyor: its `local-completions` backend in its default mode
(token ids; each loglikelihood from `echo` with `logprobs` 1 and `max_tokens` 1) scores a small
multiple-choice task through `conveyor serve` exactly as its own transformers backend (`hf`) scores it on the
same model folder: the same accuracy, and each answer's loglikelihood and greediness.

Both must read the same tokens, and their defaults differ: local-completions sends no BOS unless told to
(`add_bos_token=True`), while hf adds whatever its tokenizer adds by default (a BOS for this Llama tokenizer)
unless told not to. So each local-completions run is compared with the hf run that reads the same ids: the
default one (no BOS) with hf's `add_bos_token=False`, and `add_bos_token=True` with hf's default; Conveyor
adds nothing to token ids, so both agree. The second run sends four prompts a request (`batch_size` 4):
lm-eval reads each answer back by its choice's `index`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import Serve

TASK = "conveyor_tiny_mc"
EXAMPLES = [
    {"question": "Which queue takes short prompts?", "choices": ["interactive", "documents", "neither"],
     "answer": 0},
    {"question": "What does a worker host?", "choices": ["one engine", "a database", "a broker"],
     "answer": 0},
    {"question": "Where are jobs kept?", "choices": ["in the store", "in the cache"], "answer": 0},
    {"question": "What holds a queue back?", "choices": ["admission control", "luck", "its colour", "rain"],
     "answer": 0},
]
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {examples}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@dataclass(frozen=True)
class Scores:
    acc: float
    answers: list[list[tuple[float, bool]]]  # per example, per choice: (loglikelihood, greedy)


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    """A local multiple-choice task: its YAML and its examples as JSONL (read by `datasets`, offline)."""
    folder = tmp_path / "tasks"
    folder.mkdir()
    examples = folder / "examples.jsonl"
    examples.write_text("".join(json.dumps(example) + "\n" for example in EXAMPLES))
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, examples=examples))
    return folder


@pytest.fixture
def serve(tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Serve]:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # nothing is fetched: the task and model are local
        monkeypatch.setenv(name, "1")
    with Serve(tmp_path, demo_model_dir) as server:
        server.start()
        yield server


def _scores(task_dir: Path, model: str, model_args: dict[str, Any], batch_size: int = 1) -> Scores:
    """lm-eval's own evaluation (simple_evaluate, as its CLI runs it), the task's accuracy and samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=tasks,
                                      batch_size=batch_size, device="cpu", log_samples=True)
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    answers = [[(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]] for sample in samples]
    return Scores(results["results"][TASK]["acc,none"], answers)


def test_lm_eval_scores_through_conveyor_as_its_transformers_backend(serve: Serve, task_dir: Path,
                                                                       demo_model_dir: Path) -> None:
    served = {"base_url": f"{serve.url}/v1/completions", "model": demo_model_dir.name,
              "tokenizer": str(demo_model_dir)}
    local = {"pretrained": str(demo_model_dir), "dtype": "float32"}
    runs = [({}, {"add_bos_token": False}, 1), ({"add_bos_token": True}, {}, 4)]  # the same ids, two ways
    for served_extra, local_extra, prompts_a_request in runs:
        through_conveyor = _scores(task_dir, "local-completions", {**served, **served_extra},
                                   prompts_a_request)
        transformers = _scores(task_dir, "hf", {**local, **local_extra})
        assert through_conveyor.acc == transformers.acc, (served_extra, local_extra)
        for ours, theirs in zip(through_conveyor.answers, transformers.answers, strict=True):
            assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-4), served_extra
            assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs], served_extra
    assert len(through_conveyor.answers) == len(EXAMPLES)
