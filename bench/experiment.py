"""Runs a bench: the workload, the target, optional peers, and the report; and one-parameter experiments
(`--compare`, `--sweep`) that write decision sheets."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from conveyor.bench import plots
from conveyor.bench.affinity import CpuSplit, pinned, split_cpus, usable_cpus
from conveyor.bench.console import progress_bar, refusal_lines, server_lines, service_table, summary_table
from conveyor.bench.decision import Condition, decide, default_conditions, default_hypothesis
from conveyor.bench.inventory import inventory
from conveyor.bench.load import (
    LoadPlan,
    burst,
    check_load,
    mix_weights,
    scale_arrivals,
    scaled_rates,
    trace_load_record,
)
from conveyor.bench.metrics import count_check, full_batch_decode_steps, summarize
from conveyor.bench.prompt_text import token_decoder
from conveyor.bench.records import RunResult
from conveyor.bench.report import run_line, wall_time_ratio, write_decision, write_report
from conveyor.bench.roofline import ModelShape, efficiency, matmul_bound
from conveyor.bench.server_cpu import CpuWindow
from conveyor.bench.service import service_figures
from conveyor.bench.structured import STRUCTURED_SHARE, check_share, constrained_ids, structured_figures
from conveyor.bench.trace_chat import MessageRenderer
from conveyor.bench.trace_replay import trace_groups, trace_lines, trace_requests
from conveyor.bench.workload import (
    TEXT_PROFILES,
    BenchRequest,
    Group,
    WorkloadSpec,
    all_at_once,
    check_known_groups,
    generate,
    respects_eos,
    save_trace,
)
from conveyor.engine.config import EngineConfig, RequestClassConfig
from conveyor.engine.cpu_threads import ThreadChoice
from conveyor.engine.loader import read_hf_config, resolve_device, resolve_dtype
from conveyor.kernels.paged_attention import resolve_backend

ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "request_classes"}
DEFAULT_CONCURRENCY = 32  # the service profile's closed loop when neither it nor a submit rate is given


@dataclass
class BenchOptions:
    model: str | None = None
    target: str = "engine"  # engine | http
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig keyword arguments
    # Per group of the workload, each overriding the group's own default (max_running: max_num_seqs).
    max_running: dict[str, int] = field(default_factory=dict)
    priority: dict[str, int] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    trace: str | None = None
    trace_model: str | None = None  # the model whose jobs a trace of several models replays (--trace-model)
    out_dir: Path = Path("bench-out")
    peers: list[str] = field(default_factory=list)  # "hf" (bench/peers.py), "llama.cpp" (llama_cpp_peer.py)
    gguf: Path | None = None  # the GGUF file --model names, if it names one: what the llama.cpp peer runs
    measure_matmul: bool = True
    torch_profile_steps: int = 0
    progress: bool = True
    timeout_s: float | None = None
    # Stop at EOS; None: the profile's default (workload.respects_eos: the text profiles do, the others and
    # traces do not), filled in at creation.
    respect_eos: bool | None = None
    poll_s: float = 0.2
    wait_s: float = 30.0  # the long poll's wait (GET /v1/jobs/{id}?wait=S); 0: plain polls every poll_s
    concurrency: int | None = None  # service profile: jobs in flight at once (closed loop)
    repeat: int = 1  # rounds per system (interleaved); the best round is reported
    structured_share: float = 0.0  # share of requests constrained to the bench's JSON Schema (engine only)
    thread_choice: ThreadChoice | None = None  # how the CPU thread count was measured (bench/cli.py)
    # --load: arrivals at this multiple of the measured capacity; the spec's rates are weights until
    # apply_load measures the capacity, records it in load_plan and puts the derived rates in their place.
    # With a trace: its arrival offsets divided by it (no capacity measured, no load_plan).
    load: float | None = None
    load_plan: LoadPlan | None = None
    # HTTP target: the server's processes to measure (role -> pid, bench/server_cpu.py), and the CPUs the
    # server and the bench are pinned to (bench/affinity.py; None: the default split); pin=False: no pinning.
    server_pids: dict[str, int] = field(default_factory=dict)
    server_cpus: tuple[int, ...] | None = None
    client_cpus: tuple[int, ...] | None = None
    pin: bool = True
    # The workload's groups (the trace's, else the profile's): the engine's request classes, the queues
    # jobs are sent to over HTTP, and the only names the per-group settings above may use.
    groups: list[Group] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.target not in ("engine", "http"):
            raise ValueError(f"target must be 'engine' or 'http', got {self.target!r}")
        unknown = set(self.engine) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"engine parameters: unknown {sorted(unknown)}; known: {sorted(ENGINE_FIELDS)}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        check_share(self.structured_share)
        if self.structured_share and (self.target != "engine" or self.peers):
            raise ValueError(
                "structured_share (--structured-share): only the in-process engine, without peers"
            )
        if "llama.cpp" in self.peers and self.gguf is None:
            raise ValueError("--peer llama.cpp runs GGUF files: give --model a .gguf file or package:DIST "
                             "holding one")
        if self.target == "http" and self.peers:
            raise ValueError("peers: --peer runs only with the in-process engine target")
        if self.respect_eos is None:
            self.respect_eos = not self.trace and respects_eos(self.spec.profile)
        if self.respect_eos and self.peers:
            raise ValueError("peers: the peers ignore EOS (every request does its max_tokens), so they "
                             "would not do the engine's work when it stops at EOS; pass --no-respect-eos")
        if self.trace and self.spec.rates:
            raise ValueError("rates (--rate): a trace gives its own arrival times (arrival_s)")
        if self.trace_model is not None and not self.trace:
            raise ValueError("trace_model (--trace-model): picks a model's jobs from a trace; give --trace")
        self.groups = trace_groups(self.trace, self.trace_model) if self.trace else self.spec.groups()
        check_known_groups(self.deadlines, self.groups, "deadlines (--deadline)")
        check_known_groups(self.max_running, self.groups, "max_running (--max-running)")
        check_known_groups(self.priority, self.groups, "priority (--priority)")
        self._check_service_load()
        self._check_server_side()
        if self.load_plan is None:  # afterwards the spec holds the derived rates, not weights
            check_load(self.load, self.spec, self.target, self.trace)

    def _check_service_load(self) -> None:
        """The service profile runs over HTTP, as a closed loop (`concurrency`) or an open one (the spec's
        `submit_rate`); a closed loop of DEFAULT_CONCURRENCY when neither is given."""
        service = self.spec.profile == "service" and not self.trace
        if service and self.target != "http":
            raise ValueError("profile service: it measures the service's API; use --target http")
        if self.concurrency is not None and (not service or self.concurrency < 1):
            raise ValueError(
                f"concurrency (--concurrency): needs --profile service and N >= 1, got {self.concurrency}"
            )
        if self.concurrency is not None and self.spec.submit_rate:
            raise ValueError("--concurrency, --submit-rate: a closed loop or an open loop, not both")
        if service and self.concurrency is None and not self.spec.submit_rate:
            self.concurrency = DEFAULT_CONCURRENCY
        if self.wait_s < 0 or self.poll_s <= 0:
            raise ValueError(f"--wait must be >= 0 and --poll > 0, got {self.wait_s} and {self.poll_s}")

    def _check_server_side(self) -> None:
        cpus = self.server_cpus is not None or self.client_cpus is not None
        if (self.server_pids or cpus) and self.target != "http":
            raise ValueError("--server-pid, --server-cpus, --client-cpus: only with --target http")
        if cpus and not self.pin:
            raise ValueError("--no-pin with --server-cpus/--client-cpus: pin or not, not both")
        self.cpu_split()  # a bad CPU list fails now, before any run

    def cpu_split(self) -> tuple[CpuSplit | None, str]:
        """The server's and the bench's CPUs over HTTP, or None and why nothing is pinned."""
        if self.target != "http":
            return None, "in-process run"
        if not self.pin:
            return None, "not pinned (--no-pin)"
        available = usable_cpus()
        split = split_cpus(available, self.server_cpus, self.client_cpus)
        return split, f"not pinned: the bench may use {len(available)} CPU(s), {list(available)}"

    def deadlines_s(self) -> dict[str, float]:
        """Each group's deadline (given, else the group's own); groups without one are left out."""
        defaults = {g.name: g.deadline_s for g in self.groups if g.deadline_s is not None}
        return {**defaults, **self.deadlines}

    def engine_config(self) -> EngineConfig:
        if self.model is None:
            raise ValueError("model: the engine target needs --model")
        seqs = int(self.engine.get("max_num_seqs", EngineConfig.max_num_seqs))
        classes = [
            RequestClassConfig(
                g.name,
                max_running=self.max_running.get(g.name, seqs),
                priority=self.priority.get(g.name, g.priority),
            )
            for g in self.groups
        ]
        return EngineConfig(model=self.model, request_classes=classes, **self.engine)

    def parameters(self) -> dict[str, Any]:
        """Every engine and queue parameter, as the inventory records them."""
        params: dict[str, Any] = {
            "target": self.target,
            "deadlines_s": self.deadlines_s(),
            "respect_eos": self.respect_eos,
            "structured_share": self.structured_share,
        }
        if self.target == "engine":
            config = self.engine_config()
            params["engine"] = dataclasses.asdict(config)
            # What "auto" became here (the engine resolves it the same way): cpu, torch or triton.
            params["attention_backend"] = resolve_backend(config.attention_backend,
                                                                  resolve_device(config.device))
        else:
            params.update(url=self.url, poll_s=self.poll_s, wait_s=self.wait_s, concurrency=self.concurrency)
            split, reason = self.cpu_split()
            params["cpu_pinning"] = split.record() if split else {"pinned": False, "reason": reason}
            params["server_pids"] = dict(self.server_pids)
        return params


def with_param(opts: BenchOptions, param: str, value: str) -> BenchOptions:
    """A copy of opts with one parameter changed (EngineConfig field, GROUP.max_running, GROUP.priority)."""
    changed = copy.deepcopy(opts)
    groups = [g.name for g in opts.groups]
    group, dot, name = param.partition(".")
    if dot and name in ("max_running", "priority") and group in groups:
        getattr(changed, name)[group] = int(value)
    elif param == STRUCTURED_SHARE:
        changed.structured_share = check_share(float(value))
    elif param in ENGINE_FIELDS:
        changed.engine[param] = parse_value(value)
    else:
        raise ValueError(
            f"parameter {param!r}: use an engine parameter {sorted(ENGINE_FIELDS)}, {STRUCTURED_SHARE}, or "
            f"GROUP.max_running / GROUP.priority with GROUP in this workload's groups {groups}"
        )
    changed.engine_config()  # validates the new value now, with EngineConfig's message
    changed.__post_init__()  # and the options' own checks
    return changed


def compare_arms(opts: BenchOptions, param: str, values: str) -> tuple[BenchOptions, list[str]]:
    """`--compare PARAM=V`: the options as they are against V. `--compare PARAM=BASE,V1,V2,...`: BASE is
    the baseline's value and each further one a candidate against it (e.g. speculative=none,ngram,suffix)."""
    items = values.split(",")
    if not all(items):
        raise ValueError(f"--compare: expected PARAM=VALUE or PARAM=BASELINE,VALUE,..., got {param}={values}")
    if len(items) == 1:
        return opts, items
    return with_param(opts, param, items[0]), items[1:]


def current_value(opts: BenchOptions, param: str) -> Any:
    group, dot, name = param.partition(".")
    if dot and name in ("max_running", "priority"):
        cls = opts.engine_config().request_class(group)
        return getattr(cls, name)
    if param == STRUCTURED_SHARE:
        return opts.structured_share
    value = getattr(opts.engine_config(), param)
    # A field the config turns into a dataclass (speculative: SpeculativeConfig) is recorded as its fields.
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def parse_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# --- workloads ---------------------------------------------------------------------------------------


def build_workload(opts: BenchOptions) -> tuple[list[BenchRequest], str]:
    """(requests, description). Prompt ids come from the model's tokenizer vocabulary, minus specials."""
    if opts.spec.profile == "service" and not opts.trace:
        return generate(opts.spec, [], 0), service_description(opts)
    if opts.spec.profile == "shared-prefix" and not opts.trace:
        return _shared_prefix_workload(opts)
    if opts.spec.profile in TEXT_PROFILES and not opts.trace:
        return _text_workload(opts)
    vocab = vocab_ids(opts.model) if opts.model else []
    if opts.trace:
        return _trace_workload(opts, vocab)
    if not vocab:
        raise ValueError("model: synthesised prompts need --model (its tokenizer supplies the token ids)")
    s = opts.spec
    arrivals = ", ".join(f"{g} Poisson {r:.4g}/s" for g, r in s.rates.items() if r > 0) or "all at t=0"
    desc = (
        f"profile {s.profile}, seed {s.seed}, arrivals {arrivals}, "
        f"{s.short_group} prompt/output {s.short_prompt}/{s.short_output}, "
        f"{s.long_group} prompt/output {s.long_prompt or 'context/4..context'}/{s.long_output}"
        + (f", {s.long_group} share {s.documents_share}" if s.profile in ("mixed", "deadlines") else "")
        + (f", cancel share {s.cancel_share}" if s.cancel_share else "")
        + (f"; {opts.load_plan.describe()}" if opts.load_plan else "")
    )
    return generate(s, vocab, model_max_len(opts)), desc


def _trace_workload(opts: BenchOptions, vocab: list[int]) -> tuple[list[BenchRequest], str]:
    """The trace's requests (its model's, less embedding jobs), their arrivals divided by --load if given."""
    assert opts.trace is not None
    trace = trace_lines(opts.trace, opts.trace_model)
    requests = trace_requests(trace, vocab, opts.spec.seed, MessageRenderer(opts.model))
    description = trace.describe()
    if opts.load is not None:
        requests = scale_arrivals(requests, opts.load)
        description += f"; arrivals at {opts.load:g}x the recorded pace (arrival_s / {opts.load:g}, --load)"
    return requests, description


def _shared_prefix_workload(opts: BenchOptions) -> tuple[list[BenchRequest], str]:
    vocab = vocab_ids(opts.model) if opts.model else []
    if not vocab:
        raise ValueError("model: synthesised prompts need --model (its tokenizer supplies the token ids)")
    s = opts.spec
    rate = s.rates.get(s.short_group, 0.0)
    arrivals = f"Poisson {rate:.4g}/s" if rate > 0 else "all at t=0"
    desc = (
        f"profile shared-prefix, seed {s.seed}, arrivals {arrivals}, "
        f"{s.short_group}: one shared prefix of {s.prefix_tokens} tokens + a unique suffix of "
        f"{s.suffix_tokens}, {s.output_tokens} output tokens each"
        + (f", cancel share {s.cancel_share}" if s.cancel_share else "")
        + (f"; {opts.load_plan.describe()}" if opts.load_plan else "")
    )
    return generate(s, vocab, model_max_len(opts)), desc


def _text_workload(opts: BenchOptions) -> tuple[list[BenchRequest], str]:
    """The quoting or chat profile: real text in the chat template of --model's tokenizer."""
    from conveyor.bench.chat_format import ChatFormat
    from conveyor.bench.text_workload import text_requests

    if not opts.model:
        raise ValueError(f"model: the {opts.spec.profile} profile renders prompts with --model's tokenizer")
    fmt = ChatFormat.from_model(opts.model)
    return text_requests(opts.spec, fmt, model_max_len(opts)), _text_description(opts, fmt.has_template)


def _text_description(opts: BenchOptions, has_template: bool) -> str:
    from conveyor.bench.text_workload import DOCUMENT_TOKENS

    s = opts.spec
    group = s.long_group if s.profile == "quoting" else s.short_group
    rate = s.rates.get(group, 0.0)
    arrivals = f"Poisson {rate:.4g}/s" if rate > 0 else "all at t=0"
    sizes = ", ".join(f"{k} {r}" for k, r in DOCUMENT_TOKENS.items())
    what = (
        f"tasks quoting their input (invoice, rewrite and summary in turn, document tokens "
        f"{s.long_prompt or sizes})"
        if s.profile == "quoting"
        else "open questions copying nothing"
    )
    return (
        f"profile {s.profile}, seed {s.seed}, arrivals {arrivals}, {group}: {what}, max_tokens "
        f"{s.output_range(group)}, "
        + ("in the model's chat template" if has_template else "plain text (no chat template)")
        + (f", cancel share {s.cancel_share}" if s.cancel_share else "")
        + (f"; {opts.load_plan.describe()}" if opts.load_plan else "")
    )


def service_description(opts: BenchOptions) -> str:
    s = opts.spec
    load = (
        f"open loop, {s.submit_rate:g} submissions/s at fixed intervals"
        if s.submit_rate
        else f"closed loop, {opts.concurrency} jobs in flight"
    )
    return f"profile service, seed {s.seed}, one-token jobs with short prompts on {s.short_group}, {load}"


def vocab_ids(model: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    special = set(tok.all_special_ids)
    limit = _config(model).get("vocab_size", len(tok))
    return [i for i in range(min(len(tok), limit)) if i not in special]


def model_max_len(opts: BenchOptions) -> int:
    requested = opts.engine.get("max_model_len")
    if requested:
        return int(requested)
    return int(_config(opts.model).get("max_position_embeddings", 2048)) if opts.model else 2048


def _config(model: str | None) -> dict[str, Any]:
    """The model folder's config.json, read as the engine reads it; {} without one (a hub name, say)."""
    folder = Path(model or "")
    return read_hf_config(folder) if (folder / "config.json").is_file() else {}


# --- --load: the capacity, then the rates ------------------------------------------------------------


def apply_load(opts: BenchOptions, console: Console) -> LoadPlan | None:
    """With --load: measures the capacity on the workload's own requests, submitted at once to an engine
    with opts' settings, and sets each group's rate to its share of load x capacity (bench/load.py). A
    trace needs no capacity: build_workload divides its arrival times by the load."""
    if opts.load is None or opts.load_plan is not None or opts.trace:
        return opts.load_plan
    weights = mix_weights(opts.spec)
    opts.spec.rates = {g: w for g, w in weights.items() if w > 0}  # 1 request/s in all
    unit, _ = build_workload(opts)
    console.print(f"load {opts.load:g}x: measuring the capacity, {len(unit)} requests submitted at once")
    result, engine = run_target(opts, burst(unit), console)
    del engine
    completed = sum(r.status == "completed" for r in result.records)
    if not completed:
        raise ValueError("load (--load): the calibration run completed no request; no capacity to scale")
    capacity = completed / result.duration_s
    rates = scaled_rates(capacity, opts.load, weights)
    opts.spec.rates = {g: r for g, r in rates.items() if r > 0}
    opts.load_plan = LoadPlan(
        load=opts.load,
        capacity_rps=capacity,
        weights=weights,
        rates=rates,
        calibration_requests=len(unit),
        calibration_completed=completed,
        calibration_s=result.duration_s,
        arrival_span_s=max(r.arrival_s for r in unit) / sum(rates.values()),
    )
    console.print(opts.load_plan.describe(), markup=False)
    return opts.load_plan


# --- one run -----------------------------------------------------------------------------------------


def run_target(opts: BenchOptions, requests: list[BenchRequest], console: Console) -> tuple[RunResult, Any]:
    """Runs the workload on the configured target; returns the result and the engine (None over HTTP)."""
    if opts.target == "http":
        return run_http_target(opts, requests, console), None
    from conveyor.bench.offline import run_engine, warm_up
    from conveyor.engine.llm_engine import LLMEngine

    engine = LLMEngine(opts.engine_config())
    warm_up(engine, requests)
    with progress_bar(console, "engine", len(requests), opts.progress) as advance:
        result = run_engine(
            engine,
            requests,
            respect_eos=opts.respect_eos,
            timeout_s=opts.timeout_s,
            progress=advance,
            constrained=frozenset(constrained_ids(requests, opts.structured_share)),
            deadlines_s=opts.deadlines_s(),
        )
    runner = engine.runner
    held = runner.quantization if runner.quantization != "none" else str(runner.dtype).removeprefix("torch.")
    result.weights = (runner.weight_bytes, held)
    return result, engine


def run_http_target(opts: BenchOptions, requests: list[BenchRequest], console: Console) -> RunResult:
    """The workload over HTTP, the bench and the server's processes pinned apart (bench/affinity.py), and
    the server's CPU time measured around the run (bench/server_cpu.py)."""
    from conveyor.bench.http_target import run_http

    decode = token_decoder(opts.model) if opts.model else None
    split, reason = opts.cpu_split()
    with (
        pinned(split, opts.server_pids, reason) as pinning,
        progress_bar(console, f"http {opts.url}", len(requests), opts.progress, refresh_hz=2) as advance,
    ):
        window = CpuWindow(opts.server_pids).start()
        result = run_http(
            opts.url,
            requests,
            api_key=opts.api_key,
            decode=decode,
            respect_eos=opts.respect_eos,
            poll_s=opts.poll_s,
            wait_s=opts.wait_s,
            concurrency=opts.concurrency,
            timeout_s=opts.timeout_s or 3600.0,
            progress=advance,
        )
        result.server = {**window.stop(), "pinning": pinning}
    return result


def run_summary(opts: BenchOptions, result: RunResult, bound: Any = None) -> dict[str, Any]:
    metrics = summarize(result, opts.deadlines_s())
    assert count_check(metrics), "completed + cancelled + failed must equal submitted"
    run: dict[str, Any] = {
        "target": result.target,
        "duration_s": result.duration_s,
        "preemptions_total": result.preemptions_total,
        "prefix_cache": result.prefix_cache,
        "expert_tokens": result.expert_tokens,
        "weights": weights_record(result.weights),
        "decode_steps": full_batch_decode_steps(result.samples) if result.target == "engine" else None,
        "structured": structured_figures(result),
        "speculation": result.speculation,
        "metrics": metrics,
        "notes": result.notes,
    }
    if result.target == "http":
        run["service"] = service_figures(result)
    if opts.model and result.target != "http":
        run["efficiency"] = efficiency(
            ModelShape.from_config(opts.model), result.records, result.samples, result.duration_s, bound
        )
    return run


def weights_record(weights: tuple[int, str] | None) -> dict[str, Any] | None:
    return None if weights is None else {"bytes": weights[0], "held_as": weights[1]}


def run_plots(result: RunResult, out_dir: Path, prefix: str = "") -> list[str]:
    """The plots, plus the raw data behind them: one JSON line per request and per step (or poll)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _jsonl(out_dir / f"{prefix}requests.jsonl", [dataclasses.asdict(r) for r in result.records])
    _jsonl(out_dir / f"{prefix}steps.jsonl", [dataclasses.asdict(s) for s in result.samples])
    paths = [plots.latency_cdf(result, out_dir / f"{prefix}latency_cdf.png")]
    if result.samples:
        paths.append(plots.timeline(result, out_dir / f"{prefix}timeline.png"))
    return [str(p) for p in paths]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def measure_bound(opts: BenchOptions, result: RunResult, device: str, dtype: Any) -> Any:
    """torch.mm FLOP/s at the run's step shapes, on the engine's device and dtype (None when disabled)."""
    if not opts.measure_matmul or not opts.model:
        return None
    return matmul_bound(ModelShape.from_config(opts.model), result.samples, dtype=dtype, device=device)


# --- the plain bench ---------------------------------------------------------------------------------


def bench(opts: BenchOptions, console: Console) -> dict[str, Any]:
    """Runs the target (and each peer) `opts.repeat` times, interleaved round by round, and reports each
    system's best round (highest output tokens/s): on a shared machine the least disturbed run is the
    closest to what the system can do. Every round's throughput is kept in the report."""
    apply_load(opts, console)
    requests, description = build_workload(opts)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    trace_sha = save_trace(requests, opts.out_dir / "trace.jsonl")
    rounds: dict[str, list[RunResult]] = {}
    engine, peers = None, None
    for i in range(opts.repeat):
        if opts.repeat > 1:
            console.print(f"round {i + 1} of {opts.repeat}")
        del engine  # one engine (and its KV cache) in memory at a time
        result, engine = run_target(opts, requests, console)
        rounds.setdefault(opts.target, []).append(result)
        if opts.peers:
            if peers is None:
                assert engine is not None
                peers = make_peers(opts, requests, engine.block_manager.num_blocks)
            for peer in peers:
                for name, peer_result in peer.run_round(console).items():
                    rounds.setdefault(name, []).append(peer_result)
    best = {name: max(results, key=output_rate) for name, results in rounds.items()}
    bound = (
        measure_bound(opts, best[opts.target], str(engine.runner.device), engine.runner.dtype)
        if engine is not None
        else None
    )
    runs = {}
    for name, result in best.items():
        runs[name] = run_summary(opts, result, bound if name == opts.target else None)
        runs[name]["rounds_output_tokens_per_s"] = [output_rate(r) for r in rounds[name]]
        runs[name]["plots"] = run_plots(result, opts.out_dir, "" if name == opts.target else f"{name}-")
    if opts.torch_profile_steps and engine is not None:
        from conveyor.bench.profile import profile_steps

        runs[opts.target]["profile"] = profile_steps(engine, requests, opts, opts.out_dir / "profile.txt")
    report: dict[str, Any] = {
        "title": f"{opts.target}, "
        + (f"trace {opts.trace}" if opts.trace else f"profile {opts.spec.profile}")
        + (f", best of {opts.repeat} interleaved rounds" if opts.repeat > 1 else ""),
        "workload": workload_record(opts, requests, description, trace_sha),
        "runs": runs,
        "ratios": ratios(runs),
        "plots": [p for run in runs.values() for p in run["plots"]],
        "inventory": inventory(opts.model, opts.parameters(), opts.thread_choice),
    }
    json_path, md_path = write_report(report, opts.out_dir)
    console.print(summary_table(report["title"], runs))
    for name, run in runs.items():
        console.print(run_line(name, run), markup=False)
    if any("service" in run for run in runs.values()):
        console.print(service_table(f"service: {description}", runs))
        for line in [*refusal_lines(runs), *server_lines(runs)]:
            console.print(line, markup=False)
    for key, value in report["ratios"].items():
        console.print(f"throughput ratio {key}: [bold]{value:.2f}x[/bold]")
    console.print(f"report: {md_path} and {json_path}")
    return report


def output_rate(result: RunResult) -> float:
    """Output tokens/s of completed requests: the figure rounds are ranked by."""
    done = sum(r.output_tokens for r in result.records if r.status == "completed")
    return done / result.duration_s


def workload_record(
    opts: BenchOptions, requests: list[BenchRequest], description: str, trace_sha: str
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "description": description,
        "spec": None if opts.trace else opts.spec.describe(),
        "trace": opts.trace,
        "num_requests": len(requests),
        "all_at_once": all_at_once(requests),
        "trace_sha256": trace_sha,
        "load": _load_record(opts, requests),
        # Stopped at EOS: each answer is as long as the model made it, max_tokens only a cap.
        "respect_eos": opts.respect_eos,
    }
    if opts.trace:  # an exported trace's header (version, exported_at, since, until, jobs), what was skipped
        record.update(trace_lines(opts.trace, opts.trace_model).record())
    return record


def _load_record(opts: BenchOptions, requests: list[BenchRequest]) -> dict[str, Any] | None:
    if opts.load_plan is not None:
        return opts.load_plan.record()
    return trace_load_record(opts.load, requests) if opts.trace and opts.load is not None else None


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    if "engine" not in runs:
        return {}
    tput = {name: run["metrics"]["all"]["output_tokens_per_s"] for name, run in runs.items()}
    out = {
        f"engine / {name}": tput["engine"] / tput[name] for name in runs if name != "engine" and tput[name]
    }
    peers = [tput[name] for name in runs if name.startswith("hf-") and tput[name]]
    if peers:
        out["engine / best HF mode"] = tput["engine"] / max(peers)
    return out


def make_peers(opts: BenchOptions, requests: list[BenchRequest], kv_blocks: int) -> list[Any]:
    """The --peer systems, each with `run_round(console) -> {name: RunResult}`."""
    peers: list[Any] = []
    if "hf" in opts.peers:
        peers.append(HFPeers(opts, requests, kv_blocks))
    if "llama.cpp" in opts.peers:
        from conveyor.bench.llama_cpp_peer import LlamaCppPeer

        assert opts.gguf is not None and opts.model is not None
        peers.append(LlamaCppPeer(opts.gguf, opts.model, requests, opts.engine_config()))
    return peers


class HFPeers:
    """hf-static and hf-cb on the same requests, model, device and dtype, sized like the engine (the same
    number of KV blocks, or enough for every request at once if the engine's cache is smaller)."""

    def __init__(self, opts: BenchOptions, requests: list[BenchRequest], kv_blocks: int) -> None:
        from transformers import AutoTokenizer

        from conveyor.bench.peers import load_hf_model, token_ids

        assert opts.model is not None
        self.opts = opts
        self.requests = requests
        self.cfg = opts.engine_config()
        device = resolve_device(self.cfg.device)  # the engine's own rules: the peers run as it does
        self.model = load_hf_model(opts.model, resolve_dtype(self.cfg.dtype, device), str(device))
        self.prompts = token_ids(requests, AutoTokenizer.from_pretrained(opts.model).encode)
        self.num_blocks = max(kv_blocks, _blocks_for(self.prompts, requests, self.cfg.block_size))
        _hf_warm_up(self.model, self.prompts)

    def run_round(self, console: Console) -> dict[str, RunResult]:
        from conveyor.bench.peers import run_hf_cb, run_hf_static

        n, cfg = len(self.requests), self.cfg
        with progress_bar(console, "hf-static", n, self.opts.progress) as advance:
            static = run_hf_static(
                self.model, self.requests, self.prompts, batch_size=cfg.max_num_seqs, progress=advance
            )
        with progress_bar(console, "hf-cb", n, self.opts.progress) as advance:
            cb = run_hf_cb(
                self.model,
                self.requests,
                self.prompts,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                num_blocks=self.num_blocks,
                block_size=cfg.block_size,
                progress=advance,
            )
        return {"hf-static": static, "hf-cb": cb}


def _blocks_for(prompts: list[list[int]], requests: list[BenchRequest], block_size: int) -> int:
    """Enough KV blocks for every request at once (the engine's own cache is at least this big on CPU)."""
    return sum(-(-(len(p) + r.max_tokens) // block_size) for p, r in zip(prompts, requests, strict=True)) + 1


def _hf_warm_up(model: Any, prompts: list[list[int]]) -> None:
    import torch

    ids = torch.tensor([prompts[0][:8]], device=model.device)
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=model.config.pad_token_id or 0,
        )


# --- one-parameter experiments -----------------------------------------------------------------------


def experiment(
    opts: BenchOptions,
    param: str,
    values: list[str],
    approve: list[str],
    hypothesis: str | None,
    console: Console,
) -> list[dict[str, Any]]:
    """The baseline and each value alone, `opts.repeat` interleaved rounds each (best round kept); a
    decision sheet per value, and a sweep plot for several."""
    if opts.target != "engine":
        raise ValueError("compare/sweep: one-parameter experiments run with the in-process engine target")
    conditions = [Condition.parse(c) for c in (approve or default_conditions(bool(opts.deadlines_s())))]
    for v in values:  # every value validated before any run, the calibration included
        with_param(opts, param, v)
    apply_load(opts, console)
    candidates = [with_param(opts, param, v) for v in values]  # each with the baseline's rates
    requests, description = build_workload(opts)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    trace_sha = save_trace(requests, opts.out_dir / "trace.jsonl")
    input_set = workload_record(opts, requests, description, trace_sha)
    base_value = current_value(opts, param)
    variants = [(f"{param}={base_value} (baseline)", opts, opts.out_dir / "baseline")]
    variants += [
        (f"{param}={v}", c, opts.out_dir / f"{param}={v}") for v, c in zip(values, candidates, strict=True)
    ]
    rounds: list[list[tuple[RunResult, Any]]] = [[] for _ in variants]
    for i in range(opts.repeat):
        for (label, variant_opts, _), results in zip(variants, rounds, strict=True):
            console.print(f"{label}" + (f", round {i + 1} of {opts.repeat}" if opts.repeat > 1 else ""))
            result, engine = run_target(variant_opts, requests, console)
            results.append((result, (str(engine.runner.device), engine.runner.dtype)))
            del engine
    runs = [_best_run(o, results, out) for (_, o, out), results in zip(variants, rounds, strict=True)]
    baseline = runs[0]
    sheets, summaries = [], [baseline["metrics"]]
    for value, cand_opts, cand in zip(values, candidates, runs[1:], strict=True):
        summaries.append(cand["metrics"])
        sheet = {
            "hypothesis": hypothesis or default_hypothesis(param, base_value, value, conditions),
            "parameter": param,
            "baseline_value": base_value,
            "candidate_value": parse_value(value),
            "input_set": input_set,
            "decision": decide(conditions, cand["metrics"], baseline["metrics"]),
            "baseline": baseline["metrics"],
            "candidate": cand["metrics"],
            "baseline_run": {k: v for k, v in baseline.items() if k != "metrics"},
            "candidate_run": {k: v for k, v in cand.items() if k != "metrics"},
            "inventory": inventory(
                opts.model, {"baseline": opts.parameters(), "candidate": cand_opts.parameters()},
                opts.thread_choice,
            ),
        }
        stem = "decision" if len(values) == 1 else f"decision-{param}={value}"
        _, md = write_decision(sheet, opts.out_dir, stem)
        verdict = "APPROVED" if sheet["decision"]["approved"] else "REJECTED"
        console.print(
            summary_table(
                f"{param}: {base_value} -> {value}: {verdict}", {"baseline": baseline, "candidate": cand}
            )
        )
        lines = [run_line("baseline", baseline), run_line("candidate", cand), wall_time_ratio(baseline, cand)]
        for line in lines:
            console.print(line, markup=False)
        console.print(f"decision sheet: {md}")
        sheets.append(sheet)
    if len(values) > 1:
        plots.sweep_plot(param, [f"{base_value} (baseline)", *values], summaries, opts.out_dir / "sweep.png")
        (opts.out_dir / "sweep.json").write_text(
            json.dumps(
                {
                    "parameter": param,
                    "values": [base_value, *map(parse_value, values)],
                    "input_set": input_set,
                    "summaries": summaries,
                    "approved": [s["decision"]["approved"] for s in sheets],
                },
                indent=2,
                default=str,
            )
        )
    return sheets


def _best_run(opts: BenchOptions, results: list[tuple[RunResult, Any]], out_dir: Path) -> dict[str, Any]:
    """The summary of a variant's best round (highest output tokens/s), with every round's throughput."""
    result, (device, dtype) = max(results, key=lambda r: output_rate(r[0]))
    run = run_summary(opts, result, measure_bound(opts, result, device, dtype))
    run["rounds_output_tokens_per_s"] = [output_rate(r) for r, _ in results]
    run["plots"] = run_plots(result, out_dir)
    return run
