"""`conveyor bench` (also `python -m conveyor.bench`): seeded workloads run against the engine in-process or
against a running service, per-group metrics, decision sheets for one-parameter changes, and side-by-side
throughput against Hugging Face transformers.

The bench depends on `engine` (and on `kernels` for the kernel bench), never on the internals of `api/` or
`worker/`: the HTTP target talks to the service over HTTP only (httpx). Plots need the `bench` extra
(matplotlib). Entry points: `conveyor.bench.cli.main(argv)`; `python -m conveyor.bench.kernels`, the kernels'
GPU check.
"""

from __future__ import annotations
