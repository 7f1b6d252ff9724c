"""Running JSONL lines as a batch through the official SDK's Files and Batches calls, for tests that compare a
batch line's answer with the synchronous route's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import openai

from tests.support.live_server import wait_for


@dataclass(frozen=True)
class BatchAnswers:
    outputs: dict[str, dict[str, Any]]  # custom_id -> the response body of a line that ran
    errors: str  # the error file's text


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str) -> BatchAnswers:
    """Uploads the lines, runs them as one batch to completion, and reads its output and error files."""
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("lines.jsonl", data), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), f"batch {batch.id}")
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", done
    outputs = {}
    if done.output_file_id:
        for raw in client.files.content(done.output_file_id).text.splitlines():
            line = json.loads(raw)
            if line["response"] is not None:
                outputs[line["custom_id"]] = line["response"]["body"]
    errors = client.files.content(done.error_file_id).text if done.error_file_id else ""
    return BatchAnswers(outputs, errors)
