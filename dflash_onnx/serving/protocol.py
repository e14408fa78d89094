"""The OpenAI API's request bodies as the server reads them, and its error shape.

Fields the server does not implement and that would change the output (n > 1, logprobs, tools, penalties) are
refused in one line rather than ignored; fields that change nothing here (user, stream_options) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

# each field the server does not implement, with the values that ask for nothing (so a client sending its defaults
# is served)
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []),
               "tool_choice": (None, "none", "auto"), "functions": (None, []),
               "response_format": (None, {"type": "text"}),
               "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "min_p": (None, 0),
               "repetition_penalty": (None, 1), "ignore_eos": (None, False), "min_tokens": (None, 0)}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is served")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        return stops

    def unsupported(self) -> str | None:
        """The first field given that the server would otherwise ignore although it changes the output."""
        extra = self.model_extra or {}
        return next((name for name, neutral in UNSUPPORTED.items() if name in extra and extra[name] not in neutral),
                    None)


TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class CompletionRequest(_Request):
    prompt: str | list[TokenId]
    max_tokens: int | None = Field(default=16, ge=1)  # the OpenAI completions API's default


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def unsupported(self) -> str | None:
        if any((message.model_extra or {}).get("tool_calls") for message in self.messages):
            return "messages[].tool_calls"
        return super().unsupported()


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {...}} as the OpenAI API returns it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def nesting_depth(body: bytes) -> int:
    """How deep `body`'s arrays and objects nest (`[]` 1, `{"a": [1]}` 2), counted over the raw bytes without
    parsing them (numpy over the positions of brackets, quotes and backslashes: milliseconds a MiB), so that a body
    nested too deep is refused before a recursive parser sees it. Brackets inside strings do not count: a quote opens
    or closes a string unless an odd run of backslashes escapes it. On a body that is not JSON the count may differ
    from a parser's, but never below the depth a parser reaches before it finds the fault (up to there it parses)."""
    data = np.frombuffer(body, dtype=np.uint8)
    backslashes = np.flatnonzero(data == ord("\\"))
    quotes = np.flatnonzero(data == ord('"'))
    if len(backslashes) and len(quotes):
        # each backslash's run start; a quote is escaped by the odd run of backslashes that ends just before it
        starts = np.maximum.accumulate(np.where(np.diff(backslashes, prepend=-2) != 1, backslashes, 0))
        at = np.clip(np.searchsorted(backslashes, quotes - 1), 0, len(backslashes) - 1)
        follows = backslashes[at] == quotes - 1
        quotes = quotes[~(follows & ((quotes - starts[at]) % 2 == 1))]
    opens, closes = (data == ord("[")) | (data == ord("{")), (data == ord("]")) | (data == ord("}"))
    steps = opens.view(np.int8) - closes.view(np.int8)
    brackets = np.flatnonzero(steps)
    outside = np.searchsorted(quotes, brackets) % 2 == 0  # an even count of string quotes before it
    return int(np.cumsum(steps[brackets][outside], dtype=np.int64).max(initial=0))


def too_deep(body: bytes, limit: int) -> int | None:
    """The depth of a body nested past `limit` (None where it is not): at once where it holds `limit` brackets or
    fewer."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None
    depth = nesting_depth(body)
    return depth if depth > limit else None
