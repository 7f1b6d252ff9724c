"""A job's kind: what it asks of its model. A generation job writes text from a prompt or chat messages; an
embedding job returns one vector per input. A model serves one kind (core/protocol/model_task.py): an
embedding model never shares an engine with a generation model."""

from __future__ import annotations

from typing import Literal

from conveyor.core.protocol.model_task import Task

GENERATION, EMBEDDING = "generation", "embedding"
JobKind = Literal["generation", "embedding"]
JOB_KINDS = (GENERATION, EMBEDDING)
TASK_OF_KIND: dict[str, Task] = {GENERATION: "generate", EMBEDDING: "embed"}  # the model task each needs
