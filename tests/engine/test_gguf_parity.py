"""GGUF files of each tensor type the engine reads, and of the llama, qwen2, qwen3 and phi3
architectures: the engine, given the file, generates greedily what transformers generates from the same file
(transformers' own GGUF loading), and the tokenizer read from the file encodes as the original one.

The files are written from tiny random-weight folders (tests/support/gguf_files.py). The real model's file
(SmolLM2, Q4_1 and Q8_0 tensors) is tests/engine/test_real_model.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor.checkpoints.gguf_file import check_gguf
from conveyor.engine.llm import LLM
from conveyor.engine.quantization import resolve_quantization
from conveyor.engine.sampling_params import SamplingParams
from tests.support.gguf_files import write_gguf

PROMPTS = ["The queue holds jobs", "A block table maps", "Every pause is counted"]
# What the engine holds each file's weights as by default (quantization "auto"): the file's own layout.
DEFAULT_QUANTIZATION = {"F32": "none", "F16": "none", "BF16": "none", "Q8_0": "int8", "Q4_0": "int4",
                        "Q4_1": "int4", "Q5_0": "int8", "Q5_1": "int8", "Q4_K": "int4", "Q5_K": "int8",
                        "Q6_K": "int8"}
MAX_TOKENS = 8
CASES = [
    ("LlamaForCausalLM", "F32"), ("LlamaForCausalLM", "F16"), ("LlamaForCausalLM", "BF16"),
    ("LlamaForCausalLM", "Q8_0"), ("LlamaForCausalLM", "Q4_0"), ("LlamaForCausalLM", "Q4_1"),
    ("LlamaForCausalLM", "Q5_0"), ("LlamaForCausalLM", "Q5_1"),
    # K-quants (random blocks: the gguf package cannot write them) need rows of whole 256-value blocks.
    ("LlamaForCausalLM", "Q4_K"), ("LlamaForCausalLM", "Q5_K"), ("LlamaForCausalLM", "Q6_K"),
    ("Qwen2ForCausalLM", "Q8_0"), ("Phi3ForCausalLM", "Q8_0"),  # Phi-3: fused qkv and gate_up tensors
    # transformers reads no head_dim from a qwen3 GGUF file and takes Qwen3's 128: so does the tiny model.
    ("Qwen3ForCausalLM", "Q4_1"),
]


def transformers_greedy(gguf: Path) -> tuple[list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    prompts, answers = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
        prompts.append(ids["input_ids"][0].tolist())
        answers.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return prompts, answers


@pytest.mark.parametrize(("arch", "tensor_type"), CASES)
def test_the_engine_reads_a_gguf_file_as_transformers_does(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, arch: str, tensor_type: str
) -> None:
    from transformers import AutoTokenizer

    shape = {"hidden_size": 256, "intermediate_size": 512} if tensor_type.endswith("_K") else {}
    folder = tiny_model_dir(arch, **shape, **({"head_dim": 128} if arch == "Qwen3ForCausalLM" else {}))
    gguf = write_gguf(folder, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    assert check_gguf(gguf).tensor_types[tensor_type] > 0
    prompts, answers = transformers_greedy(gguf)
    assert prompts == [AutoTokenizer.from_pretrained(folder)(p)["input_ids"] for p in PROMPTS]

    # The conversion is what is compared: the dequantized weights, as transformers holds them. By default the
    # engine requantizes them as the file was (tests/engine/test_real_model.py: SmolLM2's file, int4).
    llm = LLM(str(gguf), model_cache_dir=str(tmp_path / "cache"), quantization="none")
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [o.token_ids for o in outputs] == answers
    assert llm.engine.runner.hf_config["architectures"] == [arch]
    assert resolve_quantization("auto", llm.engine.config.model) == DEFAULT_QUANTIZATION[tensor_type]
