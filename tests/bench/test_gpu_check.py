"""The GPU check's CPU-checkable parts: its arguments, the llama-1b preset's size, the report (JSON and the
README-format Markdown) from fabricated stage results, a stage's failure or timeout not stopping the others,
and the CPU rehearsal end to end (kernels through the interpreter, the tiny model against transformers, the
embedded service)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tests.support.gpu_check_fakes as fakes
from conveyor.bench import gpu_check
from conveyor.bench.cli import build_parser, options
from conveyor.bench.gpu_check import StageOutcome, build_report, run_stages, write_report
from conveyor.bench.gpu_check_stages import cpu_plan, gpu_plan
from conveyor.bench.roofline import ModelShape
from conveyor.engine.presets import PRESETS

# --- arguments ---------------------------------------------------------------------------------------


def test_defaults_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    args = gpu_check.build_parser().parse_args([])
    assert (args.budget, args.out, args.cpu, args.service_model) == (
        540.0,
        Path("bench-out/gpu-check"),
        False,
        "preset",
    )
    assert gpu_check.parse_stages(args.stages) == [
        "kernels", "quant", "speculation", "engine", "moe", "service"]
    assert gpu_check.parse_stages("service, kernels") == ["service", "kernels"]
    assert sum(gpu_check.GPU_BUDGETS.values()) <= gpu_check.DEFAULT_BUDGET_S < 600  # under 10 minutes
    budgets = gpu_check.parse_budgets(["engine=30", "service=4.5"], gpu_check.CPU_BUDGETS)
    assert budgets == {**gpu_check.CPU_BUDGETS, "engine": 30.0, "service": 4.5}
    for bad in (["--stages", "kernels,nope"], ["--stages", "engine,engine"], ["--stage-budget", "engine"]):
        assert gpu_check.main(bad) == 2
    assert gpu_check.main(["--stage-budget", "engine=-1"]) == 2
    assert gpu_check.main(["--budget", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        "--stages: expected distinct names among" in err and "--stage-budget: expected STAGE=SECONDS" in err
    )
    assert "SECONDS must be > 0" in err and "--budget: must be > 0" in err


def test_without_cuda_it_says_so_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 0
    assert "no CUDA device, so nothing is measured" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()
    # A driver torch cannot use (a CPU build of torch on a GPU machine) is an error, not a quiet pass.
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    assert "install a CUDA build of torch" in capsys.readouterr().err


def test_the_1b_preset_has_about_1_1_billion_parameters(llama_dir: Path) -> None:
    c = PRESETS["llama-1b"]
    heads = c["num_attention_heads"]
    shape = ModelShape(
        c["hidden_size"],
        c["num_hidden_layers"],
        heads,
        c["num_key_value_heads"],
        c["hidden_size"] // heads,
        c["intermediate_size"],
        c["vocab_size"],
    )
    assert shape.num_params == 1_104_150_528  # 16 x 60.8 M per layer + 2 x 65.5 M (embeddings, LM head)
    # The count the report states is the real model's, norms aside: checked on the tiny Llama.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert ModelShape.from_config(llama_dir).num_params == matrices


def test_the_gpu_plan_is_bf16_on_the_1b_model_with_a_fixed_kv_cache(llama_dir: Path, tmp_path: Path) -> None:
    plan = gpu_plan(tmp_path, tmp_path)
    assert (plan.mode, plan.device, plan.preset) == ("gpu", "cuda", "llama-1b")
    # The bench takes its arguments as they are (checked here against the tiny model's folder).
    opts = options(build_parser().parse_args(["--model", str(llama_dir), *plan.engine_args]))
    assert opts.peers == ["hf"] and opts.spec.num_requests == 128
    config = opts.engine_config()
    assert (config.dtype, config.num_kv_blocks, config.max_num_seqs) == ("bfloat16", 8192, 64)
    longest = opts.spec.long_prompt.hi + opts.spec.long_output.hi
    assert longest <= PRESETS["llama-1b"]["max_position_embeddings"]
    assert cpu_plan(tmp_path, tmp_path, "demo").service_model == "demo"


def test_the_moe_stage_runs_the_mixtral_preset_and_counts_every_expert(tiny_model_dir, tmp_path: Path
                                                                         ) -> None:
    from transformers import AutoModelForCausalLM

    plan = gpu_plan(tmp_path, tmp_path)
    assert plan.moe_preset == "mixtral-1b" and PRESETS["mixtral-1b"]["arch"] == "MixtralForCausalLM"
    mixtral = tiny_model_dir("MixtralForCausalLM")
    opts = options(build_parser().parse_args(["--model", str(mixtral), *plan.moe_args]))
    assert opts.peers == ["hf"] and opts.engine_config().dtype == "bfloat16"
    longest = opts.spec.long_prompt.hi + opts.spec.long_output.hi
    assert longest <= PRESETS["mixtral-1b"]["max_position_embeddings"]
    # Parameters: every expert's matrices (3-D stacks in transformers), the router left out like the norms.
    model = AutoModelForCausalLM.from_pretrained(mixtral)
    matrices = sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and ".gate." not in name)
    shape = ModelShape.from_config(mixtral)
    assert shape.num_params == matrices and (shape.num_experts, shape.experts_per_token) == (4, 2)


# --- the report --------------------------------------------------------------------------------------


def fabricated_outcomes() -> list[StageOutcome]:
    case = {"case": "decode b=64 ctx=4k", "tokens": 64, "splits": 1, "max_err": 3.9e-3, "ok": True}
    case |= {
        "triton_ms": 0.2,
        "timing": "graph",
        "tflops": 40.0,
        "gbps": 3400.0,
        "of_copy": 0.85,
        "sdpa_ms": 0.5,
    }
    kernels = {"ok": True, "problems": [], "peak_gbps": 4800.0, "cases": [case]}
    kernels |= {"copy": {"bytes": 1 << 30, "gbps": 4000.0, "timing": "graph"}}
    kernels["shape"] = {
        "dtype": "bfloat16",
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "block_size": 16,
    }

    def system(wall: float, out_rate: float, ttft: float | None) -> dict[str, Any]:
        return {
            "wall_s": wall,
            "submitted": 128,
            "completed": 128,
            "output_tokens": 15000,
            "output_tokens_per_s": out_rate,
            "total_tokens_per_s": 5 * out_rate,
            "ttft_p50_s": ttft,
            "ttft_p90_s": None if ttft is None else 2 * ttft,
            "e2e_p90_s": wall,
        }

    model = {"preset": "llama-1b", "parameters": 1_104_150_528, "hidden": 2048, "layers": 16, "heads": 32}
    model |= {"kv_heads": 8, "head_dim": 64, "intermediate": 8192, "vocab": 32000}
    engine = {
        "ok": True,
        "problems": [],
        "model": model,
        "command": "conveyor bench --peer hf",
        "workload": "w",
    }
    engine["systems"] = {
        "engine": system(10.0, 3000.0, 0.5),
        "hf-static": system(40.0, 750.0, None),
        "hf-cb": system(30.0, 1000.0, 1.5),
    }
    engine["ratios"] = {"engine / hf-static": 4.0, "engine / hf-cb": 3.0, "engine / best HF mode": 3.0}
    return [
        StageOutcome("kernels", "passed", 42.0, 120.0, kernels),
        StageOutcome("engine", "passed", 200.0, 270.0, engine),
        StageOutcome("service", "timed out", 150.0, 150.0, error="stopped after 150 s"),
    ]


def test_the_report_is_one_json_file_and_one_markdown_file_in_the_readme_formats(tmp_path: Path) -> None:
    plan = gpu_plan(tmp_path, tmp_path)
    report = build_report(plan, fabricated_outcomes(), 540.0, 392.0, ["--out", str(tmp_path)])
    json_path, md_path = write_report(report, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu-check.json", "gpu-check.md"]
    saved = json.loads(json_path.read_text())
    assert saved["ok"] is False and saved["mode"] == "gpu"  # a stage that timed out fails the check
    assert [(s["name"], s["status"]) for s in saved["stages"]] == [
        ("kernels", "passed"),
        ("engine", "passed"),
        ("service", "timed out"),
    ]
    assert saved["stages"][1]["figures"]["systems"]["engine"]["output_tokens_per_s"] == 3000.0
    assert saved["plan"]["preset"] == "llama-1b"
    assert saved["command"].startswith("python -m conveyor.bench.gpu_check")
    inv = saved["inventory"]
    assert {"device", "torch_version", "triton_version", "cuda_version", "git_commit"} <= set(inv)
    md = md_path.read_text()
    assert "**FAILED** in 392 s (budget 540 s)" in md
    assert "| service | timed out | 150.0 s | 150 s | stopped after 150 s |" in md
    # The README's kernel, engine and service tables.
    assert "Device-to-device copy of 1024 MiB: **4000 GB/s**" in md and "peak is 4800 GB/s" in md
    assert (
        "| decode b=64 ctx=4k | 64 | 1 | 3.9e-03 | yes | 0.2 (graph) | 40 | 3400 | 85.0% | 0.5 | 2.50x |"
        in md
    )
    assert "`llama-1b`, 1.10 B parameters" in md
    assert (
        "| system | wall time | output tok/s | total tok/s | TTFT p50 / p90 | end-to-end p90 | engine is |"
        in md
    )
    rows = [line for line in md.splitlines() if line.startswith(("| Conveyor", "| transformers"))]
    assert rows == [
        "| Conveyor engine | 10.0 s | **3000** | 15000 | 0.50 s / 1.00 s | 10.00 s | — |",
        "| transformers continuous batching (`hf-cb`) | 30.0 s | 1000 | 5000 | 1.50 s / 3.00 s | 30.00 s "
        "| **3.00x** faster |",
        "| transformers static `generate` (`hf-static`) | 40.0 s | 750 | 3750 | n/a / n/a | 40.00 s "
        "| **4.00x** faster |",
    ]
    assert "## Service" not in md  # the stage has no figures


# --- stage isolation --------------------------------------------------------------------------------


def test_a_failing_or_hanging_stage_is_recorded_and_the_others_still_run(tmp_path: Path) -> None:
    plan = cpu_plan(tmp_path, tmp_path)
    stages = [
        ("hangs", fakes.stage_hangs, 6.0),
        ("raises", fakes.stage_raises, 60.0),
        ("check fails", fakes.stage_check_fails, 60.0),
        ("passes", fakes.stage_passes, 60.0),
    ]
    outcomes = run_stages(plan, stages, total_s=300.0)
    by_name = {o.name: o for o in outcomes}
    hangs = by_name["hangs"]
    assert (hangs.status, hangs.error) == ("timed out", "stopped after 6 s") and hangs.seconds >= 6.0
    # Its process group went with it: the helper it started is gone.
    helper = int((tmp_path / "helper.pid").read_text())
    assert not _running(helper)
    raised = by_name["raises"]
    assert (raised.status, raised.error) == ("failed", "RuntimeError: the device fell over")
    assert any("the device fell over" in line for line in raised.figures["traceback"])
    check = by_name["check fails"]
    assert (check.status, check.error) == ("failed", "hf-cb: 3 of 4 requests completed")
    assert (by_name["passes"].status, by_name["passes"].figures["value"]) == ("passed", 7)
    assert [o.name for o in outcomes] == [name for name, _, _ in stages]


def test_a_stage_past_the_total_budget_is_skipped(tmp_path: Path) -> None:
    outcomes = run_stages(cpu_plan(tmp_path, tmp_path), [("late", fakes.stage_passes, 30.0)], total_s=1.0)
    assert [(o.name, o.status, o.error) for o in outcomes] == [
        ("late", "skipped", "the total budget is spent")
    ]


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    stat = Path(f"/proc/{pid}/stat")
    for _ in range(50):
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        time.sleep(0.1)  # a signalled process can take a moment to go
    return True


# --- the CPU rehearsal end to end --------------------------------------------------------------------


def test_cpu_rehearsal_runs_every_stage_and_writes_the_report(llama_dir: Path, tmp_path: Path) -> None:
    """The whole pipeline on the CPU; preset:tiny is the session's tiny Llama (the same build_tiny_model
    defaults), so nothing is built here."""
    cache, out = tmp_path / "models", tmp_path / "out"
    cache.mkdir()
    (cache / "tiny").symlink_to(llama_dir, target_is_directory=True)
    assert gpu_check.main(["--cpu", "--out", str(out), "--model-cache", str(cache)]) == 0
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["ok"] and report["mode"] == "cpu"
    stages = {s["name"]: s for s in report["stages"]}
    assert {name: s["status"] for name, s in stages.items()} == dict.fromkeys(gpu_check.STAGES, "passed")
    kernels = stages["kernels"]["figures"]
    assert kernels["copy"]["gbps"] > 0 and len(kernels["cases"]) == 4
    assert all(c["ok"] and c["of_copy"] > 0 for c in kernels["cases"])
    quant = stages["quant"]["figures"]["cases"]
    assert len(quant) == 4 and all(c["ok"] and c["ms"] > 0 for c in quant)
    speculation = stages["speculation"]["figures"]
    assert speculation["ok"] and speculation["suffix"]["drafted_tokens"] > 0
    assert speculation["plain"]["output_tokens"] == speculation["suffix"]["output_tokens"]
    engine = stages["engine"]["figures"]
    assert set(engine["systems"]) == {"engine", "hf-static", "hf-cb"}
    assert len({s["output_tokens"] for s in engine["systems"].values()}) == 1
    assert engine["model"]["parameters"] == ModelShape.from_config(llama_dir).num_params
    service = stages["service"]["figures"]["service"]
    assert (service["submitted"], service["succeeded"]) == (8, 8)
    md = (out / "gpu-check.md").read_text()
    for heading in (
        "# GPU check, CPU rehearsal",
        "## Kernels",
        "## Quantized weights",
        "## Speculative decoding",
        "## Engine against transformers",
        "## Service",
    ):
        assert heading in md
    assert (out / "engine" / "report.json").is_file() and (out / "service" / "report.json").is_file()
