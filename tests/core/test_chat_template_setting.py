"""The chat_template setting: read from CONVEYOR_CHAT_TEMPLATE or per model, refused at start naming it when
it resolves to no template, and applied wherever a model's template is read: the API's tokenizers (and so the
roles and tool parser it judges by) and the engine's configuration the worker derives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from conveyor.api.served_models import ServedModels
from conveyor.checkpoints.chat_template import resolve_chat_template
from conveyor.cli.api_server import load_tokenizers
from conveyor.core.protocol.chat_messages import ChatRoles
from conveyor.core.settings import Settings, load_settings
from conveyor.worker.model import engine_config


def test_the_environment_names_a_template_and_the_settings_resolve_its_text(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVEYOR_CHAT_TEMPLATE", "chatml-tools")
    settings = load_settings()
    assert settings.chat_template == "chatml-tools"  # as given; its text on demand
    assert settings.chat_template_text() == resolve_chat_template("chatml-tools")
    assert Settings().model_copy(update={"chat_template": None}).chat_template_text() is None
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert Settings(chat_template=str(path)).chat_template_text() == path.read_text()


@pytest.mark.parametrize(("given", "refusal"), [
    ({"chat_template": "chatml-tool"}, r"chat_template\n.*no file 'chatml-tool'"),
    ({"chat_template": "/missing/template.jinja"}, r"chat_template\n.*no file '/missing/template.jinja'"),
    ({"chat_template": "{% for m in messages %}"}, r"chat_template\n.*does not compile"),
    ({"models": {"a": {"path": "/a", "chat_template": "chatml-tool"}}},
     r"models\.a\n.*chat_template: .*no file"),
])
def test_a_template_that_resolves_to_nothing_is_refused_naming_the_setting(
        given: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ValidationError, match=refusal):
        Settings(**given)


def test_a_file_gone_since_the_settings_were_read_is_named_too(tmp_path: Path) -> None:
    path = tmp_path / "gone.jinja"
    path.write_text("{{ messages }}")
    settings = Settings(chat_template=str(path))
    path.unlink()
    with pytest.raises(ValueError, match="chat_template: no file"):
        settings.chat_template_text()


def test_each_model_renders_with_its_own_template_in_the_api_and_the_engine(
        make_settings: Callable[..., Any], demo_model_dir: Path) -> None:
    """One model of the registry sets chatml-tools: its API tokenizer renders with it (a tool role, hermes),
    its workers' engine gets its text; the other model keeps its own template."""
    settings = make_settings(models={"tools": {"path": str(demo_model_dir), "chat_template": "chatml-tools"},
                                     "own": {"path": str(demo_model_dir)}}, num_threads=1)
    shipped = resolve_chat_template("chatml-tools")
    tokenizers = load_tokenizers(settings)
    assert tokenizers["tools"].chat_template == shipped
    assert tokenizers["own"].chat_template not in (None, shipped)
    served = ServedModels(settings, tokenizers)
    assert ChatRoles.of_template(served.get("tools").tokenizer.chat_template).tool
    assert served.get("tools").tool_parser == "hermes"

    tools_engine = engine_config(settings.for_model("tools"), str(demo_model_dir))
    own_engine = engine_config(settings.for_model("own"), str(demo_model_dir))
    assert tools_engine.chat_template == shipped and own_engine.chat_template is None


def test_an_inline_template_reaches_the_engine_as_written(make_settings: Callable[..., Any],
                                                          demo_model_dir: Path) -> None:
    inline = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    settings = make_settings(chat_template=inline, num_threads=1)
    assert engine_config(settings, str(demo_model_dir)).chat_template == inline
    assert load_tokenizers(settings)[settings.served_model_id()].chat_template == inline
