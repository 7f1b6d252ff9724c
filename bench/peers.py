"""The same requests through Hugging Face transformers, on the same model, device and dtype.

- `hf-cb`: transformers' continuous batching — the manager behind `model.generate_batch`, fed one request at
  a time so each keeps its own `max_tokens` (`generate_batch` takes one `max_new_tokens` for all), sized
  like the engine (requests per batch = max_num_seqs, tokens per batch = max_num_batched_tokens, the same
  number of KV blocks and block size).
- `hf-static`: `model.generate` over left-padded batches of max_num_seqs requests in arrival order; a batch
  runs until its longest request is done.
Both are greedy with EOS ignored, so every request generates exactly its max_tokens, as in the engine run.
All requests are handed over at t=0 (neither mode has arrival times); compare throughput on a workload
whose requests all arrive at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.bench.records import RequestRecord, RunResult
from conveyor.bench.workload import BenchRequest

ProgressFn = Callable[[int], None]
PEER_MODES = ("hf-cb", "hf-static")


def load_hf_model(model_path: str, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()


def hf_weights(model: Any) -> tuple[int, str]:
    """(bytes, dtype) of the transformers model's parameters."""
    params = list(model.parameters())
    return sum(p.numel() * p.element_size() for p in params), str(params[0].dtype).removeprefix("torch.")


def token_ids(requests: list[BenchRequest], encode: Callable[[str], list[int]]) -> list[list[int]]:
    return [
        list(r.prompt_token_ids) if r.prompt_token_ids is not None else encode(r.prompt or "")
        for r in requests
    ]


def run_hf_cb(
    model: Any,
    requests: list[BenchRequest],
    prompts: list[list[int]],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int,
    block_size: int,
    progress: ProgressFn | None = None,
) -> RunResult:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    progress = progress or (lambda n: None)
    gen = GenerationConfig(
        max_new_tokens=max(r.max_tokens for r in requests),
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=model.config.pad_token_id or 0,
    )
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=max_num_seqs,
        max_batch_tokens=max_num_batched_tokens,
        num_blocks=num_blocks,
        page_size=block_size,
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        num_requests=len(requests),
        max_generated_length=max(r.max_tokens for r in requests),
    )
    records = {r.request_id: _record(r, len(p)) for r, p in zip(requests, prompts, strict=True)}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30, workload_hints=hints
    ) as manager:
        start = time.time()
        clock = start - time.perf_counter()  # perf_counter -> wall clock
        for req, ids in zip(requests, prompts, strict=True):
            records[req.request_id].arrival_time = start
            manager.add_request(
                ids,
                request_id=req.request_id,
                max_new_tokens=req.max_tokens,
                eos_token_id=-1,
                record_timestamps=True,
            )
        _collect_cb(manager, records, clock, progress)
    end = max((r.finished_time or start) for r in records.values())
    return RunResult(
        target="hf-cb", records=list(records.values()), samples=[], start_time=start, end_time=end,
        weights=hf_weights(model),
    )


def _collect_cb(manager: Any, records: dict[str, RequestRecord], clock: float, progress: ProgressFn) -> None:
    remaining = set(records)
    while remaining:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                break
            continue
        if not result.is_finished() or result.request_id not in remaining:
            continue
        remaining.discard(result.request_id)
        rec = records[result.request_id]
        rec.output_tokens = len(result.generated_tokens)
        rec.first_scheduled_time = clock + result.lifespan[0]
        rec.finished_time = clock + result.lifespan[1]
        if result.timestamps:
            rec.first_token_time = clock + result.timestamps[0]
        rec.status = "completed" if result.error is None else "failed"
        rec.error = result.error
        progress(1)
    for rid in remaining:
        records[rid].error = "no result from the continuous batching manager"


@torch.inference_mode()
def run_hf_static(
    model: Any,
    requests: list[BenchRequest],
    prompts: list[list[int]],
    *,
    batch_size: int,
    progress: ProgressFn | None = None,
) -> RunResult:
    progress = progress or (lambda n: None)
    pad = model.config.pad_token_id or 0
    records = [_record(r, len(p)) for r, p in zip(requests, prompts, strict=True)]
    start = time.time()
    for rec in records:
        rec.arrival_time = start
    for lo in range(0, len(requests), batch_size):
        batch = slice(lo, lo + batch_size)
        _static_batch(model, requests[batch], prompts[batch], records[batch], pad)
        progress(len(records[batch]))
    return RunResult(
        target="hf-static",
        records=records,
        samples=[],
        weights=hf_weights(model),
        start_time=start,
        end_time=max(r.finished_time or start for r in records),
        notes=["static batches: no per-request first-token time (TTFT and ITL not measured)"],
    )


def _static_batch(
    model: Any, requests: list[BenchRequest], prompts: list[list[int]], records: list[RequestRecord], pad: int
) -> None:
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, S], left-padded
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompts):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        mask[i, width - len(ids) :] = 1
    new_tokens = max(r.max_tokens for r in requests)
    began = time.time()
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=mask.to(model.device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    finished = time.time()
    assert out.shape[1] == width + new_tokens, "EOS must not stop a static batch early"
    for req, rec in zip(requests, records, strict=True):
        rec.first_scheduled_time, rec.finished_time = began, finished
        rec.output_tokens = req.max_tokens  # the useful part; the rest of the batch's tokens are padding work
        rec.status = "completed"


def _record(req: BenchRequest, prompt_tokens: int) -> RequestRecord:
    return RequestRecord(
        request_id=req.request_id,
        group=req.group,
        arrival_time=0.0,
        max_tokens=req.max_tokens,
        prompt_tokens=prompt_tokens,
        deadline_s=req.deadline_s,  # a trace's own deadline counts for the peers' attainment too
        priority=req.priority,
    )
