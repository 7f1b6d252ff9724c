"""The service's one configuration object: env vars prefixed CONVEYOR_, an optional TOML file, defaults.

Precedence: keyword arguments > environment > TOML file (CONVEYOR_CONFIG_FILE or `--config`) > defaults.
Nested values use `__`: CONVEYOR_QUEUES__DOCUMENTS__MAX_RUNNING=1.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from core.request_rules import MAX_TTL_S

CONFIG_FILE_ENV = "CONVEYOR_CONFIG_FILE"
DEMO_MODEL_DIR = "demo-model"  # under data_dir, built by the first worker when no model is set


class QueueSettings(BaseModel):
    """Limits of one queue; each queue maps onto an engine request class of the same name."""

    max_queued: int = Field(1000, ge=1, description="submissions beyond this many queued jobs get 429")
    max_running: int = Field(16, ge=1, description="jobs of this queue inside one worker's engine at once")
    max_prompt_tokens: int = Field(2048, ge=1, description="longest prompt accepted (model tokenizer)")
    max_output_tokens: int = Field(512, ge=1, description="largest max_tokens accepted")
    priority: int = Field(0, description="engine class priority; lower is served first")
    deadline_s: float | None = Field(
        None, gt=0, le=MAX_TTL_S, allow_inf_nan=False,
        description="default ttl: jobs not started within this many seconds expire; None: never",
    )


def default_queues() -> dict[str, QueueSettings]:
    return {
        "interactive": QueueSettings(max_queued=1000, max_running=16, max_prompt_tokens=2048,
                                     max_output_tokens=512, priority=0, deadline_s=600.0),
        "documents": QueueSettings(max_queued=10000, max_running=4, max_prompt_tokens=32768,
                                   max_output_tokens=4096, priority=1, deadline_s=86400.0),
    }


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    # Storage and broker
    data_dir: Path = Path("data")
    database_url: str = Field("", description="SQLAlchemy URL; empty: sqlite file under data_dir")
    broker_url: str | None = Field(None, description="Celery broker (redis://...); None: in-process queue")

    # HTTP
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    auth_enabled: bool | None = Field(
        None, description="None: on unless bound to a loopback address; off is refused on other addresses"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_metadata_bytes: int = Field(4096, ge=2)
    retry_after_s: int = Field(2, ge=1, description="Retry-After sent with 429")
    metrics_token: SecretStr | None = Field(
        None,
        description="bearer token /metrics requires when set; None: /metrics is open with auth off and "
        "closed (401) with auth on, since the metrics are cluster-wide and a tenant's key must not read them",
    )
    docs_enabled: bool | None = Field(
        None, description="serve /docs, /redoc and /openapi.json (unauthenticated); None: only with auth off"
    )

    # Model and engine. Each engine field is the EngineConfig field of the same name, passed on only when
    # set (worker/model.py derives the EngineConfig): None means the engine's own default, documented once in
    # the README's configuration table. The API reads max_model_len too (prompt + max_tokens must fit).
    model: str | None = Field(None, description="Hugging Face folder; None: a random-weight demo model")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences in one engine step")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per step, prefill + decode")
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; None: the model's")
    block_size: int | None = Field(None, ge=1, description="tokens per KV cache block")
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    long_prefill_token_threshold: int | None = Field(
        None, ge=0, description="largest prefill chunk of one job per step, so others keep moving; 0: no cap"
    )
    dtype: str | None = None
    attention_backend: str | None = None
    device: str | None = None
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads; None: measured at start on CPU (engine.cpu_threads)"
    )
    enable_prefix_caching: bool | None = Field(
        None, description="reuse the KV cache of prompts' shared prefixes; None: the engine's default (on)"
    )
    grammar_compile_timeout_s: float | None = Field(
        None, gt=0, description="a new structured-output constraint that does not compile within this many "
        "seconds fails its job (invalid_request); None: the engine's default (5 s)"
    )
    grammar_compile_memory_bytes: int | None = Field(
        None, ge=2**20, description="memory one constraint's compile may take; None: the engine's default "
        "(2 GiB)"
    )
    grammar_cache_bytes: int | None = Field(
        None, ge=0, description="memory the compiled grammars kept for reuse may hold; None: the engine's "
        "default (512 MiB)"
    )

    # Queues
    queues: dict[str, QueueSettings] = Field(default_factory=default_queues)
    worker_queues: Annotated[list[str] | None, NoDecode] = Field(
        None, description="queues a `conveyor worker` consumes (comma-separated: `documents` for a pool of "
        "its own); None: every queue. The embedded service always runs every queue",
    )

    # Tenants: fair share and quotas (defaults; `conveyor tenants set` overrides them per tenant)
    tenant_weight: float = Field(
        1.0, gt=0, le=1e6, allow_inf_nan=False,
        description="a tenant's share of a queue's slots against the other tenants with work in it",
    )
    tenant_max_queued: int | None = Field(
        None, ge=1, description="queued jobs one tenant may have in one queue (429 beyond); None: only the "
        "queue's max_queued",
    )
    tenant_max_running: int | None = Field(
        None, ge=1, description="running jobs one tenant may have in one queue, across all workers, batch "
        "lines included; None: no cap beyond fair share",
    )
    tenant_tokens_per_minute: int | None = Field(
        None, ge=1, description="prompt + output tokens of the jobs one tenant submitted in the last minute "
        "(429 beyond); None: no limit",
    )

    # Reliability
    reconcile_interval_s: float = Field(2.0, gt=0)
    dispatch_grace_s: float = Field(5.0, gt=0, description="re-publish undispatched jobs older than this")
    worker_heartbeat_s: float = Field(2.0, gt=0)
    worker_dead_after_s: float = Field(15.0, gt=0)
    worker_shutdown_grace_s: float = Field(
        30.0, gt=0, description="at shutdown, in-flight jobs get this long to finish before they are requeued"
    )
    cancel_poll_s: float = Field(0.5, gt=0, description="worker poll period for cancels")
    max_attempts: int = Field(
        3, ge=1, description="runs a job gets when its worker keeps dying; then it fails with `worker_lost`"
    )
    worker_prune_after_s: float = Field(
        86400.0, gt=0, description="rows of workers stopped or silent this long are deleted from `workers`"
    )
    retention_days: int | None = Field(
        None, ge=1, description="finished jobs, ended batches, files and webhook deliveries older than this "
        "are purged; a tenant's own retention_days overrides it; None: kept forever",
    )
    purge_interval_s: float = Field(300.0, gt=0, description="how often each reconciler runs the purge")
    purge_chunk_rows: int = Field(500, ge=1, description="rows the purge deletes per transaction")
    worker_metrics_port: int | None = Field(
        None, ge=1, le=65535, description="a `conveyor worker` serves its engine's Prometheus metrics on "
        "this port, bound to `host`; None: not served (embedded: always on the server's own /metrics)",
    )

    # Webhooks
    webhook_allowlist: list[str] = Field(
        default_factory=list,
        description="hosts (optionally host:port) or IPs/CIDRs exempt from the SSRF guard; also permits http",
    )
    webhook_rotation_window_s: float = Field(86400.0, gt=0, description="old secret stays valid this long")
    webhook_timeout_s: float = Field(15.0, gt=0)
    webhook_concurrency: int = Field(
        8, ge=1, description="receivers one worker sends to at once, each one delivery at a time"
    )

    # S3 batches and uploaded files (credentials come from the standard AWS chain, never from here)
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, R2, ...)")
    s3_region: str | None = None
    files_url: str | None = Field(None, description="s3://bucket/prefix/ for uploads; None: data_dir/files")
    files_max_bytes: int = Field(512 << 20, ge=1024, description="largest upload (POST /v1/files)")
    batch_part_bytes: int = Field(8 << 20, ge=5 << 20, description="multipart upload part size")
    batch_max_line_bytes: int = Field(4 << 20, ge=1024)
    batch_window_jobs: int = Field(64, ge=1, description="jobs of one batch queued or running at once")
    batch_s3_allowlist: list[str] = Field(
        default_factory=list,
        description="buckets (`bucket`) or prefixes (`bucket/prefix`) batch inputs and outputs may name; "
        "empty: any location the workers' credentials reach (unsafe with several tenants)",
    )

    log_level: str = "INFO"
    access_log: bool = Field(
        False, description="one log line per HTTP request; off by default: /metrics counts requests by route "
        "and status, and at hundreds of requests per second the lines cost the API real CPU",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @field_validator("batch_s3_allowlist")
    @classmethod
    def _normalise_s3_locations(cls, entries: list[str]) -> list[str]:
        """`s3://bucket/prefix/` and `bucket/prefix` are the same entry; an empty bucket is refused."""
        normalised = [entry.removeprefix("s3://").rstrip("/") for entry in entries]
        for entry in normalised:
            if not entry.partition("/")[0]:
                raise ValueError(f"entries must be `bucket` or `bucket/prefix`, got {entry!r}")
        return normalised

    @field_validator("metrics_token", mode="before")
    @classmethod
    def _empty_token_is_unset(cls, value: Any) -> Any:
        """CONVEYOR_METRICS_TOKEN= (set but empty, as templated deployments often leave it) means no token,
        never a token that an empty Authorization header would match."""
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(raw, str) and not raw.strip():
            return None
        return value

    @field_validator("worker_queues", mode="before")
    @classmethod
    def _split_worker_queues(cls, value: Any) -> Any:
        """`interactive,documents` from the environment, a list from a config file; empty: every queue."""
        if isinstance(value, str):
            value = [name.strip() for name in value.split(",") if name.strip()]
        return value or None

    @field_validator("queues", mode="before")
    @classmethod
    def _merge_queue_defaults(cls, value: Any) -> Any:
        """A partial override (one queue, one field) keeps every other default queue and field."""
        if not isinstance(value, dict):
            return value
        merged: dict[str, Any] = {name: q.model_dump() for name, q in default_queues().items()}
        for name, q in value.items():
            given = q.model_dump(exclude_unset=True) if isinstance(q, QueueSettings) else dict(q)
            merged[name] = {**merged.get(name, {}), **given}
        return merged

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'conveyor.db').resolve()}"
        if self.auth_enabled is None:
            self.auth_enabled = not is_loopback(self.host)
        if self.docs_enabled is None:
            self.docs_enabled = not self.auth_enabled
        if not self.queues:
            raise ValueError("queues: at least one queue is required")
        unknown = sorted(set(self.worker_queues or []) - set(self.queues))
        if unknown:
            raise ValueError(f"worker_queues: unknown queue(s) {unknown}; known: {sorted(self.queues)}")
        return self

    def consumed_queues(self) -> dict[str, QueueSettings]:
        """The queues a `conveyor worker` takes jobs from, with their limits (worker_queues, or all). The
        embedded service takes every queue: it is the only worker its API has."""
        if self.worker_queues is None or self.embedded:
            return dict(self.queues)
        return {name: self.queues[name] for name in self.worker_queues}

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    def model_folder(self) -> Path:
        """The model the workers load: `model`, or the demo model a worker builds under data_dir."""
        return Path(self.model) if self.model else self.data_dir / DEMO_MODEL_DIR

    def served_model_id(self) -> str:
        """The model's public id (GET /v1/models, `model` in OpenAI requests and batch results): the model
        folder's name (the demo model's is "demo-model", in every mode) or the hub id as configured."""
        if not self.model:
            return DEMO_MODEL_DIR
        path = Path(self.model)
        return path.name if path.is_dir() else self.model

    def queue(self, name: str) -> QueueSettings | None:
        return self.queues.get(name)

    def check_bind(self) -> None:
        """Raises ValueError when asked to listen on a non-loopback address without authentication."""
        if not self.auth_enabled and not is_loopback(self.host):
            raise ValueError(
                f"host: refusing to listen on non-loopback address {self.host!r} with authentication off; "
                "enable auth (CONVEYOR_AUTH_ENABLED=true) and create keys with `conveyor keys create`"
            )


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings from keyword overrides, the environment and an optional TOML file."""
    path = config_file or os.environ.get(CONFIG_FILE_ENV) or None
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if path is None:
        return Settings(**overrides)
    if not Path(path).is_file():
        raise ValueError(f"config file: {path} does not exist")
    config = SettingsConfigDict(**{**Settings.model_config, "toml_file": path})
    file_settings: type[Settings] = type("FileSettings", (Settings,), {"model_config": config})
    return file_settings(**overrides)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to loopback addresses (e.g. localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
