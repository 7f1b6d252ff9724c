"""A background response survives a restart of the one-process service (`conveyor serve`, SQLite): created
`queued` (due a few seconds later), the process SIGKILLed while it waits and started again, the same
response then ends `completed` or `incomplete` with its text, polled through the official `openai` SDK."""

from __future__ import annotations

from pathlib import Path

import openai

from tests.support.live_server import wait_for
from tests.support.serve import Serve


def test_a_queued_background_response_survives_a_restart(tmp_path: Path, demo_model_dir: Path) -> None:
    with Serve(tmp_path, demo_model_dir, SCHEDULE_POLL_S="0.2") as serve:
        serve.start()
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0)
        created = client.responses.create(model=demo_model_dir.name, input="Still there?", background=True,
                                          max_output_tokens=6, extra_body={"delay_s": 3})
        assert client.responses.retrieve(created.id).status == "queued"
        serve.kill()
        serve.start()
        assert client.responses.retrieve(created.id).status in ("queued", "in_progress", "completed",
                                                                "incomplete")
        wait_for(lambda: client.responses.retrieve(created.id).status in ("completed", "incomplete"),
                 "the response to end after the restart")
        done = client.responses.retrieve(created.id)
        assert done.output_text and done.usage is not None and done.usage.output_tokens > 0
