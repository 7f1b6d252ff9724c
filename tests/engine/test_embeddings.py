"""Embedding engines end to end: decoders (chunked, preempted) and encoders (whole inputs) against
sentence-transformers as the oracle, PoolingParams, the errors, and EngineHost."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conveyor.engine import LLM, EngineConfig, EngineHost, LLMEngine, PoolingParams, SamplingParams
from conveyor.engine.scheduled_chunk import RunnerOutput, ScheduledChunk
from tests.support.embedding_models import build_decoder_st_folder
from tests.support.encoder_models import build_encoder_st_folder
from tests.support.engine import drain

ATOL = 1e-4
MAX_LEN = 100  # the decoders' max_seq_length
ENCODER_MAX_LEN = 64
CORPUS_LINES = [
    "Good morning!",
    "The queue holds jobs until a worker is free. Each worker runs one engine on one device, and the engine "
    "serves many requests at once.",
    "a",
    "Long documents are read in chunks so that short messages keep moving. When memory runs out, the newest "
    "request of the lowest class is paused and computed again later. Every pause is counted.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128. Dates: 2024-05-01, 2025-12-31.",
    "The weather is fine, the river is calm.",
]
LONG_TEXT = " ".join(CORPUS_LINES * 4)  # longer than any model's max length here
# Decoders: steps of at most 32 tokens and chunks of at most 16, over a cache of 15 blocks of 8 tokens
# (one max-length input needs 13): long inputs are chunked, and requests preempt each other.
DECODER_CONFIG = dict(max_num_batched_tokens=32, long_prefill_token_threshold=16, block_size=8,
                      num_kv_blocks=15, max_num_seqs=4)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> a sentence-transformers folder, built once per module."""
    builders: dict[str, Callable[[Path], Path]] = {
        "qwen2-last": lambda p: build_decoder_st_folder(p, arch="qwen2", pooling="lasttoken",
                                                        max_seq_length=MAX_LEN),
        "llama-mean": lambda p: build_decoder_st_folder(p, arch="llama", pooling="mean", normalize=False,
                                                        max_seq_length=MAX_LEN),
        "bert-mean": lambda p: build_encoder_st_folder(p, arch="bert", pooling="mean",
                                                       max_seq_length=ENCODER_MAX_LEN),
        "xlmr-cls": lambda p: build_encoder_st_folder(p, arch="xlm-roberta", pooling="cls",
                                                      max_seq_length=ENCODER_MAX_LEN),
    }
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = builders[name](tmp_path_factory.mktemp(name))
        return built[name]

    return get


def st_encode(folder: Path, texts: list[str], normalize: bool = True, **kwargs: object) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", **kwargs)
    return model.encode(texts, normalize_embeddings=normalize, convert_to_tensor=True).float()


def vectors(outputs: list) -> torch.Tensor:
    assert all(out.finish_reason == "stop" and out.embedding is not None for out in outputs)
    return torch.tensor([out.embedding for out in outputs])


@pytest.mark.parametrize("name", ["qwen2-last", "llama-mean"])
def test_decoder_embeddings_match_sentence_transformers_through_chunks_and_preemption(folders, name) -> None:
    folder = folders(name)
    llm = LLM(str(folder), **DECODER_CONFIG)
    assert (llm.engine.task, llm.engine.embedding_size, llm.engine.max_model_len) == ("embed", 64, MAX_LEN)
    outputs = llm.embed(CORPUS_LINES, PoolingParams(normalize=True))
    lengths = [len(out.prompt_token_ids) for out in outputs]
    assert max(lengths) > DECODER_CONFIG["max_num_batched_tokens"] and min(lengths) < 8, lengths
    assert llm.engine.scheduler.num_preemptions >= 1
    assert any(out.metrics.num_preemptions for out in outputs)
    torch.testing.assert_close(vectors(outputs), st_encode(folder, CORPUS_LINES), atol=ATOL, rtol=0)
    # Token ids embed as their text does.
    again = llm.embed([out.prompt_token_ids for out in outputs], PoolingParams(normalize=True))
    torch.testing.assert_close(vectors(again), vectors(outputs), atol=1e-5, rtol=0)
    totals = llm.engine.stats()["totals"]
    assert totals["embedded_requests"] == 2 * len(CORPUS_LINES) and totals["generated_tokens"] == 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("name", ["bert-mean", "xlmr-cls"])
def test_encoder_embeddings_match_sentence_transformers_whole_inputs(folders, name) -> None:
    folder = folders(name)
    llm = LLM(str(folder), max_num_batched_tokens=16, max_num_seqs=3)
    engine = llm.engine
    assert (engine.task, engine.max_model_len, engine.embedding_size) == ("embed", ENCODER_MAX_LEN, 32)
    assert engine.scheduler.max_num_batched_tokens == ENCODER_MAX_LEN  # raised: any input fits a step
    assert engine.block_manager.prefix_cache is None
    texts = [*CORPUS_LINES, LONG_TEXT]
    outputs = llm.embed(texts, PoolingParams(truncate=True))
    assert len(outputs[-1].prompt_token_ids) == ENCODER_MAX_LEN
    torch.testing.assert_close(vectors(outputs), st_encode(folder, texts), atol=ATOL, rtol=0)
    # Each input computed once, whole: no chunk, no preemption.
    assert engine.stats()["totals"]["prefill_tokens"] == sum(len(out.prompt_token_ids) for out in outputs)
    assert engine.scheduler.num_preemptions == 0
    again = llm.embed([out.prompt_token_ids for out in outputs])
    torch.testing.assert_close(vectors(again), vectors(outputs), atol=1e-6, rtol=0)


def test_folder_defaults_and_engine_overrides(folders) -> None:
    from sentence_transformers import SentenceTransformer, models

    llama = folders("llama-mean")  # saved without a Normalize module: vectors are not normalised by default
    outputs = LLM(str(llama), **DECODER_CONFIG).embed(CORPUS_LINES[:3])
    torch.testing.assert_close(vectors(outputs), st_encode(llama, CORPUS_LINES[:3], normalize=False),
                               atol=ATOL, rtol=0)
    # EngineConfig.pooling / normalize_embeddings override the folder.
    qwen = folders("qwen2-last")
    llm = LLM(str(qwen), pooling="mean", normalize_embeddings=False, **DECODER_CONFIG)
    transformer = models.Transformer(str(qwen))
    oracle = SentenceTransformer(modules=[transformer, models.Pooling(64, pooling_mode="mean")], device="cpu")
    expected = oracle.encode(CORPUS_LINES[:3], convert_to_tensor=True)
    torch.testing.assert_close(vectors(llm.embed(CORPUS_LINES[:3])), expected, atol=ATOL, rtol=0)


def test_text_gets_the_default_prompt_and_lower_case_as_in_sentence_transformers(folders, tmp_path) -> None:
    folder = shutil.copytree(folders("qwen2-last"), tmp_path / "prompted")
    edit_json(folder / "config_sentence_transformers.json",
              {"prompts": {"query": "Query: ", "document": ""}, "default_prompt_name": "query"})
    edit_json(folder / "sentence_bert_config.json", {"do_lower_case": True})
    texts = ["Hello World", "The Queue HOLDS jobs"]
    llm = LLM(str(folder), **DECODER_CONFIG)
    outputs = llm.embed(texts)
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("query: hello world")
    torch.testing.assert_close(vectors(outputs), st_encode(folder, texts), atol=ATOL, rtol=0)
    # Token ids are embedded as they are.
    [raw] = llm.embed([llm.tokenizer.encode("Hello World")])
    assert raw.prompt_token_ids == llm.tokenizer.encode("Hello World")


def edit_json(path: Path, changes: dict[str, object]) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_dimensions_truncate_then_renormalise(folders) -> None:
    folder = folders("qwen2-last")
    llm = LLM(str(folder), **DECODER_CONFIG)
    outputs = llm.embed(CORPUS_LINES[:3], PoolingParams(dimensions=16))
    assert all(len(out.embedding) == 16 for out in outputs)
    expected = st_encode(folder, CORPUS_LINES[:3], truncate_dim=16)
    torch.testing.assert_close(vectors(outputs), expected, atol=ATOL, rtol=0)
    raw = vectors(llm.embed(CORPUS_LINES[:3], PoolingParams(dimensions=16, normalize=False)))
    assert not torch.allclose(raw.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=1), expected, atol=ATOL, rtol=0)


def test_truncate_cuts_to_the_max_length_and_is_refused_without(folders) -> None:
    folder = folders("qwen2-last")
    llm = LLM(str(folder), **DECODER_CONFIG)
    [out] = llm.embed([LONG_TEXT], PoolingParams(truncate=True))
    assert len(out.prompt_token_ids) == MAX_LEN
    torch.testing.assert_close(vectors([out]), st_encode(folder, [LONG_TEXT]), atol=ATOL, rtol=0)
    n = len(llm.tokenizer.encode(LONG_TEXT))
    with pytest.raises(ValueError, match=f"input is {n} tokens; the model embeds at most {MAX_LEN}"):
        llm.embed([LONG_TEXT])
    ids = list(range(3, 3 + 2 * MAX_LEN))
    [cut] = llm.embed([ids], PoolingParams(truncate=True))
    assert cut.prompt_token_ids == ids[:MAX_LEN]
    with pytest.raises(ValueError, match=f"input is {2 * MAX_LEN} tokens"):
        llm.embed([ids])


def test_bad_requests_are_refused_naming_the_field(folders, llama_dir: Path) -> None:
    for kwargs, field in [({"dimensions": 0}, "dimensions"), ({"dimensions": "8"}, "dimensions"),
                          ({"dimensions": True}, "dimensions"), ({"normalize": "yes"}, "normalize"),
                          ({"truncate": 1}, "truncate")]:
        with pytest.raises(ValueError, match=field):
            PoolingParams(**kwargs)  # type: ignore[arg-type]
    embed = LLMEngine(EngineConfig(model=str(folders("qwen2-last")), **DECODER_CONFIG))
    with pytest.raises(ValueError, match=r"dimensions must be at most the model's embedding size \(64\)"):
        embed.add_request("r", "hello", PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="serves embeddings and generates no text"):
        embed.add_request("r", "hello", SamplingParams())
    with pytest.raises(ValueError, match="prompt: token ids"):
        embed.add_request("r", [1, 10_000], PoolingParams())
    with pytest.raises(ValueError, match="serves embeddings"):
        LLM(str(folders("qwen2-last")), **DECODER_CONFIG).generate(["hello"])
    generate = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, max_model_len=256))
    assert (generate.task, generate.embedding_size) == ("generate", None)
    with pytest.raises(ValueError, match="generates text and serves no embeddings"):
        generate.add_request("r", "hello", PoolingParams())
    assert not embed.has_unfinished_requests() and not generate.has_unfinished_requests()


def test_what_a_model_serves_follows_task(folders, llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="without its LM head"):
        LLMEngine(EngineConfig(model=str(folders("qwen2-last")), task="generate", **DECODER_CONFIG))
    with pytest.raises(ValueError, match="is an encoder"):
        LLMEngine(EngineConfig(model=str(folders("bert-mean")), task="generate"))
    # A generation checkpoint can embed (its head is dropped): last token, normalised, by default.
    from transformers import AutoModel

    engine = LLMEngine(EngineConfig(model=str(llama_dir), task="embed", num_kv_blocks=64, max_model_len=256))
    assert engine.pooling is not None and (engine.pooling.method, engine.pooling.normalize) == ("last", True)
    assert engine.runner.model.lm_head is None
    ids = engine.tokenizer.encode("The queue holds jobs.")
    engine.add_request("r", ids, PoolingParams())
    [out] = drain(engine).values()
    hidden = AutoModel.from_pretrained(str(llama_dir)).eval()(torch.tensor([ids])).last_hidden_state
    expected = torch.nn.functional.normalize(hidden[0, -1], dim=0)
    torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=ATOL, rtol=0)


def test_mean_pooling_takes_no_prefix_cache_hits_last_token_does(folders) -> None:
    text = CORPUS_LINES[1]
    last = LLM(str(folders("qwen2-last")), **DECODER_CONFIG)
    first, second = last.embed([text])[0], last.embed([text])[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 8
    torch.testing.assert_close(vectors([second]), vectors([first]), atol=1e-5, rtol=0)
    mean = LLM(str(folders("llama-mean")), **DECODER_CONFIG)
    first, second = mean.embed([text])[0], mean.embed([text])[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert mean.engine.stats()["prefix_cache"]["queries_total"] == 0
    torch.testing.assert_close(vectors([second]), vectors([first]), atol=0, rtol=0)


def test_a_failing_request_fails_alone_and_an_abort_frees_its_blocks(folders) -> None:
    folder = folders("llama-mean")
    engine = LLMEngine(EngineConfig(model=str(folder), **DECODER_CONFIG))
    poison = 499
    real_execute = engine.runner.execute

    def execute(chunks: list[ScheduledChunk]) -> RunnerOutput:
        if any(poison in chunk.token_ids for chunk in chunks):
            raise RuntimeError("poisoned forward")
        return real_execute(chunks)

    engine.runner.execute = execute  # type: ignore[method-assign]
    good = [engine.tokenizer.encode(text) for text in CORPUS_LINES[:3]]
    for i, ids in enumerate(good):
        engine.add_request(f"good{i}", ids, PoolingParams(normalize=True))
    engine.add_request("bad", [1, poison, 7, 8], PoolingParams())
    engine.add_request("gone", good[0], PoolingParams())
    assert engine.abort_request("gone")
    done = drain(engine)
    assert done["bad"].finish_reason == "abort" and done["bad"].embedding is None
    assert done["gone"].finish_reason == "abort" and done["gone"].embedding is None
    expected = st_encode(folder, CORPUS_LINES[:3])
    torch.testing.assert_close(vectors([done[f"good{i}"] for i in range(3)]), expected, atol=ATOL, rtol=0)
    assert engine.totals.failed_requests == 1 and engine.totals.embedded_requests == 3


def test_engine_host_resolves_pooling_futures_with_embeddings(folders) -> None:
    folder = folders("bert-mean")
    host = EngineHost.from_config(EngineConfig(model=str(folder), max_num_seqs=2))
    try:
        with pytest.raises(ValueError, match="serves embeddings"):
            host.submit("x", "hello", SamplingParams())
        futures = [host.submit(f"e{i}", text, PoolingParams(truncate=True))
                   for i, text in enumerate(CORPUS_LINES)]
        outputs = [future.result(timeout=30) for future in futures]
    finally:
        host.shutdown()
    torch.testing.assert_close(vectors(outputs), st_encode(folder, CORPUS_LINES), atol=ATOL, rtol=0)
    assert all(out.prompt_token_ids and out.num_cached_tokens == 0 for out in outputs)
