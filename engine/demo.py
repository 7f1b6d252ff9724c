"""A tiny random-weight Hugging Face model folder: for tests, the bench, and the service's demo mode.

The weights are random, so the text is gibberish, but the folder is a real checkpoint: transformers'
own config and model classes write it with `save_pretrained`, and the tokenizer is a real byte-level BPE
trained (deterministically) on a short embedded English corpus, with bos/eos/pad tokens and a chat
template. Anything that loads a Hugging Face folder can load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                   "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Small expert layers for the MoE families (overridable): 4 experts of half the dense width, 2 per token.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
    "Qwen3MoeForCausalLM": {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
# Some tokenizer classes add tokens on load (transformers' Qwen2Tokenizer adds an unk token): keep room.
TOKENIZER_HEADROOM = 8
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + TOKENIZER_HEADROOM  # bytes, special tokens, headroom
MAX_TOKENIZER_VOCAB = 2048  # the corpus is small: more merges would only repeat rare words

# Hermes-style tools: offered in a system turn, called as <tool_call>{"name", "arguments"}</tool_call>,
# answered in a tool turn. Without tools or tool turns it renders as a plain role-tagged conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTo call a function, answer "
    '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>. Functions:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|tool|>\n<tool_response>{{ message['content'] }}</tool_response>{{ eos_token }}\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = """\
The queue holds jobs until a worker is free. Each worker runs one engine on one device, and the engine
serves many requests at once. A request arrives with a prompt, waits in its class, and is admitted when
there is room in the batch. The scheduler gives every running request its next token first, then spends
what is left of the token budget on new prompts. Long documents are read in chunks so that short
messages keep moving. When memory runs out, the newest request of the lowest class is paused and computed
again later. Every pause is counted, because it costs time.
The model reads the prompt and writes one token at a time. Keys and values of earlier tokens stay in a
paged cache: blocks of sixteen tokens, handed out from a free list and returned when a request ends.
A block table maps the logical blocks of a sequence to the physical blocks on the device.
Good morning! How are you today? I would like a summary of this report, please. Thank you very much.
The weather is fine, the river is calm, and the small boats go slowly down to the sea. Children play in
the park while their parents talk about work, money, food, and the news of the day.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096. Dates: 2024-05-01, 2025-12-31.
Questions and answers, lists and tables, code and prose: a tokenizer should split them all into pieces
it has seen before, and fall back to single bytes for anything new.
def add(a, b):
    return a + b
{"role": "user", "content": "Write a haiku about queues."}
"""


def build_tiny_model(
    path: str | Path,
    arch: str = "LlamaForCausalLM",
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Write config.json, safetensors weights, generation_config.json and a tokenizer into `path`.

    Deterministic under `seed`. `max_shard_size` (e.g. "20KB") splits the weights over several files with
    a `model.safetensors.index.json`. `overrides` go to the transformers config class (e.g. `head_dim`,
    `attention_bias`, `rope_theta`, `initializer_range`).
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch: unsupported architecture {arch!r}; supported: {list(SUPPORTED_ARCHS)}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (bytes, special tokens, headroom), got {vocab_size}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(min(vocab_size - TOKENIZER_HEADROOM, MAX_TOKENIZER_VOCAB))
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<s>"), ("eos_token_id", "</s>"))}
    config = _make_config(arch, dict(
        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, intermediate_size=intermediate_size, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling, **ids, **overrides,
    ))
    model = _random_model(arch, config, seed)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        stale.unlink()  # a previous build's shards or index would shadow the new weights
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **save_kwargs)
    _generation_config(ids).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _make_config(arch: str, kwargs: dict[str, Any]) -> Any:
    import transformers

    # A large init std keeps greedy argmaxes far apart, so parity tests never hinge on near-ties.
    kwargs.setdefault("initializer_range", 0.5)
    if kwargs.get("rope_scaling") is None:
        kwargs.pop("rope_scaling")
    else:
        # transformers 5 keeps rope settings (theta included) under `rope_parameters`.
        theta = kwargs.pop("rope_theta", 10000.0)
        kwargs["rope_parameters"] = {"rope_theta": theta, **kwargs.pop("rope_scaling")}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        # Qwen3 decouples head_dim from hidden_size / heads (e.g. Qwen3-0.6B: 1024 / 16 heads, head_dim 128).
        kwargs.setdefault("head_dim", 2 * kwargs["hidden_size"] // kwargs["num_attention_heads"])
    for key, value in MOE_DEFAULTS.get(arch, {}).items():
        kwargs.setdefault(key, value)
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        kwargs.setdefault("moe_intermediate_size", kwargs["intermediate_size"] // 2)
    if arch == "Qwen2MoeForCausalLM":
        kwargs.setdefault("shared_expert_intermediate_size", kwargs["intermediate_size"])
    # Gemma 3's text-only model has its own config class (Gemma3Config is the multimodal one).
    name = "Gemma3TextConfig" if arch == "Gemma3ForCausalLM" else arch.replace("ForCausalLM", "Config")
    config_class = getattr(transformers, name)
    return config_class(**kwargs)


def _random_model(arch: str, config: Any, seed: int) -> Any:
    import transformers

    model_class = getattr(transformers, arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        _perturb_constant_parameters(model)
    return model.to(torch.float32).eval()


@torch.no_grad()
def _perturb_constant_parameters(model: torch.nn.Module) -> None:
    """Biases start at 0 and norm weights at 1; jitter them so tests see a wrong or missing mapping."""
    for param in model.parameters():
        if param.dim() == 1:
            param.add_(torch.randn_like(param) * 0.1)


def _generation_config(ids: dict[str, int]) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(**ids)


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos = SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=CHAT_TEMPLATE,
    )
