"""A request body the OpenAI rules refuse, naming the field: each door answers it its own way (the API a 400
or 404, a batch an error line)."""

from __future__ import annotations

from typing import Literal

# What a refusal is; each path turns it into its own answer (api/routes/openai.py: 400 or 404; a batch: a
# line error code).
RefusalKind = Literal["invalid", "unsupported", "model_not_found"]


class Refusal(ValueError):
    """A body the rules refuse; `param` names the field and `message` starts with it."""

    def __init__(self, kind: RefusalKind, param: str | None, reason: str) -> None:
        self.kind, self.param = kind, param
        self.message = f"{param}: {reason}" if param else reason
        super().__init__(self.message)
