"""OpenAI-shaped objects built from a plain generation result: `chat.completion` and `text_completion`
bodies, and batch output and error lines. Shared by the batch writer and the HTTP chat/completions routes."""

from __future__ import annotations

from typing import Any

from api.openai_format import (  # noqa: F401 (re-exported: the builders moved to api/ for the HTTP routes)
    FINISH_REASONS,
    GenerationResult,
    chat_completion,
    new_id,
    text_completion,
    usage,
)


def batch_result_line(custom_id: str, body: dict[str, Any], *, line_id: str, request_id: str,
                      ) -> dict[str, Any]:
    """One line of the batch output file for a request that ran."""
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def batch_error_line(custom_id: str | None, *, line: int, code: str, message: str, line_id: str,
                     ) -> dict[str, Any]:
    """One line of the batch error file (also written to the output file, so it has a line per input)."""
    return {"id": line_id, "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}, "line": line}

