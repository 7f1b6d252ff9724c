"""Histogram buckets shared by the worker's engine metrics and the API's job metrics.

Latencies span a chat answer (tenths of a second) and a long document (hours): roughly 1-2.5-5 steps from
50 ms to 4 h, 19 buckets, so one histogram type serves both queues and quantiles stay within a bucket's
factor of ~2.
"""

from __future__ import annotations

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1200.0,
    1800.0,
    3600.0,
    7200.0,
    14400.0,
)

# Time between two tokens of one request, and one engine step: milliseconds to seconds.
STEP_BUCKETS_S: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# Tokens computed by one engine step (prefill chunks + decodes): 1 to max_num_batched_tokens and beyond.
STEP_TOKEN_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
