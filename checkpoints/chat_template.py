"""The `chat_template` setting resolved to a template's text: the one place that reads it, so the API's
tokenizer (its token counts, the roles and tool parser it judges by) and the engine's render alike.

A value is, in this order: the template itself (text holding `{{` or `{%`), the name of a template Conveyor
ships (chat_templates/NAME.jinja), or the path of a Jinja file. Whatever it is, the template must compile as
transformers compiles chat templates (jinja2's sandbox, loop controls, its `generation` tag).
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

SHIPPED_DIR = Path(__file__).resolve().parent / "chat_templates"
SHIPPED_SUFFIX = ".jinja"
INLINE_MARKS = ("{{", "{%")


def shipped_templates() -> list[str]:
    """The names of the templates Conveyor ships (`chatml-tools`)."""
    return sorted(path.name.removesuffix(SHIPPED_SUFFIX) for path in SHIPPED_DIR.glob("*" + SHIPPED_SUFFIX))


def resolve_chat_template(value: str) -> str:
    """The template's text. ValueError saying why when there is none (a missing or unreadable file, and not
    a shipped name) or when it does not compile."""
    if any(mark in value for mark in INLINE_MARKS):
        return compiled(value, "the template given")
    if value in shipped_templates():
        return compiled((SHIPPED_DIR / (value + SHIPPED_SUFFIX)).read_text(encoding="utf-8"), value)
    path = Path(value).expanduser()
    if not path.is_file():
        names = ", ".join(shipped_templates())
        raise ValueError(f"no file {value!r}; give a Jinja file's path, the template itself (text holding "
                         f"`{{{{` or `{{%`) or the name of a template Conveyor ships ({names})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {value!r}: {exc}") from None
    return compiled(text, repr(value))


def compiled(text: str, where: str) -> str:
    """`text` when it compiles as a chat template; ValueError naming `where` and the error's line else."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols, _GenerationTag])
    try:
        environment.from_string(text)
    except jinja2.TemplateError as exc:
        line = getattr(exc, "lineno", None)
        at = f" (line {line})" if line else ""
        raise ValueError(f"{where} does not compile as a Jinja template{at}: {exc}") from None
    return text


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (the assistant's tokens, for training masks),
    parsed here as its body alone: only whether the template compiles is asked."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)
