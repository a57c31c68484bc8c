"""The reference engine's chat template: simple, deterministic, and exact under
`continue_final_message`.

Each message renders as `<|role|>\\n{content}<|end|>\\n`; a generation prompt is
`<|assistant|>\\n`. With `continue_final_message` the final assistant message is left open
(no end marker, no generation prompt), so

    render(messages + [{"role": "assistant", "content": partial}], continue_final_message=True)
        == render(messages) + partial

byte for byte. That identity is how the router and the sidecar resume a chat stream as a
continuation and get exactly the tokens an uninterrupted run would have produced.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_END = "<|end|>\n"


class ChatTemplateError(ValueError):
    pass


def message_text(content: object) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            parts.append(text)
        return "".join(parts)
    raise ChatTemplateError("message content must be a string or a list of parts")


def render(
    messages: Sequence[Mapping[str, object]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    pieces: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError("each message must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatTemplateError(f"unknown message role {role!r}")
        pieces.append(f"<|{role}|>\n{message_text(message.get('content'))}{_END}")
    if continue_final_message:
        if messages[-1].get("role") != "assistant":
            raise ChatTemplateError("continue_final_message needs a final assistant message")
        pieces[-1] = pieces[-1][: -len(_END)]
    elif add_generation_prompt:
        pieces.append("<|assistant|>\n")
    return "".join(pieces)
