"""The models this deployment serves, as the API judges requests for them: each one's settings (its engine
and queue limits: Settings.for_model) and its tokenizer (no weights), by the id clients send as `model`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from api.prompt_tokenizer import PromptTokenizer
from core.chat_options import ToolParser, tool_parser_for
from core.embedding_rules import EmbeddingLimits
from core.lanes import lane_of
from core.model_limits import served_max_model_len
from core.model_task import ModelTask, model_task
from core.settings import Settings


@dataclass(frozen=True)
class ServedModel:
    id: str
    settings: Settings  # the deployment's settings as this model sees them
    tokenizer: PromptTokenizer
    task: ModelTask = field(default_factory=lambda: ModelTask("generate"))  # core/model_task.py

    @property
    def tool_parser(self) -> ToolParser:
        """The parser this model's tool calls are read with (the setting, or its template's)."""
        return tool_parser_for(self.settings.tool_call_parser, self.tokenizer.chat_template)

    def max_model_len(self) -> int | None:
        """The max_model_len its workers serve: the configured one, else the model's own (its config.json),
        so a request that can never run is refused at submit rather than failing on a worker. For an
        embedding model, the longest input it embeds."""
        own = self.task.max_input_tokens if self.task.embeds else self.tokenizer.context_length
        return served_max_model_len(self.settings.max_model_len, own)

    def embedding_limits(self) -> EmbeddingLimits:
        """What its embeddings requests are held to (core/embedding_rules.py)."""
        return EmbeddingLimits.of_model(self.settings, self.task, self.tokenizer.vocab_size)

    def lane(self, queue: str) -> str:
        return lane_of(self.id, queue)

    def created(self) -> int:
        """When its folder was last changed (OpenAI's model `created`); 0 when it is not a local folder."""
        path = Path(self.settings.model) if self.settings.model else None
        return int(path.stat().st_mtime) if path is not None and path.exists() else 0


class ServedModels:
    """Every served model, the default first."""

    def __init__(self, settings: Settings, tokenizers: Mapping[str, PromptTokenizer]) -> None:
        missing = [model_id for model_id in settings.model_ids() if model_id not in tokenizers]
        if missing:
            raise ValueError(f"tokenizers: none given for model(s) {', '.join(missing)}")
        self._settings = settings
        self._models = {model_id: ServedModel(model_id, model_settings, tokenizers[model_id],
                                              _task_of(model_settings))
                        for model_id, model_settings in settings.served().items()}

    @property
    def default(self) -> ServedModel:
        return next(iter(self._models.values()))

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def get(self, model_id: str | None) -> ServedModel:
        """The model a request names (Settings.model_id_of). UnknownModelError when it is not served."""
        return self._models[self._settings.model_id_of(model_id)]


def _task_of(settings: Settings) -> ModelTask:
    """What the model serves: its `task` setting, "auto" resolved from its folder."""
    return model_task(settings.model_folder(), settings.task or "auto")
