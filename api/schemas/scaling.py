"""The scaling signal's body: per queue, the figures an autoscaler (KEDA's metrics-api trigger) reads."""

from __future__ import annotations

from pydantic import BaseModel, Field


class QueueScaling(BaseModel):
    queued: int = Field(description="jobs waiting for a worker")
    running: int = Field(description="jobs a worker holds (claimed, not finished)")
    load: int = Field(description="queued + running, counted in the store: the value to scale on")
    workers: int = Field(description="live workers consuming this queue")
    max_running: int = Field(description="jobs of this queue one worker runs at once (its setting)")


class Scaling(BaseModel):
    queues: dict[str, QueueScaling] = Field(description="every configured queue, idle ones included")
