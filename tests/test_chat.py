"""Chat templates: `generate --prompt` sends the text as a user turn in the tokenizer's template (Qwen3's
thinking off), `--raw` sends it as it is, `--prompt-ids` is never templated; templates render in Jinja's
sandbox."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash_onnx.cli import main
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.tokenizer import TextCodec

QWEN3_LIKE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}")


@pytest.fixture
def chat_export(exported, tmp_path):
    out = tmp_path / "chat"
    shutil.copytree(exported("agree_b8").out, out)
    config = json.loads((out / "tokenizer_config.json").read_text()) if (out / "tokenizer_config.json").exists() \
        else {}
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_LIKE}))
    return out


def test_a_prompt_is_the_user_turn_of_the_template_as_transformers_renders_it(chat_export):
    from transformers import PreTrainedTokenizerFast

    oracle = PreTrainedTokenizerFast(tokenizer_file=str(chat_export / "tokenizer.json"), chat_template=QWEN3_LIKE)
    rendered = oracle.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>") and "hi there" in rendered  # thinking off
    codec = TextCodec(chat_export)
    assert codec.prompt_ids("hi there") == codec.encode(rendered, add_special_tokens=False)
    assert codec.prompt_ids("hi there", raw=True) == codec.encode("hi there")


def test_the_cli_templates_prompts_not_ids(chat_export, capsys):
    codec = TextCodec(chat_export)
    for flags, expected in ((["--prompt", "hi"], len(codec.prompt_ids("hi"))), (["--prompt", "hi", "--raw"], 2),
                            (["--prompt-ids", "3,4,5"], 3)):
        assert main(["generate", str(chat_export), *flags, "--max-new-tokens", "3", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["prompt_tokens"] == expected
    assert len(codec.prompt_ids("hi")) > 20


def test_a_template_file_wins_over_the_config(chat_export):
    (chat_export / "chat_template.jinja").write_text("Q: {{ messages[0].content }}\nA:")
    codec = TextCodec(chat_export)
    assert codec.prompt_ids("x") == codec.encode("Q: x\nA:", add_special_tokens=False)


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('only system and user roles') }}", "only system and user roles"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "fails"),  # the sandbox refuses it
])
def test_a_failing_or_unsafe_template_gets_one_line(chat_export, template, message, capsys):
    (chat_export / "chat_template.jinja").write_text(template)
    with pytest.raises(DFlashError, match=f"{message}.*pass --raw"):
        TextCodec(chat_export).prompt_ids("x")
    assert main(["generate", str(chat_export), "--prompt", "x", "--max-new-tokens", "2"]) == 2
    assert "--raw" in capsys.readouterr().err


def test_without_a_template_the_text_is_sent_as_it_is(exported):
    codec = TextCodec(exported("agree_b8").out)
    assert codec.prompt_ids("hello") == codec.encode("hello")
