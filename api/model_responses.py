"""Answers serialized straight from a pydantic model, for the hot routes.

A route that returns a model has FastAPI validate it against its `response_model` again, then encode it in
two passes (to JSON-able values, then `json.dumps`); a Response returned as is skips all three. The route
still declares its `response_model`, which is what the OpenAPI document shows.
"""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import Response


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")
