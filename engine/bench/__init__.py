"""`conveyor bench`: seeded workloads against the engine in-process or a running service, per-group metrics,
decision sheets for one-parameter changes, and side-by-side throughput against Hugging Face transformers.

Entry point: `engine.bench.cli.main(argv)` (also `python -m engine.bench`). Imports nothing from api/ or
worker/;
the HTTP target speaks to the service through httpx only.
"""

from __future__ import annotations
