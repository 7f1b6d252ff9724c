"""Chat messages as OpenAI's chat API sends them, and what the model's chat template can be given: the roles
it names, and the plain {"role", "content"} messages (tool calls kept) it renders."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.core.protocol.refusal import Refusal
from conveyor.core.protocol.request_fields import ChatRole, StoredText
from conveyor.core.protocol.tools import ToolCallIn, history_problem


@dataclass(frozen=True)
class ChatRoles:
    """The optional roles the model's chat template knows, found by their names in its source ('tool' or
    "tool"): a template that never names a role has no rendering for it made for the model. `developer`
    without one is sent as `system` (OpenAI's newer name for it); `tool` without one is refused."""

    developer: bool = False
    tool: bool = False

    @classmethod
    def of_template(cls, template: object) -> ChatRoles:
        if not isinstance(template, str):  # no chat template (or several named ones): only the base roles
            return cls()
        return cls(developer=_names_role(template, "developer"), tool=_names_role(template, "tool"))


def _names_role(template: str, role: str) -> bool:
    return f"'{role}'" in template or f'"{role}"' in template


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StoredText


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: ChatRole = Field(
        description="`developer` is sent as `system` when the chat template has no developer role; `tool` "
        "only when the chat template has a tool role"
    )
    content: StoredText | list[TextPart] | None = Field(description="null only beside tool_calls")
    name: StoredText | None = Field(None, description="accepted and ignored")
    tool_calls: list[ToolCallIn] | None = Field(None, description="calls an assistant message made")
    tool_call_id: StoredText | None = Field(None, description="the call a tool message answers")

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def plain_messages(messages: list[ChatMessageIn], roles: ChatRoles) -> list[dict[str, Any]]:
    """{"role", "content"} (plus tool_calls and tool_call_id when sent) for the chat template: text parts
    joined, `developer` as `system` when the template has no developer role; a tool message without a tool
    role in the template is refused, and so is a history the template could not be given."""
    plain: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.role
        if role == "tool" and not roles.tool:
            raise Refusal(
                "unsupported",
                f"messages[{index}].role",
                "the model's chat template has no tool role, so tool messages cannot be rendered",
            )
        if role == "developer" and not roles.developer:
            role = "system"
        plain.append({"role": role, "content": message.text(),
                      **message.model_dump(mode="json", include={"tool_calls", "tool_call_id"},
                                           exclude_none=True)})
    problem = history_problem(plain)
    if problem is not None:
        raise Refusal("invalid", *problem)
    return plain
