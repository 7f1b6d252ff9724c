"""Weight-only int8/int4 in the engine: each family's tiny model quantized at load generates what transformers
generates from the same weights dequantized (a folder whose projections hold exactly the values the
quantized ones stand for), through chunked prefill and preemption, on the `cpu` (C++ kernels) and `torch`
(reference) backends; with prefix-cache hits; its prompt logprobs within fp32 rounding of the dequantized
model's; the weights held in a fraction of the memory, a tied LM head and embedding sharing one table; LoRA
adapters on top of quantized weights as PEFT applies them to the dequantized ones; an encoder's embeddings
(all-MiniLM-L6-v2) kept close."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conveyor.engine.config import EngineConfig
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.quantization import HEAD_BITS, PROJECTION_BITS, QuantizedEmbedding, QuantizedLinear
from conveyor.engine.sampling_params import SamplingParams
from conveyor.kernels.quant_reference import dequantize, quantize
from tests.engine.model_families import FAMILIES
from tests.engine.test_model_families import hf_reference, make_requests, prefix_requests
from tests.support.engine import drain, run_staggered
from tests.support.lora_adapters import peft_greedy, save_peft_adapter

# The projections engine/quantization.py quantizes, by their Hugging Face names: attention, dense MLPs
# (Phi-3's fused ones too) and experts; not Qwen2-MoE's shared expert.
PROJECTION = re.compile(r"(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj"
                        r"|experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj))\.weight$")
HEADS = ("embed_tokens.weight", "lm_head.weight")
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Prompt logprobs of the quantized engine against the same engine on the dequantized folder: only the
# order of the fp32 sums differs (logprobs reach -20: a relative part too).
LOGPROB_ATOL, LOGPROB_RTOL = 1e-4, 1e-5

# Each family once per method, the two backends alternating between them.
CASES = [(family, method, backend) for family in ("llama", *FAMILIES)
         for method, backend in (("int4", "cpu"), ("int8", "torch"))]


def dequantized_copy(src: Path, dst: Path, method: str) -> Path:
    """`src` with every tensor the engine quantizes replaced by the values its quantized form stands for."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, tensor in tensors.items():
            bits = HEAD_BITS if name.endswith(HEADS) else PROJECTION_BITS[method]
            if name.endswith(HEADS) or PROJECTION.search(name):
                tensors[name] = dequantize(quantize(tensor, bits)).to(tensor.dtype)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory):
    built: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, method: str) -> tuple[Path, Path]:
        """(the family's tiny folder, its dequantized copy)."""
        if (family, method) not in built:
            arch, kwargs = FAMILIES.get(family, ("LlamaForCausalLM", {}))
            src = tiny_model_dir(arch, **kwargs)
            dst = tmp_path_factory.mktemp("dequantized") / f"{family}-{method}"
            built[family, method] = (src, dequantized_copy(src, dst, method))
        return built[family, method]

    return get


@pytest.mark.parametrize(("family", "method", "backend"), CASES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(folders, family: str, method: str,
                                                                      backend: str) -> None:
    # 13 blocks of 8 for 8 requests of up to 99 tokens at once (some preempted), prompt chunks of 24 at most
    # in steps of 32 tokens.
    src, dequantized = folders(family, method)
    engine = LLMEngine(EngineConfig(model=str(src), quantization=method, attention_backend=backend,
                                    num_kv_blocks=13, block_size=8, max_model_len=104,
                                    max_num_batched_tokens=32, long_prefill_token_threshold=24))
    assert engine.runner.quantization == method
    done = run_staggered(engine, make_requests(engine.vocab_size), first=8, then=0)
    assert engine.stats()["preemptions_total"] > 0
    assert done == hf_reference(dequantized)


def test_prefix_cache_hits_stay_exact(folders) -> None:
    src, dequantized = folders("mistral-window", "int4")
    engine = LLMEngine(EngineConfig(model=str(src), quantization="int4", attention_backend="cpu",
                                    num_kv_blocks=128, max_model_len=128, max_num_batched_tokens=48))
    done = run_staggered(engine, prefix_requests(engine.vocab_size), first=2, then=1)
    assert done == hf_reference(dequantized, "prefix")
    stats = engine.stats()["prefix_cache"]
    assert isinstance(stats, dict) and stats["hits_total"] > 0


def prompt_logprobs(model: Path, quantization: str, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt token's logprob (every prompt's, one after another), scored in chunks of 16."""
    engine = LLMEngine(EngineConfig(model=str(model), quantization=quantization, num_kv_blocks=64,
                                    max_num_batched_tokens=16, long_prefill_token_threshold=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    done = drain(engine)
    scored: list[float] = []
    for i, prompt in enumerate(prompts):
        positions = done[f"p{i}"].prompt_logprobs
        assert positions is not None
        scored.extend(entry[token] for entry, token in zip(positions[1:], prompt[1:], strict=True)
                      if entry is not None)
    return torch.tensor(scored)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_prompt_logprobs_are_the_dequantized_models(folders, method: str) -> None:
    src, dequantized = folders("llama", method)
    prompts = [prompt for _, prompt, _ in make_requests(512)[:4]]
    quantized = prompt_logprobs(src, method, prompts)
    reference = prompt_logprobs(dequantized, "none", prompts)
    original = prompt_logprobs(src, "none", prompts)
    torch.testing.assert_close(quantized, reference, atol=LOGPROB_ATOL, rtol=LOGPROB_RTOL)
    # ... and quantization did change the model: the original weights score otherwise.
    assert (quantized - original).abs().max() > 100 * LOGPROB_ATOL


def test_the_weights_take_a_fraction_of_the_memory_and_a_tied_table_is_shared(tiny_model_dir) -> None:
    src = tiny_model_dir("LlamaForCausalLM", tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    sizes = {}
    for method in ("none", "int8", "int4"):
        runner = LLMEngine(EngineConfig(model=str(src), quantization=method, num_kv_blocks=8,
                                         max_model_len=128)).runner
        sizes[method] = runner.weight_bytes
    model = runner.model
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, QuantizedLinear) and isinstance(embedding, QuantizedEmbedding)
    assert head.q is embedding.q and head.bits == HEAD_BITS
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    # fp32 is 4 bytes a weight; int8 1.125 (a scale per 32); int4 0.75 (and its int8 table); norms stay fp32.
    assert sizes["int8"] < 0.3 * sizes["none"]
    assert sizes["int4"] < 0.8 * sizes["int8"]


def test_an_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="x", quantization="int3")
    assert EngineConfig(model="x", quantization=None).quantization == "none"


def test_lora_adapters_apply_on_top_of_quantized_weights(folders, tmp_path: Path) -> None:
    """PEFT's greedy tokens with the adapter unmerged on the dequantized base are the reference."""
    src, dequantized = folders("llama", "int4")
    adapter = save_peft_adapter(src, tmp_path / "all4", rank=4, alpha=8, targets=ALL_LINEAR, seed=3)
    prompts = [prompt for _, prompt, _ in make_requests(512)[:4]]
    expected = peft_greedy(dequantized, adapter, prompts, [12] * len(prompts))
    engine = LLMEngine(EngineConfig(model=str(src), quantization="int4", max_loras=1, num_kv_blocks=64,
                                    attention_backend="cpu"))
    engine.add_lora("all4", adapter)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                           lora="all4")
    done = drain(engine)
    assert [done[f"r{i}"].token_ids for i in range(len(prompts))] == expected


def test_an_encoders_embeddings_stay_close_under_int8_and_int4(minilm_dir: Path) -> None:
    """all-MiniLM-L6-v2's projections quantized: each vector within cosine 0.99 (int8) and 0.95 (int4) of
    the unquantized one, and the pairs rank alike."""
    from conveyor.engine.llm import LLM
    from conveyor.engine.pooling_params import PoolingParams

    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today.",
             "Interest rates rose again this quarter."]

    def embed(quantization: str) -> torch.Tensor:
        llm = LLM(str(minilm_dir), quantization=quantization)
        assert llm.engine.runner.quantization == quantization
        return torch.tensor([out.embedding for out in llm.embed(texts, PoolingParams())])

    plain = embed("none")
    for method, floor in (("int8", 0.99), ("int4", 0.95)):
        quantized = embed(method)
        assert (quantized * plain).sum(-1).min() >= floor  # unit vectors: the dot is the cosine
        nearest = (quantized @ quantized.T).argsort(-1)[:, -2]  # each text's nearest other text
        assert nearest.tolist() == (plain @ plain.T).argsort(-1)[:, -2].tolist()
