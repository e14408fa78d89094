"""Text <-> ids for an exported directory, without importing torch (tokenizer.json via `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from .errors import DFlashError


class TextCodec:
    """Encodes prompts and decodes growing id lists into text deltas for streaming."""

    def __init__(self, directory: Path):
        path = Path(directory) / "tokenizer.json"
        if not path.is_file():
            raise DFlashError(f"{directory} has no tokenizer.json: pass --prompt-ids instead of --prompt")
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

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
