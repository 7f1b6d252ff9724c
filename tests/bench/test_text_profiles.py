"""The quoting and chat profiles: seeded real text in the model's chat template, whose quoting answers copy
from their prompts; EOS respected by default; sized to the context. The tiny model's tokenizer has a chat
template that writes BOS itself and adds BOS on encode, the case where a text prompt could get two."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from conveyor.bench.chat_format import ChatFormat
from conveyor.bench.chat_prompts import REQUESTS
from conveyor.bench.cli import build_parser, options
from conveyor.bench.copy_prompts import KINDS, copy_task
from conveyor.bench.experiment import BenchOptions
from conveyor.bench.text_workload import text_requests
from conveyor.bench.workload import Range, WorkloadSpec, generate, trace_sha256

CONTEXT = 4096
PART_NUMBER = re.compile(r"\bPN-\d{5}-[A-Z]\b")


@pytest.fixture(scope="module")
def fmt(llama_dir: Path) -> ChatFormat:
    return ChatFormat.from_model(str(llama_dir))


@pytest.fixture(scope="module")
def plain_fmt(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ChatFormat:
    """The tiny model's tokenizer without its chat template."""
    folder = tmp_path_factory.mktemp("no-template")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (llama_dir / name).is_file():
            shutil.copy(llama_dir / name, folder / name)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = None
    tok.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return ChatFormat.from_model(str(folder))


def spec(profile: str, seed: int = 0, n: int = 6, **kwargs: object) -> WorkloadSpec:
    return WorkloadSpec(profile=profile, num_requests=n, seed=seed, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("profile", ["quoting", "chat"])
def test_the_same_seed_gives_the_same_requests_and_another_seed_others(fmt: ChatFormat, profile: str) -> None:
    first = text_requests(spec(profile), fmt, CONTEXT)
    again = text_requests(spec(profile), fmt, CONTEXT)
    other = text_requests(spec(profile, seed=1), fmt, CONTEXT)
    assert first == again and trace_sha256(first) == trace_sha256(again)
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert all(r.prompt is not None and r.prompt.isascii() and r.prompt_token_ids is None for r in first)


@pytest.mark.parametrize("kind", KINDS)
def test_each_quoting_task_holds_what_its_answer_copies(fmt: ChatFormat, kind: str) -> None:
    for seed in range(5):
        task = copy_task(kind, random.Random(seed), 300, fmt.count)
        document = task.message.split("\n\n", 1)[1]
        assert task.quoted and all(q in document for q in task.quoted), (kind, seed)
        assert fmt.count(document) >= 300 and task.message.isascii()


def test_an_invoice_lists_distinct_part_numbers_each_with_its_price(fmt: ChatFormat) -> None:
    task = copy_task("invoice", random.Random(3), 400, fmt.count)
    numbers, prices = task.quoted[::2], task.quoted[1::2]
    assert all(PART_NUMBER.fullmatch(n) for n in numbers) and len(set(numbers)) == len(numbers) >= 2
    assert PART_NUMBER.findall(task.message) == list(numbers)
    for number, price in zip(numbers, prices, strict=True):
        line = next(line for line in task.message.splitlines() if number in line)
        assert line.endswith(f"unit price {price}") and re.fullmatch(r"\$\d+\.\d\d", price)
    assert "part number" in task.message.split("\n\n")[0]


def test_a_rewrite_names_a_word_of_the_paragraph_and_one_absent_from_it(fmt: ChatFormat) -> None:
    for seed in range(5):
        task = copy_task("rewrite", random.Random(seed), 200, fmt.count)
        old, new = re.findall(r'"(\w+)"', task.message.split("\n\n")[0])
        (paragraph,) = task.quoted
        assert re.search(rf"\b{old}\b", paragraph) and not re.search(rf"\b{new}\b", paragraph)


def test_quoting_takes_the_kinds_in_turn_in_the_documents_group(fmt: ChatFormat) -> None:
    requests = text_requests(spec("quoting"), fmt, CONTEXT)
    openings = ("List every part number", "Rewrite the paragraph", "Summarise the notes")
    for i, r in enumerate(requests):
        assert r.group == "documents" and r.max_tokens == 256
        assert openings[i % 3] in (r.prompt or "")
    assert len(PART_NUMBER.findall(requests[0].prompt or "")) >= 2


def test_the_chat_template_is_applied_with_one_bos(fmt: ChatFormat) -> None:
    tok = fmt.tokenizer
    for r in text_requests(spec("chat"), fmt, CONTEXT):
        assert r.group == "interactive" and r.max_tokens == 128
        prompt = r.prompt or ""
        assert prompt.startswith("<|user|>\n") and prompt.endswith("<|assistant|>\n")
        ids = tok.encode(prompt)  # as the engine encodes a text prompt
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_without_a_chat_template_the_prompt_is_the_plain_message(plain_fmt: ChatFormat) -> None:
    assert not plain_fmt.has_template
    starts = tuple(template.split("{}")[0] for template, _ in REQUESTS)
    for r in text_requests(spec("chat"), plain_fmt, CONTEXT):
        assert (r.prompt or "").startswith(starts) and "<|" not in (r.prompt or "")


def test_prompt_and_answer_fit_the_context(fmt: ChatFormat) -> None:
    for r in text_requests(spec("quoting", n=6), fmt, 400):
        assert fmt.prompt_tokens(r.prompt or "") + r.max_tokens <= 400 and r.max_tokens >= 1
    short = text_requests(spec("quoting", n=3, long_prompt=Range(40, 40)), fmt, CONTEXT)
    default = text_requests(spec("quoting", n=3), fmt, CONTEXT)
    assert all(len(s.prompt or "") < len(d.prompt or "") for s, d in zip(short, default, strict=True))
    with pytest.raises(ValueError, match="max_model_len"):
        text_requests(spec("quoting", n=1), fmt, 60)


def test_text_profiles_have_their_own_output_caps_and_arrivals(fmt: ChatFormat) -> None:
    assert spec("quoting").long_output == Range(256, 256) and spec("chat").short_output == Range(128, 128)
    assert spec("mixed").short_output == Range(16, 64) and spec("mixed").long_output == Range(64, 256)
    assert spec("chat", short_output=Range(8, 8)).short_output == Range(8, 8)
    arrivals = [r.arrival_s for r in text_requests(spec("chat", rates={"interactive": 5.0}), fmt, CONTEXT)]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    with pytest.raises(ValueError, match="tokenizer"):
        generate(spec("quoting"), [1, 2, 3], CONTEXT)


def test_text_profiles_respect_eos_unless_told_not_to(llama_dir: Path) -> None:
    assert BenchOptions(spec=spec("quoting")).respect_eos is True
    assert BenchOptions(spec=spec("chat")).respect_eos is True
    assert BenchOptions(spec=spec("mixed")).respect_eos is False
    assert BenchOptions(spec=spec("chat"), respect_eos=False).respect_eos is False
    with pytest.raises(ValueError, match="peers"):
        BenchOptions(spec=spec("quoting"), peers=["hf"])
    parse = build_parser().parse_args
    assert options(parse(["--model", str(llama_dir), "--profile", "quoting"])).respect_eos is True
    quoting = options(parse(["--model", str(llama_dir), "--profile", "quoting", "--no-respect-eos"]))
    assert quoting.respect_eos is False and quoting.parameters()["respect_eos"] is False
    assert options(parse(["--model", str(llama_dir), "--respect-eos"])).respect_eos is True
