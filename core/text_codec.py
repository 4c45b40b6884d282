"""Text to token ids and back with a model's tokenizer: prompts (strings or ids), chat
conversations through the model's template, outputs back to text. Shared by ``LLM`` and by
the server, which tokenizes in its own process while the engine runs in another."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import RequestError


class TextCodec:
    """The tokenizer's side of a model (``tokenizer`` may be None: prompts are then ids)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give prompts as lists of token ids")
            return self.tokenizer(prompt).input_ids
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise RequestError(f"a prompt is a string, a list of token ids, {{'prompt': str}} or "
                               f"{{'prompt_token_ids': [int, ...]}}; got {prompt!r:.80}") from None

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_ids: list[int]) -> str:
        """The text of tokens as the model wrote them, special tokens included (logprobs)."""
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else str(token_ids[0])

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the assistant's turn opened. A message's content may
        be a string or OpenAI's list of content parts (its text parts joined by newlines, as
        vLLM does); OpenAI's ``developer`` role is the template's ``system``. A model without a
        chat template (a base model) gets the messages' text as one plain prompt, separated by
        blank lines: what a user of a base model would type, so that chat, serving and the
        bench run on it too."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer: give prompts as lists of token ids")
        messages = [_text_message(i, m) for i, m in enumerate(messages)]
        if not getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer("\n\n".join(m["content"] for m in messages)).input_ids
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids


def _text_message(index: int, message) -> dict:
    """One chat message as the templates expect it: {role, content} with string content."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
        raise RequestError(f"message {index}: expected {{'role': ..., 'content': ...}}, got {message!r}")
    content = message["content"]
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"message {index}: content part {part!r} is not supported; specdec serves "
                                   "text models: send {'type': 'text', 'text': ...} parts or a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise RequestError(f"message {index}: content must be a string or a list of text parts, "
                           f"got {type(content).__name__}")
    role = "system" if message["role"] == "developer" else message["role"]
    return {**message, "role": role, "content": content}
