"""`dflash-onnx demo`, the README's main job: builds, exports (cached) and compares greedy with DFlash; and the
demo pair answers chat through the openai client, as `serve` on it does for a newcomer."""

from __future__ import annotations

import json

import pytest

from dflash_onnx.demo import COLUMNS, ensure_demo_export, run_demo


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory):
    """One demo export and lowering for the module, under a cache of its own."""
    with pytest.MonkeyPatch.context() as patch:
        cache = tmp_path_factory.mktemp("demo-cache")
        patch.setenv("DFLASH_ONNX_CACHE", str(cache))
        yield cache


def test_demo_runs_offline_and_is_lossless(demo_cache, capsys):
    """Every column (plain greedy, greedy with the lookup guess, DFlash full and auto) in interleaved rounds, each
    run's tokens plain greedy's; the table names each column and says where DFlash pays."""
    assert run_demo(as_json=True, max_new_tokens=24, num_prompts=2, rounds=2) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["all_identical_to_greedy"] and summary["tau"] > 1 and summary["costs"]["verify_ms"]
    assert summary["rounds"] == 2 and set(summary["moved"]) == set(COLUMNS)
    assert all(summary[f"{mode}_tokens_per_second"] > 0 for mode in COLUMNS)
    assert summary["where_dflash_pays"].startswith("where DFlash pays")
    exported = next(demo_cache.rglob("dflash.json")).stat().st_mtime
    assert run_demo(max_new_tokens=8, num_prompts=1, rounds=1) == 0  # second run reuses the export
    from dflash_onnx.cli import build_parser
    from dflash_onnx.demo import ROUNDS

    assert build_parser().parse_args(["demo"]).rounds == ROUNDS  # the command's default is the library's
    assert next(demo_cache.rglob("dflash.json")).stat().st_mtime == exported
    printed = capsys.readouterr().out
    assert all(column in printed for column in COLUMNS.values()) and "where DFlash pays" in printed


def test_the_demo_pair_answers_chat_through_the_openai_client(demo_cache):
    """The shipped pair carries a chat template, so a newcomer's `serve` on its export answers
    /v1/chat/completions: the reply is the target's greedy continuation of the templated conversation."""
    from openai import OpenAI
    from test_serve import Server

    from dflash_onnx.runtime.tokenizer import TextCodec
    from dflash_onnx.serving.app import ServerOptions, create_app
    from dflash_onnx.serving.engine import Engine
    from dflash_onnx.targets import open_decoder

    directory = ensure_demo_export(progress=False)
    codec, decoder = TextCodec(directory), open_decoder(directory)
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    tokens = decoder.generate(codec.chat_ids(messages), 24, "greedy").tokens
    want = codec.decode(tokens[:-1] if tokens[-1] in decoder.stop_token_ids else tokens)
    engine = Engine(open_decoder(directory), codec, max_queue=2)
    server = Server(create_app(engine, ServerOptions(model="demo")))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=24)
        assert reply.choices[0].message.content == want and want
    finally:
        server.stop()
        engine.close()
