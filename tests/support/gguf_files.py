"""GGUF files written from a Hugging Face folder with the gguf package's writer, for tests: the metadata and
tensor names llama.cpp uses (gguf's own name map), q/k rows of llama models permuted to GGML's rotary layout
(as llama.cpp stores them), 2-D weights in the tensor type asked for (K-quants: random blocks) and 1-D
ones in F32, the byte-level BPE tokenizer as a `gpt2` vocabulary with its merges. Enough for transformers
and Conveyor to read the same file; not a general converter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# HF model_type -> gguf architecture name
# (Gemma's files would need its norms stored as 1 + w, and a SentencePiece vocabulary: transformers saves a
# Gemma tokenizer read from a byte-level vocabulary as one that encodes otherwise.)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}
# The gguf package writes no K-quants: their blocks are random bytes instead (seeded), with the fp16 scales of
# each block (these byte ranges of it, as ggml lays the block out) set to a small finite value.
K_QUANT_SCALES = {"Q4_K": ((0, 2), (2, 4)), "Q5_K": ((0, 2), (2, 4)), "Q6_K": ((208, 210),)}
K_SCALE = np.float16(0.001)  # weights within about +-4 (Q6_K: int8 scales x 6-bit values)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


def write_gguf(model_dir: Path, out: Path, tensor_type: str = "F32") -> Path:
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHITECTURES[config["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_config(writer, config)
    _write_tokenizer(writer, model_dir, config["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            data = _ggml_layout(name, tensor.astype(np.float32), config, arch)
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, data)
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(gguf_name, data.astype(np.float16))
            elif tensor_type in K_QUANT_SCALES:
                writer.add_tensor(gguf_name, _random_k_blocks(data.shape, tensor_type), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _random_k_blocks(shape: tuple[int, ...], tensor_type: str) -> np.ndarray:
    """[rows, bytes of a row] of K-quant blocks; rows must hold whole blocks (256 values)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor_type]]
    rows, cols = shape
    assert cols % block == 0, f"a {tensor_type} row holds whole blocks of {block}, not {cols} values"
    raw = np.random.default_rng(cols * rows).integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for start, end in K_QUANT_SCALES[tensor_type]:
        raw[:, start:end] = np.frombuffer(K_SCALE.tobytes(), dtype=np.uint8)
    return raw.reshape(rows, cols // block * size)


def _write_config(writer: Any, config: dict[str, Any]) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])


def _write_tokenizer(writer: Any, model_dir: Path, vocab_size: int) -> None:
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    special = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = [f"<unused{i}>" for i in range(vocab_size)]
    types = [TOKEN_UNUSED] * vocab_size
    for token, index in {**vocab, **special}.items():
        tokens[index] = token
        types[index] = TOKEN_CONTROL if token in special else TOKEN_NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special["<s>"])
    writer.add_eos_token_id(special["</s>"])
    writer.add_pad_token_id(special["<pad>"])
    writer.add_add_bos_token(True)
    template = model_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def _ggml_layout(name: str, data: np.ndarray, config: dict[str, Any], arch: str) -> np.ndarray:
    """llama.cpp keeps a llama model's q and k rows with each head's two rotary halves interleaved."""
    if arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return data
    heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
    rows = data.shape[0]
    return data.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(data.shape)
