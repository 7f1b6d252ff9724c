"""The engine's one configuration object. The engine never reads environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.engine.speculation.config import SpeculativeConfig, speculative_config

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # engine/quantization.py


SCHEDULING = ("urgency", "arrival")
TASKS = ("auto", "generate", "embed")  # engine/pooling.py resolve_task
POOLING_METHODS = ("cls", "mean", "last")
MAX_RANK_LIMIT = 256  # the largest max_lora_rank: LoRA slots are sized by it, for every layer and projection


@dataclass(frozen=True)
class RequestClassConfig:
    """One request class (the service maps its queues onto these)."""

    name: str
    max_running: int
    priority: int = 0  # lower value = served first

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("request_classes: a class needs a non-empty name")
        if self.max_running < 1:
            raise ValueError(f"request_classes[{self.name}].max_running must be >= 1, got {self.max_running}")


@dataclass
class EngineConfig:
    # A local Hugging Face folder, a GGUF file, a hub id (owner/name), package:DIST or preset:NAME
    # (engine/model_source.py)
    model: str
    revision: str | None = None  # of a hub id: a branch, tag or commit; None: main
    # The chat template's text (Jinja) that renders chat prompts in place of the model folder's own (as
    # vLLM's --chat-template); None: the folder's. The service resolves its setting to this text.
    chat_template: str | None = None
    # Where GGUF files are converted and presets built; None: ~/.cache/conveyor/models. Hub ids go to the
    # Hugging Face cache (HF_HOME).
    model_cache_dir: str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides both sizing rules below
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Largest prefill chunk of one request per step (0 = no cap): a long prompt cannot take a whole step,
    # so the prefills of requests that arrive behind it (a chat message behind a document) keep moving.
    long_prefill_token_threshold: int = 512
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # Weight-only quantization, applied at load (engine/quantization.py): "int8", "int4" (groups of 32),
    # "none" (the dtype above), or "auto": a GGUF file's own (int4 for a Q4 file), else none.
    quantization: str | None = "auto"  # None: "none"
    device: str = "auto"  # auto: cuda when available, else cpu
    # auto: triton on CUDA; on CPU, cpu (C++ kernels compiled on first use: decode attention and the fused
    # RMSNorm/RoPE/SwiGLU) where they build, else torch (eager PyTorch)
    attention_backend: str = "auto"
    # Automatic prefix caching: full KV blocks are found again by the hash of the prefix they end, so requests
    # that share a prefix (a batch's instructions, a chat's history) compute it once. Off: to compare.
    enable_prefix_caching: bool = True
    # How requests of one class are ordered: urgency (their priority, then the slack to a deadline still
    # ahead, then arrival: engine/sequence.py Urgency) or arrival (urgency ignored). Arrival: to compare.
    scheduling: str = "urgency"
    request_classes: list[RequestClassConfig] = field(default_factory=list)
    seed: int = 0
    # torch intra-op threads, set once when the runner is built (process-wide); None: leave torch's setting.
    # On a shared CPU fewer threads can be faster (each op waits for its slowest thread). The engine applies
    # only this explicit count; callers that want a measured one use engine/cpu_threads.py's
    # choose_cpu_threads (the service and the bench do, on CPU, when no count is given).
    num_threads: int | None = None
    # Structured outputs: a constraint not seen before is test-compiled in a child process killed after this
    # long (or when it allocates more than grammar_compile_memory_bytes), so one costly schema fails alone
    # instead of holding a core for minutes (engine/structured_output/probe.py). None: compile with no limit,
    # no child.
    grammar_compile_timeout_s: float | None = 5.0
    grammar_compile_memory_bytes: int = 2 * 2**30
    grammar_cache_bytes: int = 512 * 2**20  # compiled grammars kept for reuse, by the memory they hold
    # What the engine serves: "generate" (text) or "embed" (one vector per input: PoolingParams requests).
    # auto: embed when the folder is a sentence-transformers one (modules.json) or the model cannot
    # generate (an encoder such as BERT, a decoder saved without its LM head), else generate.
    # NOTE: an encoder computes a request's whole input in one step (attention is bidirectional: no
    # chunking), so its engine raises max_num_batched_tokens to its max_model_len when it is lower.
    task: str = "auto"
    # Embed engines: how hidden states become one vector ("cls" | "mean" | "last") and whether vectors are
    # L2-normalised by default. None: what the sentence-transformers folder says, else engine/pooling.py's
    # defaults (encoder: cls, decoder: last; normalised).
    pooling: str | None = None
    normalize_embeddings: bool | None = None
    # LoRA adapters (engine/lora/): how many may be on the device at once (requests for more wait: the
    # scheduler keeps the running requests' adapters within it; 0: LoRA off, no slot memory taken), the
    # largest rank an adapter may have (the slots are sized by it), and how many adapters stay read in host
    # memory (None: max_loras; the others are read from disk again when a request needs them).
    max_loras: int = 0
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None
    # Speculative decoding (engine/speculation/): "ngram" or "suffix" with their defaults, a dict of
    # SpeculativeConfig fields, or None / "none": off.
    speculative: SpeculativeConfig | str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.request_classes = [
            c if isinstance(c, RequestClassConfig) else RequestClassConfig(**c) for c in self.request_classes
        ]
        if not self.request_classes:
            self.request_classes = [RequestClassConfig("default", max_running=self.max_num_seqs)]
        names = [c.name for c in self.request_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"request_classes: duplicate class names in {names}")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, ">= 1"
        )
        _require(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "one of 8, 16, 32, 64, 128",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            self.long_prefill_token_threshold,
            ">= 0",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )
        _require(self.scheduling in SCHEDULING, "scheduling", self.scheduling,
                 f"one of {', '.join(SCHEDULING)}")
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 1, "num_kv_blocks", self.num_kv_blocks, ">= 1")
        if self.kv_cache_memory_bytes is not None:
            _require(
                self.kv_cache_memory_bytes >= 1, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, ">= 1"
            )
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "num_threads", self.num_threads, ">= 1")
        if self.grammar_compile_timeout_s is not None:
            _require(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s",
                     self.grammar_compile_timeout_s, "> 0 or None")
        _require(self.grammar_compile_memory_bytes >= 2**20, "grammar_compile_memory_bytes",
                 self.grammar_compile_memory_bytes, ">= 1 MiB")
        _require(self.grammar_cache_bytes >= 0, "grammar_cache_bytes", self.grammar_cache_bytes, ">= 0")
        _require(self.max_loras >= 0, "max_loras", self.max_loras, ">= 0")
        _require(1 <= self.max_lora_rank <= MAX_RANK_LIMIT, "max_lora_rank", self.max_lora_rank,
                 f"in [1, {MAX_RANK_LIMIT}]")
        if self.max_cpu_loras is not None:
            _require(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", self.max_cpu_loras,
                     f">= max_loras ({self.max_loras}) or None")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        if self.quantization is None:  # what `quantization=none` parses to in the bench's --set and --compare
            self.quantization = "none"
        _require(self.quantization in QUANTIZATIONS, "quantization", self.quantization,
                 f"one of {QUANTIZATIONS}")
        _require(self.task in TASKS, "task", self.task, f"one of {TASKS}")
        self.speculative = speculative_config(self.speculative)
        _require(self.pooling is None or self.pooling in POOLING_METHODS, "pooling", self.pooling,
                 f"None or one of {POOLING_METHODS}")
        _require(self.normalize_embeddings is None or isinstance(self.normalize_embeddings, bool),
                 "normalize_embeddings", self.normalize_embeddings, "None, True or False")
        _require(
            isinstance(self.enable_prefix_caching, bool),
            "enable_prefix_caching",
            self.enable_prefix_caching,
            "True or False",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            self.attention_backend,
            f"one of {ATTENTION_BACKENDS}",
        )

    def request_class(self, name: str) -> RequestClassConfig:
        for c in self.request_classes:
            if c.name == name:
                return c
        raise ValueError(
            f"request_class: unknown class {name!r}; known: {[c.name for c in self.request_classes]}"
        )


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
