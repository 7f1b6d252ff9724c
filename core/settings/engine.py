"""The settings of a model's engine: the ones a model of the registry may set for itself ([models.ID] in the
config file), every other setting being the deployment's. Each engine field is the EngineConfig field of the
same name, passed on only when set (worker/model.py derives the EngineConfig): None means the engine's own
default, documented once in the settings reference (docs/, rendered from these descriptions). The API reads
max_model_len too (prompt + max_tokens must fit)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field

from conveyor.checkpoints.chat_template import resolve_chat_template

DEFAULT_MAX_LORAS = 4  # LoRA slots of a model with adapters when max_loras is unset
# The engine's speculation methods (engine/speculation/config.py METHODS; tests/core/test_settings.py holds
# them equal): named here so that a misspelt method is refused where the settings are read, in the API too,
# which never imports the engine.
SPECULATION_METHODS = ("ngram", "suffix")
SPECULATION_OFF = "none"


def _speculative_form(value: object) -> object:
    """The setting's form: off, a method, or an object of the engine's SpeculativeConfig fields with its
    method. The other fields' values are the engine's to judge (its EngineConfig, when a worker starts)."""
    methods = ", ".join(SPECULATION_METHODS)
    if value is None or value in (SPECULATION_OFF, *SPECULATION_METHODS):
        return value
    if isinstance(value, dict):
        method = value.get("method")
        if method in SPECULATION_METHODS and all(isinstance(key, str) for key in value):
            return value
        raise ValueError(f"an object of speculative fields needs `method`: one of {methods}, got {method!r}")
    raise ValueError(f"must be {SPECULATION_OFF}, one of {methods}, or an object of speculative fields with "
                     f"a method (e.g. {{\"method\": \"suffix\", \"num_tokens\": 6}}), got {value!r}")


def _chat_template_form(value: str | None) -> str | None:
    """The value as given, once it resolves to a template that compiles (checkpoints/chat_template.py): a
    bad one is refused where the settings are read, naming the setting, rather than at a worker's start."""
    if value is not None:
        resolve_chat_template(value)
    return value


# A path to a Jinja file, the template's own text, or a shipped template's name; None: the model's own.
ChatTemplate = Annotated[str | None, AfterValidator(_chat_template_form)]


# Off, a method with the engine's defaults, or {"method": ..., field: value, ...}; the engine's EngineConfig
# takes each of these forms as they are.
Speculative = Annotated[str | dict[str, Any] | None, BeforeValidator(_speculative_form)]


class EngineSettings(BaseModel):
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="how tool calls are read from the model's text (tool_choice auto): hermes "
        "(Hermes, Qwen: <tool_call>), llama3_json, mistral ([TOOL_CALLS]); auto: from the chat template's "
        "markers, hermes when it has none")
    chat_template: ChatTemplate = Field(
        None, description="the chat template that renders this model's messages in place of its own (as "
        "vLLM's --chat-template): the template itself (text holding `{{` or `{%`), the name of one "
        "Conveyor ships, or the path of a Jinja file. Shipped: `chatml-tools`, ChatML that renders tools, "
        "the assistant's tool calls and the tool results in the Hermes form (`<tool_call>`), for a "
        "ChatML model whose own template has none (SmolLM2: its tool messages are refused, 400, without "
        "it). The API (token counts, the roles it accepts, the tool parser) and the workers both render "
        "with it. A missing file, an unknown name or a template that does not compile is refused at "
        "start; unset = the model's own")
    revision: str | None = Field(
        None, description="of a model given as a Hugging Face hub id: the branch, tag or commit to serve; "
        "unset = main")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences in one engine step (the running set)")
    max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="tokens in one engine step (prefill chunks + decodes)",
    )
    max_model_len: int | None = Field(None, ge=1, description="longest prompt + output; unset = the model's")
    block_size: int | None = Field(None, ge=1, description="tokens per KV cache block")
    num_kv_blocks: int | None = Field(
        None, ge=1,
        description="exact KV cache size in blocks (overrides the two below)",
    )
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV cache size in bytes")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="on CUDA: share of device memory for weights + activations + KV cache",
    )
    long_prefill_token_threshold: int | None = Field(
        None, ge=0,
        description="largest prefill chunk of one job per step, so a long document cannot take a whole step "
        "from the prompts behind it; 0 = no cap",
    )
    dtype: str | None = Field(
        None,
        description="`auto` (float32 on CPU, bfloat16 on CUDA), `float32`, `float16`, `bfloat16`",
    )
    quantization: Literal["auto", "none", "int8", "int4"] | None = Field(
        None,
        description="weight-only quantization at load: `int8` (every projection and the embedding, a scale "
        "per 32 weights), `int4` (projections 4-bit with a scale and offset per 32; LM head and embedding "
        "int8), "
        "`none` (the dtype's weights); unset/`auto` = a GGUF file's own (int4 for Q4_0/Q4_1/Q4_K files, int8 "
        "for Q5-Q8), else none. Decoding reads every weight each step, so fewer bytes decode faster: see "
        "\"Quantized weights\" in docs/benchmarks/results.md",
    )
    speculative: Speculative = Field(
        None,
        description="speculative decoding: each step the model also verifies a few drafted next tokens per "
        "request, so one step can emit several; the output is the same as without it (greedy and sampled "
        "alike). `ngram` (drafts copied from the request's own earlier tokens, prompt and output: fits "
        "summaries, extraction, code edits), `suffix` (drafts from a suffix structure of its tokens with "
        "frequencies), each with the engine's defaults, or a JSON object of the engine's SpeculativeConfig "
        "fields with its method (`{\"method\": \"suffix\", \"num_tokens\": 6}`; the worker checks the "
        "values when it starts, naming a bad field); `none` or unset = off. A job may turn it off for "
        "itself (`speculate: false`); its drafted and accepted tokens are in its usage and in /metrics",
    )
    attention_backend: str | None = Field(
        None,
        description="`auto` (Triton on CUDA; on CPU `cpu` where its C++ kernels build, else `torch`), `cpu`,"
        " `torch`, `triton`. `cpu`: decode attention read in place, cache writes and the fused "
        "RMSNorm/RoPE/SwiGLU in C++; `torch`: eager PyTorch. See \"Decode attention read in "
        "place\" in docs/benchmarks/results.md",
    )
    device: str | None = Field(None, description="`auto`, `cpu`, `cuda`, `cuda:N`")
    num_threads: int | None = Field(
        None, ge=1,
        description="torch intra-op threads of the engine process; unset = measured at start on CPU (see "
        "\"Torch threads on CPU\" in docs/benchmarks/index.md), torch's default on a GPU. On a shared CPU 1"
        " can be fastest",
    )
    scheduling: Literal["urgency", "arrival"] | None = Field(
        None, description="how a queue's jobs are ordered, by fleet claims (within a tenant's stream) and by "
        "the engine: urgency (priority, then the slack to a deadline still ahead, then arrival) or arrival "
        "(priority and deadline ignored: to compare)")
    enable_prefix_caching: bool | None = Field(
        None,
        description="automatic prefix caching: jobs of one tenant (or one cache namespace) whose prompts "
        "share a prefix (a batch's instructions, a chat's history) compute its KV blocks once; a"
        " job's `usage.cached_tokens` (OpenAI: `usage.prompt_tokens_details.cached_tokens`) says"
        " how many prompt tokens it reused. `false` to compare",
    )
    grammar_compile_timeout_s: float | None = Field(
        None, gt=0,
        description="a structured-output constraint not seen before is test-compiled in a child process "
        "killed after this many seconds; past it the job fails `invalid_request` naming this "
        "setting (see \"One tenant's schema cannot stall the others\")",
    )
    grammar_compile_memory_bytes: int | None = Field(
        None, ge=2**20,
        description="memory that test compile may allocate (2 GiB); past it, likewise",
    )
    grammar_cache_bytes: int | None = Field(
        None, ge=0,
        description="memory the compiled grammars kept for reuse may hold (512 MiB), least recently used "
        "evicted first",
    )
    task: Literal["auto", "generate", "embed"] | None = Field(
        None, description="what the model serves: `generate` (chat and completions), `embed` "
        "(`/v1/embeddings`, embedding jobs), or `auto`: embed for a sentence-transformers folder (its "
        "`modules.json`) or a model that cannot generate (an encoder such as BERT or XLM-RoBERTa, a decoder "
        "saved without its LM head), else generate; unset = auto. A request of the other kind is refused "
        "with a 400 saying what the model serves")
    pooling: Literal["cls", "mean", "last"] | None = Field(
        None, description="how an embedding model pools its token states into one vector; unset = the "
        "sentence-transformers folder's Pooling module, else the engine's default for the architecture")
    normalize_embeddings: bool | None = Field(
        None, description="scale each embedding to unit length; unset = as the sentence-transformers folder "
        "says (a Normalize module)")
    max_loras: int | None = Field(
        None, ge=0, description="LoRA adapters on the device at once (requests for others wait for a slot); "
        f"unset = the model's adapters, at most {DEFAULT_MAX_LORAS}; 0 = LoRA off")
    max_lora_rank: int | None = Field(None, ge=1, le=256, description="the largest LoRA rank an adapter may "
                                      "have (the slots are sized by it); unset = 64")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept read in host memory; unset = max_loras")

    def chat_template_text(self) -> str | None:
        """The chat_template setting's template text (checkpoints/chat_template.py); None: the model's own."""
        if self.chat_template is None:
            return None
        try:
            return resolve_chat_template(self.chat_template)
        except ValueError as exc:  # a file gone since the settings were read
            raise ValueError(f"chat_template: {exc}") from None

    def speculation_method(self) -> str | None:
        """The speculation method its workers run (the `speculative` setting's); None: off."""
        given = self.speculative
        method = given.get("method") if isinstance(given, dict) else given
        return None if method in (None, SPECULATION_OFF) else str(method)


PER_MODEL_FIELDS = tuple(EngineSettings.model_fields)
