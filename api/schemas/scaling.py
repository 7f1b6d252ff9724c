"""The scaling signal's body: per model and queue, the figures an autoscaler (KEDA's metrics-api trigger)
reads."""

from __future__ import annotations

from pydantic import BaseModel, Field


class QueueScaling(BaseModel):
    queued: int = Field(description="jobs waiting for a worker")
    running: int = Field(description="jobs a worker holds (claimed, not finished)")
    load: int = Field(description="queued + running, counted in the store: the value to scale on")
    workers: int = Field(description="live workers consuming this queue")
    max_running: int = Field(description="jobs of this queue one worker runs at once (its setting)")


class ModelScaling(BaseModel):
    load: int = Field(description="queued + running jobs of every queue of the model: what its workers "
                      "(one pool per model) scale on, down to zero")
    queues: dict[str, QueueScaling] = Field(description="each of the model's queues, idle ones included")


class Scaling(BaseModel):
    models: dict[str, ModelScaling] = Field(
        description="every served model (KEDA: `models.<id>.load`, or `models.<id>.queues.<name>.load` "
        "for a pool per queue; a `.` in an id is written `\\.` in the path)")
    queues: dict[str, QueueScaling] = Field(
        description="each queue name summed over the models (`workers`: per-model pools added up; "
        "`max_running`: the default model's), idle ones included: one model's deployment scales on "
        "`queues.<name>.load` as before")
