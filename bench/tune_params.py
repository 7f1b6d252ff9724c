"""What `conveyor tune` may change, and where it starts from.

A parameter is an engine field (experiment.ENGINE_FIELDS: `max_num_seqs`, `max_num_batched_tokens`, ...) or a
queue's `queues.<group>.max_running` / `queues.<group>.priority`, written as in Conveyor's config file; the
bench knows the latter as `<group>.max_running`. A configuration gives every tuned parameter a value; its key
(`max_num_seqs=16,documents...`) names it in the resume file, the run log and the report.

The baseline is production as the trace's header recorded it (the replayed model's engine settings that were
set, its queues' max_running and priority), else the bench's defaults.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from conveyor.bench.experiment import ENGINE_FIELDS, BenchOptions, current_value, parse_value, with_param

QUEUE_FIELDS = ("max_running", "priority")
# Engine settings that describe the machine (or, chat_template, the service's form of a template the engine
# takes as text), not how it schedules: production's are not replayed on the tuning machine.
HOST_FIELDS = frozenset({"device", "num_threads", "attention_backend", "chat_template", "model_cache_dir"})

Config = dict[str, Any]  # tuned parameter name -> value


@dataclass(frozen=True)
class TuneParam:
    name: str  # as written: max_num_seqs, queues.documents.max_running
    bench_param: str  # as with_param takes it: max_num_seqs, documents.max_running
    values: tuple[Any, ...]  # in the order given (parse_value's types)

    def queue(self) -> tuple[str, str] | None:
        """(queue, field) of a queue parameter, None for an engine field."""
        if not self.name.startswith("queues."):
            return None
        _, group, field = self.name.split(".")
        return group, field


def parse_param(text: str, opts: BenchOptions) -> TuneParam:
    """`NAME=V1,V2,...` -> TuneParam, every value checked by building its engine configuration."""
    name, eq, listed = text.partition("=")
    values = [v.strip() for v in listed.split(",")]
    if not eq or not name or not all(values):
        raise ValueError(f"param: expected NAME=VALUE[,VALUE...], got {text!r}")
    param = TuneParam(name, bench_param(name, opts), tuple(parse_value(v) for v in values))
    for value in param.values:  # each checked before any run
        try:
            with_param(opts, param.bench_param, str(value))
        except ValueError as exc:
            raise ValueError(f"param {name}={value}: {exc}") from exc
    if len(set(map(_canonical, param.values))) != len(param.values):
        raise ValueError(f"param {name}: a value is listed twice in {listed!r}")
    return param


def parse_params(texts: list[str], opts: BenchOptions) -> list[TuneParam]:
    if not texts:
        raise ValueError("param: give at least one --param NAME=V1,V2,...")
    params = [parse_param(t, opts) for t in texts]
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError(f"param: each parameter once (its values comma-separated), got {names}")
    return params


def bench_param(name: str, opts: BenchOptions) -> str:
    """The bench's name of a tuned parameter. ValueError for an unknown one, naming what is known."""
    if name in ENGINE_FIELDS:
        return name
    parts = name.split(".")
    groups = [g.name for g in opts.groups]
    if len(parts) == 3 and parts[0] == "queues" and parts[2] in QUEUE_FIELDS:
        if parts[1] not in groups:
            raise ValueError(f"param {name}: the trace has no queue {parts[1]!r}; its queues: {groups}")
        return f"{parts[1]}.{parts[2]}"
    raise ValueError(
        f"param {name}: use an engine field {sorted(ENGINE_FIELDS)} or queues.QUEUE.max_running / "
        f"queues.QUEUE.priority with QUEUE one of the trace's queues {groups}"
    )


def baseline_config(params: list[TuneParam], opts: BenchOptions) -> Config:
    return {p.name: current_value(opts, p.bench_param) for p in params}


def config_key(params: list[TuneParam], config: Config) -> str:
    """`name=value,...` in the parameters' order; values as JSON, so 16 and "16" stay apart."""
    return ",".join(f"{p.name}={_canonical(config[p.name])}" for p in params)


def options_for(opts: BenchOptions, params: list[TuneParam], config: Config) -> BenchOptions:
    """opts with every tuned parameter at the configuration's value."""
    for p in params:
        opts = with_param(opts, p.bench_param, str(config[p.name]))
    return opts


def replayed_model(header: dict[str, Any] | None, trace_model: str | None
                   ) -> tuple[str | None, dict[str, Any]]:
    """(model id, its inventory entry: source, engine, queues) of the model the trace's jobs are replayed
    for; (trace_model, {}) without a header or an inventory. ValueError when the header's inventory holds
    several models and none is chosen, or not the chosen one."""
    models: dict[str, Any] = ((header or {}).get("inventory") or {}).get("models") or {}
    if not models:
        return trace_model, {}
    if trace_model is None:
        if len(models) > 1:
            raise ValueError(f"trace-model: the trace holds several models ({', '.join(models)}); choose one "
                             "with --trace-model")
        trace_model = next(iter(models))
    if trace_model not in models:
        raise ValueError(f"trace-model: the trace's inventory has no model {trace_model!r}; it has "
                         f"{', '.join(models)}")
    return trace_model, dict(models[trace_model])


def production_options(opts: BenchOptions, entry: dict[str, Any]) -> tuple[BenchOptions, list[str]]:
    """opts with the recorded production settings of the replayed model (its inventory entry), and the
    names of the engine settings left out (HOST_FIELDS, or unknown to this engine)."""
    changed = copy.deepcopy(opts)
    skipped = []
    for name, value in (entry.get("engine") or {}).items():
        if value is None:  # unset: the engine's default, as the service would leave it
            continue
        if name in ENGINE_FIELDS and name not in HOST_FIELDS:
            changed.engine[name] = value
        else:
            skipped.append(name)
    groups = {g.name for g in opts.groups}
    for queue, limits in (entry.get("queues") or {}).items():
        for field in QUEUE_FIELDS:
            if queue in groups and (limits or {}).get(field) is not None:
                getattr(changed, field)[queue] = int(limits[field])
    changed.engine_config()  # production's values checked now, with EngineConfig's message
    return changed, skipped


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)
