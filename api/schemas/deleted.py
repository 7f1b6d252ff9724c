"""The answer to a DELETE: OpenAI's deletion object (`client.files.delete` reads it), for every resource."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class Deleted(BaseModel):
    id: str
    object: Literal["job", "file", "batch"]
    deleted: Literal[True] = True
