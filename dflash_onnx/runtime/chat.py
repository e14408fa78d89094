"""Chat templates: `generate --prompt` sends text as the user's turn in the tokenizer's own template, as the
checkpoints' drafts were trained on chat-formatted responses (Qwen3's thinking off, as the reference CLI runs).

The template is Jinja from `chat_template.jinja` or `tokenizer_config.json` of the exported directory. It is
rendered in Jinja's immutable sandbox, the environment Hugging Face uses: a template can format text, not
run code. numpy-free, torch-free.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.paths import member


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ChatTemplate:
    def __init__(self, source: str, config: dict, origin: str):
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))

    def render(self, user_text: str) -> str:
        """The text the model sees for one user message, ending where the assistant's reply begins."""
        return self.render_messages([{"role": "user", "content": user_text}])

    def render_messages(self, messages: list[dict]) -> str:
        """The text the model sees for a conversation ({"role", "content"} each), ending where the assistant's
        reply begins."""
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.globals.update(raise_exception=raise_exception,
                                   strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            return environment.from_string(self.source).render(
                messages=messages, add_generation_prompt=True,
                enable_thinking=False, tools=None, bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise DFlashError(f"the chat template in {self.origin} fails ({exc}): pass --raw to send the text "
                              "as it is (the server: use /v1/completions)") from None


def load_chat_template(directory: Path) -> ChatTemplate | None:
    """The exported directory's chat template, or None when its tokenizer has none."""
    directory = Path(directory)
    config_path = member(directory, "tokenizer_config.json", "the tokenizer config")
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DFlashError(f"{config_path} is not valid JSON ({exc}): export again") from None
    template_path = member(directory, "chat_template.jinja", "the chat template")
    if template_path.is_file():
        return ChatTemplate(template_path.read_text(), config, str(template_path))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    return ChatTemplate(source, config, str(config_path)) if isinstance(source, str) and source else None
