"""Text <-> ids for an exported directory, without importing torch (tokenizer.json via `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from dflash_onnx.runtime.chat import load_chat_template
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.paths import member


class TextCodec:
    """Encodes prompts and decodes growing id lists into text deltas for streaming."""

    def __init__(self, directory: Path, artifact: bool = True):
        """`artifact`: a directory dflash-onnx wrote (its tokenizer.json must not lead outside it); a model
        checkpoint's may be a symlink (the Hugging Face cache links its files to blobs)."""
        path = member(Path(directory), "tokenizer.json", "the tokenizer file") if artifact \
            else Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise DFlashError(f"{directory} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        from tokenizers import Tokenizer

        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception for a file it cannot parse
            raise DFlashError(f"{path} is not a tokenizer.json the tokenizers library reads ({exc})") from None
        self.directory, self.artifact = Path(directory), artifact

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def prompt_ids(self, text: str, raw: bool = False) -> list[int]:
        """A user prompt as ids: in the directory's chat template when it has one (the turn the model answers),
        else, or with `raw`, the text as it is."""
        template = None if raw or not self.artifact else load_chat_template(self.directory)
        if template is None:
            return self.encode(text)
        return self.encode(template.render(text), add_special_tokens=False)

    def prompt_form(self, raw: bool = False) -> str:
        """How `prompt_ids` sends a prompt, in words for the one line `generate` prints."""
        if raw:
            return "as raw text (--raw)"
        if self.artifact and load_chat_template(self.directory) is not None:
            return "as a user turn in the directory's chat template; --raw sends the text as it is"
        return "as raw text: the directory has no chat template"

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """A conversation as ids, in the directory's chat template; one line when it has none."""
        template = load_chat_template(self.directory) if self.artifact else None
        if template is None:
            raise DFlashError(f"{self.directory} has no chat template (tokenizer_config.json's chat_template or "
                              "chat_template.jinja): send text to /v1/completions instead")
        return self.encode(template.render_messages(messages), add_special_tokens=False)

    def token_id(self, token: str, default: int) -> int:
        found = self._tokenizer.token_to_id(token)
        return default if found is None else found

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


class TextStream:
    """The text each chunk of a growing id list adds (tokens can merge with the next one, so each delta is
    the decoded whole minus what was printed before)."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.printed = codec, [], ""

    def delta(self, chunk: list[int]) -> str:
        self.ids.extend(chunk)
        text = self.codec.decode(self.ids)
        new, self.printed = text[len(self.printed):], text
        return new


def has_tokenizer(directory: Path) -> bool:
    return (Path(directory) / "tokenizer.json").is_file()
