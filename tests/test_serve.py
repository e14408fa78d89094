"""`dflash-onnx serve`: the OpenAI Python client against a server started on 127.0.0.1 in the test, over the ORT
lowering of a tiny agreeing pair (and, for requests at once, of a pair whose answers differ by prompt). Oracle: the
same directory's Decoder run alone (greedy), decoded by the same tokenizer; the server's DFlash output must equal it
token for token, streamed or not, alone or beside others."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import APIStatusError, NotFoundError, OpenAI, RateLimitError
from spread import assert_discriminating, varied_prompts

from dflash_onnx.runtime.tokenizer import TextCodec
from dflash_onnx.serving.app import ServerOptions, create_app
from dflash_onnx.serving.engine import Engine, GenerationRequest, QueueFull
from dflash_onnx.targets import open_decoder

QWEN3_LIKE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
MODEL = "tiny"


class Server:
    """uvicorn serving `app` on 127.0.0.1 (a free port) in a thread, until stop()."""

    def __init__(self, app):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def served(ort_lowered, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve") / "agree"
    shutil.copytree(ort_lowered("agree_b8"), directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, "chat_template": QWEN3_LIKE}))
    engine = Engine(open_decoder(directory), TextCodec(directory), max_queue=8)
    server = Server(create_app(engine, ServerOptions(model=MODEL, max_body_bytes=64 << 10)))
    yield directory, engine, server
    server.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return OpenAI(base_url=f"{served[2].url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def solo(served):
    """text(prompt_ids, max_tokens) -> (the text the target's greedy decoding gives alone, tokens generated)."""
    directory = served[0]
    decoder, codec = open_decoder(directory), TextCodec(directory)
    stops = set(decoder.stop_token_ids)

    def text(prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
        tokens = decoder.generate(prompt_ids, max_tokens, "greedy").tokens
        return codec.decode(tokens[:-1] if tokens[-1] in stops else tokens), len(tokens)

    return text


def _chat_ids(directory: Path, text: str) -> list[int]:
    return TextCodec(directory).chat_ids([{"role": "user", "content": text}])


def test_a_chat_completion_is_the_targets_greedy_text_streamed_or_not(served, client, solo):
    want, count = solo(_chat_ids(served[0], "def add(a, b):"), 40)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                           max_tokens=40)
    assert reply.choices[0].message.content == want and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == count
    assert reply.usage.prompt_tokens == len(_chat_ids(served[0], "def add(a, b):"))
    assert reply.choices[0].finish_reason == ("length" if count == 40 else "stop")
    chunks = list(client.chat.completions.create(model=MODEL, max_tokens=40, stream=True,
                                                 messages=[{"role": "user", "content": "def add(a, b):"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_completions_take_text_or_token_ids_and_stop_at_max_tokens(served, client, solo):
    codec = TextCodec(served[0])
    ids = codec.encode("for i in range(")
    want, _ = solo(ids, 6)
    for prompt in ("for i in range(", ids):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6)
        assert reply.choices[0].text == want and reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model=MODEL, prompt="for i in range(", max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    chunks = list(client.completions.create(model=MODEL, prompt="for i in range(", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6  # as OpenAI sends it
    assert all(c.usage is None for c in chunks[:-1]) and len({c.created for c in chunks}) == 1


def test_a_stop_string_ends_the_text_before_it_streamed_or_not(served, client, solo):
    ids = TextCodec(served[0]).encode("import os\n")
    full, _ = solo(ids, 48)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and stop in full
    want = full[: full.index(stop)]
    reply = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=48, stop=[stop, "\x00never"])
    assert reply.choices[0].text == want and reply.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt="import os\n", max_tokens=48, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def varied_server(ort_lowered, tmp_path_factory):
    """A server over a pair whose greedy output depends on the whole prompt (conftest.VARIED)."""
    directory = tmp_path_factory.mktemp("serve") / "varied"
    shutil.copytree(ort_lowered("varied_b4"), directory)
    engine = Engine(open_decoder(directory), TextCodec(directory), max_queue=8)
    server = Server(create_app(engine, ServerOptions(model=MODEL)))
    yield directory, server
    server.stop()
    engine.close()


def test_concurrent_requests_each_give_what_they_give_alone(varied_server):
    """Four requests at once, each expecting its own text (checked first: the prompts' greedy outputs differ and
    change when cut), each answered with the text its prompt gives alone."""
    directory, server = varied_server
    decoder, codec = open_decoder(directory), TextCodec(directory)
    stops = set(decoder.stop_token_ids)
    prompts = varied_prompts(decoder.manifest.vocab_size, 4, seed=6, shortest=6, longest=20)
    tokens = [decoder.generate(p, 24, "greedy").tokens for p in prompts]
    assert_discriminating(prompts, tokens, lambda p: decoder.generate(p, 24, "greedy").tokens)
    wants = [codec.decode(t[:-1] if t[-1] in stops else t) for t in tokens]
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def ask(prompt: list[int]) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, prompts)) == wants


def test_bad_requests_get_openai_errors_not_tracebacks(served, client):
    with pytest.raises(NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    url = served[2].url
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 422, "max_tokens"),
        (json.dumps({"prompt": "x", "n": 3}).encode(), 422, "only n=1"),
        (json.dumps({"prompt": "x", "logprobs": 5}).encode(), 400, "logprobs is not supported"),
        (json.dumps({"prompt": "x" * (70 << 10)}).encode(), 413, "over 65536 bytes"),
        (json.dumps({"prompt": [3 + i % 90 for i in range(600)], "max_tokens": 8}).encode(), 400, "exceed the"),
        (json.dumps({"prompt": [90, 91, 95, 96]}).encode(), 400, "prompt ids must lie in"),
        (json.dumps({"prompt": [2**40]}).encode(), 422, "prompt"),
        (json.dumps({"prompt": "x", "seed": -1}).encode(), 422, "seed"),
        (json.dumps({"prompt": "x", "repetition_penalty": 1.3}).encode(), 400, "repetition_penalty"),
        (json.dumps({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}).encode(), 400,
         "tool_calls"),
    ]
    for body, status, message in cases:
        route = "chat/completions" if b'"messages"' in body else "completions"
        response = httpx.post(f"{url}/v1/{route}", content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, (body[:40], response.text)
        error = response.json()["error"]
        assert message in error["message"] and error["type"]
    response = httpx.post(f"{url}/v1/completions", content=json.dumps({"prompt": [3 + i % 90 for i in range(600)]}))
    assert response.json()["error"]["code"] == "context_length_exceeded"
    chunked = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "', b"x" * (70 << 10), b'"}']))
    assert chunked.status_code == 413  # no Content-Length: counted as it arrives
    defaulted = httpx.post(f"{url}/v1/completions", json={"prompt": "def h(", "max_tokens": None})
    assert defaulted.status_code == 200 and defaulted.json()["usage"]["completion_tokens"] <= 16
    assert httpx.get(f"{url}/v1/nothing").json()["error"]["code"] == "not_found"
    with pytest.raises(APIStatusError) as raised:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert raised.value.status_code == 422
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


class _HeldDecoder:
    """A decoder whose requests wait for `release`: the queue fills while the first request runs."""

    stop_token_ids: list[int] = []

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()

    def check(self, prompt_ids, max_tokens, mode, sampling):
        return prompt_ids

    steps_run = 0

    def stream(self, prompt_ids, max_tokens, mode, sampling, stop_token_ids, verify, cancelled=None):
        def steps():
            self.started.set()
            self.release.wait(30)
            for _ in range(max_tokens):
                self.steps_run += 1
                yield [5]

        return steps()


class _Codec:
    def decode(self, ids):
        return "x" * len(ids)


class _SlowDecoder:
    """A decoder that commits one token every 20 ms for as long as it is let run (up to max_tokens): a real
    model here finishes 490 tokens faster than a disconnect can be seen, which says nothing about cancelling."""

    stop_token_ids: list[int] = []
    steps_run = 0

    def check(self, prompt_ids, max_tokens, mode, sampling):
        return prompt_ids

    def stream(self, prompt_ids, max_tokens, mode, sampling, stop_token_ids, verify, cancelled=None):
        def steps():
            for _ in range(max_tokens):
                time.sleep(0.02)  # the fake model's step, not a wait for the test
                self.steps_run += 1
                yield [5]

        return steps()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_the_engine(stream):
    """Mid-stream or waiting for a whole completion: the request stops within a few steps of the client going."""
    slow = _SlowDecoder()
    engine = Engine(slow, _Codec(), max_queue=2)
    server = Server(create_app(engine, ServerOptions(model=MODEL)))
    try:
        body = {"prompt": [1], "max_tokens": 1500, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
                assert next(response.iter_lines()).startswith("data: ")
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 20
        while engine.finished["cancelled"] == 0:
            assert time.monotonic() < deadline, "the abandoned request kept running"
            time.sleep(0.05)
        assert slow.steps_run < 200  # 30 s of steps had it run out; the disconnect is seen every 0.25 s
    finally:
        server.stop()
        engine.close()


def test_a_full_queue_answers_429_with_retry_after(tmp_path):
    held = _HeldDecoder()
    engine = Engine(held, _Codec(), max_queue=1)
    first = engine.submit(GenerationRequest([1], 1))  # taken by the engine thread: it waits inside the decoder
    deadline = time.monotonic() + 10
    while engine.waiting:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.submit(GenerationRequest([1], 1))  # waits in the queue
    with pytest.raises(QueueFull):
        engine.submit(GenerationRequest([1], 1))
    server = Server(create_app(engine, ServerOptions(model=MODEL)))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt=[1], max_tokens=1)
        assert raised.value.response.headers["retry-after"] == "1"
    finally:
        held.release.set()
        server.stop()
        assert [(e.text, e.finish) for e in first] == [("x", None), ("", "length")]
        engine.close()


def test_a_cancelled_request_stops_at_its_next_step():
    held = _HeldDecoder()
    engine = Engine(held, _Codec(), max_queue=2)
    try:
        submission = engine.submit(GenerationRequest([1], 50))
        assert held.started.wait(10)  # its first step waits inside the decoder
        submission.cancel()
        held.release.set()
        assert [(e.text, e.finish) for e in submission] == [("", "cancelled")]
        assert held.steps_run == 1  # the step under way when it was cancelled, none after
        assert engine.finished["cancelled"] == 1
    finally:
        engine.close()


def test_a_request_whose_client_left_while_it_waited_is_never_prefilled():
    held = _HeldDecoder()
    engine = Engine(held, _Codec(), max_queue=2)
    try:
        running = engine.submit(GenerationRequest([1], 3))
        assert held.started.wait(10)
        waiting = engine.submit(GenerationRequest([1], 3))
        waiting.cancel()
        held.release.set()
        assert [e.finish for e in running][-1] == "length"
        assert [(e.text, e.finish) for e in waiting] == [("", "cancelled")]
        assert held.steps_run == 3  # the running request's steps only
    finally:
        engine.close()


class _CountingSession:
    """A session that counts its calls by rows and, at `cancel_at`, cancels `submission` (a client leaving while its
    long prompt is prefilled)."""

    def __init__(self, session, cancel_at: int):
        self.session, self.cancel_at, self.rows, self.submission = session, cancel_at, [], None
        self.input_names, self.output_names = session.input_names, session.output_names
        self.retains_state = session.retains_state

    def run(self, feeds, names):
        self.rows.append(int(feeds["input_ids"].shape[1]))
        if len(self.rows) == self.cancel_at and self.submission is not None:
            self.submission.cancel()
        return self.session.run(feeds, names)


def test_a_request_cancelled_during_a_long_prefill_frees_the_engine_within_one_chunk(served, solo):
    """A 64-token prompt prefilled in chunks of 8, its client leaving during the second chunk: the prefill stops
    there (no third chunk, no decoding step), the request ends cancelled, and the next request runs as it runs
    alone. A prompt past --max-prompt-tokens is refused before it is queued."""
    from dflash_onnx.runtime.errors import DFlashError

    directory = served[0]
    decoder = open_decoder(directory, prefill_chunk=8)
    counting = _CountingSession(decoder.target, cancel_at=2)
    engine = Engine(decoder.sharing(target=counting), TextCodec(directory), max_queue=2, max_prompt_tokens=64)
    try:
        prompt = [3 + i % 40 for i in range(64)]
        submission = GenerationRequest(prompt, 16)
        counting.submission = engine.submit(submission)
        assert [(e.text, e.finish) for e in counting.submission] == [("", "cancelled")]
        assert counting.rows == [8, 8]  # the chunk under way when it was cancelled, none after
        counting.cancel_at = 0
        following = [e for e in engine.submit(GenerationRequest([5, 9, 11], 12))]
        assert following[-1].finish in ("length", "stop")
        assert "".join(e.text for e in following) == solo([5, 9, 11], 12)[0]
        with pytest.raises(DFlashError, match="prompt's 65 tokens exceed this server's limit of 64"):
            engine.submit(GenerationRequest(prompt + [4], 4))
        assert engine.finished["cancelled"] == 1
    finally:
        engine.close()


def test_an_api_key_is_required_when_set(served):
    engine = served[1]
    server = Server(create_app(engine, ServerOptions(model=MODEL, api_key="sesame")))
    try:
        with pytest.raises(APIStatusError) as raised:
            OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        assert raised.value.status_code == 401
        assert OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0).models.list().data
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    finally:
        server.stop()


def test_the_cli_refuses_bad_flags_in_one_line(served, capsys):
    from dflash_onnx.cli import main

    for flags, message in ((["--max-queue", "0"], "--max-queue must be at least 1"),
                           (["--port", "70000"], "--port must lie in"),
                           (["--temperature", "-1"], "--temperature must be 0")):
        assert main(["serve", str(served[0]), *flags]) == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_an_event_stream_ends_with_done(served):
    lines = []
    with httpx.stream("POST", f"{served[2].url}/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_the_load_benchmarks_client_counts_the_tokens_and_matches_solo_greedy(served, solo):
    """benchmarks/serve_load.py's streamed client against the server: the completion tokens the server reports
    (asked for with stream_options, in a last chunk without choices) and the text solo greedy gives."""
    import httpx
    from conftest import benchmark_script

    directory, _, server = served
    script = benchmark_script("serve_load")
    prompt = "def parse(text):"
    with httpx.Client() as connection:
        result = script._stream(connection, server.url, prompt, 12)
    want, count = solo(list(TextCodec(directory).encode(prompt)), 12)
    assert "error" not in result and result["text"] == want and result["tokens"] == count > 0
    results, _ = script._round(server.url, 2, [prompt], 3, 12)
    assert [r["tokens"] for r in results] == [count] * 3 and {r["prompt"] for r in results} == {0}
    assert all(len(r["gaps"]) > 0 and min(r["gaps"]) >= 0 for r in results)  # the gaps between streamed events
    # prompts of exactly N tokens, sent as ids, give what solo greedy gives on those ids
    prompts = script._length_prompts(directory, [5, 40], 4)
    assert [len(p) for p in prompts] == [5, 40, 5, 40] and prompts[0] != prompts[2]
    with httpx.Client() as connection:
        result = script._stream(connection, server.url, prompts[1], 6)
    assert result["text"] == solo(prompts[1], 6)[0]


def test_the_load_benchmark_reports_latency_by_prompt_length():
    """serve_load.py --prompt-tokens: time to first token per length, the short requests' gaps (p50 / p99) and
    their p99 over the short-only round's."""
    from conftest import benchmark_script

    script = benchmark_script("serve_load")
    prompts = [[1] * 4, [1] * 64]
    results = [{"prompt": 0, "ttft": 0.010, "gaps": [0.002, 0.004]}, {"prompt": 1, "ttft": 0.300, "gaps": [0.1]},
               {"prompt": 0, "ttft": 0.020, "gaps": [0.006]}, {"prompt": 1, "error": "HTTP 500"}]
    row = script._latency_row("ours", 2, "4 / 64", results, prompts, short_only_p99=0.003)
    assert row == ["ours", 2, "4 / 64", "4: 10 / 20; 64: 300 / 300", "4.0 / 6.0", "2.00x", 1]



def test_the_load_benchmark_reports_the_median_round_with_every_rounds_errors():
    """serve_load.py --rounds: a row is the round of median total tok/s, its errors summed over the rounds and its
    identical share the lowest any round had (a fast round with errors cannot hide them)."""
    from conftest import benchmark_script

    script = benchmark_script("serve_load")
    rounds = [[4, "900.0", "1", "2", "0.1", "0.2", 0, "100 %"], [4, "1200.0", "1", "2", "0.1", "0.2", 1, "94 %"],
              [4, "1000.0", "1", "2", "0.1", "0.2", 0, "100 %"]]
    assert script._median_round(rounds) == [4, "1000.0", "1", "2", "0.1", "0.2", 1, "94 %"]
    assert script._median_round(rounds[:2]) == [4, "900.0", "1", "2", "0.1", "0.2", 1, "94 %"]

# Triton's Python backend: the model dflash_onnx/serving/triton.py writes, run against tests/fake_triton (Triton's
# triton_python_backend_utils exists only inside tritonserver); its config.pbtxt parsed with Triton's own schema.

FAKE_TRITON = Path(__file__).parent / "fake_triton"


def _triton_schema():
    """Triton's model configuration schema: tritonclient's generated model_config_pb2, loaded by its path
    (importing tritonclient.grpc needs grpcio, and tritonclient[grpc] pins protobuf below the 7 onnx runs on
    here; .ci/run installs tritonclient --no-deps)."""
    import importlib.util

    import tritonclient

    path = Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py"
    spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def triton_model(served, tmp_path, monkeypatch):
    """(model, pb_utils): a TritonPythonModel initialised as Triton would, from the repository written for the
    served directory: config.pbtxt parsed by tritonclient's model_config_pb2 and handed over as JSON."""
    from google.protobuf import json_format, text_format

    model_config_pb2 = _triton_schema()
    from dflash_onnx.serving.host import EngineSettings
    from dflash_onnx.serving.triton import TritonPythonModel, write_repository

    monkeypatch.syspath_prepend(str(FAKE_TRITON))
    import triton_python_backend_utils as pb_utils

    folder = write_repository(EngineSettings(served[0], max_queue=4), tmp_path / "repository", "tiny")
    model_file = (folder / "1" / "model.py").read_text()
    assert model_file.count("from dflash_onnx.serving.triton import TritonPythonModel") == 1
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.model_transaction_policy.decoupled and config.backend == "python" and config.max_batch_size == 0
    model = TritonPythonModel()
    model.initialize({"model_config": json_format.MessageToJson(config, preserving_proto_field_name=True),
                      "model_name": "tiny", "model_instance_kind": "CPU"})
    yield model, pb_utils
    model.finalize()


def _triton_request(pb_utils, text: str, parameters: dict | str | None = None, stream: bool = False):
    import numpy as np

    inputs = {"text_input": np.array([text.encode()], dtype=np.object_), "stream": np.array([stream])}
    if parameters is not None:
        given = parameters if isinstance(parameters, str) else json.dumps(parameters)
        inputs["sampling_parameters"] = np.array([given.encode()], dtype=np.object_)
    return pb_utils.InferenceRequest(inputs)


def _outputs(request) -> list[tuple[str, str | None]]:
    assert request.sender.done.wait(60), "no final response"
    results = []
    for response in request.sender.responses:
        assert not response.has_error(), response.error().message()
        named = {t.name(): t.as_numpy()[0].decode() for t in response.output_tensors()}
        results.append((named["text_output"], named.get("finish_reason")))
    return results


def test_a_triton_model_gives_the_targets_greedy_text_streamed_or_not(triton_model, served, solo):
    model, pb_utils = triton_model
    prompt = "def add(a, b):"
    want, _ = solo(list(TextCodec(served[0]).encode(prompt)), 20)
    whole = _triton_request(pb_utils, prompt, {"max_tokens": 20})
    streamed = _triton_request(pb_utils, prompt, {"max_tokens": 20}, stream=True)
    assert model.execute([whole, streamed]) is None  # decoupled: the responses come from the model's threads
    (text, finish), = _outputs(whole)
    assert text == want and finish in ("length", "stop")
    parts = _outputs(streamed)
    assert "".join(text for text, _ in parts) == want and len(parts) > 1
    assert [finish for _, finish in parts[:-1]] == [None] * (len(parts) - 1) and parts[-1][1] == finish


def test_a_triton_request_the_model_cannot_honour_gets_one_error_response(triton_model):
    model, pb_utils = triton_model
    cases = ((_triton_request(pb_utils, "x = ", {"best_of": 2}), "best_of"),
             (_triton_request(pb_utils, "x = ", "{not json"), "sampling_parameters is not valid JSON"),
             (_triton_request(pb_utils, "x = ", {"max_tokens": 0}), "max_tokens must be at least 1"),
             (_triton_request(pb_utils, "", {"max_tokens": 3}), "the prompt is empty"),
             (_triton_request(pb_utils, "x = ", {"stop": [1]}), "stop must be a string or a list of strings"))
    model.execute([request for request, _ in cases])
    for request, message in cases:
        assert request.sender.done.wait(10)
        (response,) = request.sender.responses
        assert response.has_error() and message in response.error().message()


def test_a_cancelled_triton_request_stops_at_its_next_step(triton_model):
    model, pb_utils = triton_model
    request = _triton_request(pb_utils, "def f(x):", {"max_tokens": 400}, stream=True)
    request.cancelled = True  # the client cancelled it (Triton's request.is_cancelled())
    finished = model.engine.finished["cancelled"]
    model.execute([request])
    assert request.sender.done.wait(30)
    last = request.sender.responses[-1]
    assert last.has_error() and "cancelled" in last.error().message()
    assert model.engine.finished["cancelled"] == finished + 1


def test_a_triton_repository_is_written_only_for_settings_that_open(served, tmp_path, capsys):
    from dflash_onnx.serving.triton import main

    assert main([str(tmp_path / "missing"), str(tmp_path / "repository")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main([str(served[0]), str(tmp_path / "repository"), "--max-batch", "0"]) == 2
    assert "--max-batch must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "repository").exists()
    assert main([str(served[0]), str(tmp_path / "repository"), "--name", "a/b"]) == 2
    assert not (tmp_path / "repository").exists()


def test_engine_settings_from_strings_refuse_what_they_cannot_read(tmp_path):
    from dflash_onnx.runtime.errors import DFlashError
    from dflash_onnx.serving.host import EngineSettings

    read = EngineSettings.from_strings({"directory": str(tmp_path), "max_batch": "4", "lookup_guess": "off",
                                        "verify": "3", "compute_units": "cpu_only", "shared_draft": "off"})
    assert (read.max_batch, read.lookup_guess, read.verify, read.session_options, read.shared_draft) == (
        4, False, "3", {"compute_units": "cpu_only"}, False)
    for values, message in (({"directory": str(tmp_path), "max_bach": "4"}, "unknown engine setting(s) max_bach"),
                            ({"max_batch": "4"}, "needs directory=PATH"),
                            ({"directory": str(tmp_path), "max_queue": "many"}, "max_queue must be a whole number"),
                            ({"directory": str(tmp_path), "batch_invariant": "maybe"}, "batch_invariant must be on")):
        with pytest.raises(DFlashError, match=re.escape(message)):
            EngineSettings.from_strings(values)
    for settings, message in ((EngineSettings(tmp_path, verify="sometimes"), "--verify sometimes"),
                              (EngineSettings(tmp_path, backend="gpu"), "unknown backend 'gpu'"),
                              (EngineSettings(tmp_path, cost_model=tmp_path / "no.json"), "is not a file"),
                              (EngineSettings(tmp_path / "missing"), "is not a directory")):
        with pytest.raises(DFlashError, match=re.escape(message)):
            settings.check()


def test_a_ray_serve_deployment_answers_the_openai_client_like_serve(served, solo, monkeypatch):
    """dflash_onnx/serving/ray_serve.py's app_builder, as `serve run dflash_onnx.serving.ray_serve:app_builder
    directory=DIR ...` calls it,
    on a local Ray: the replica opens its own engine and answers the OpenAI client with the greedy text."""
    import socket

    import ray
    from ray import serve

    from dflash_onnx.serving.ray_serve import app_builder

    # Serve's controller gives a starting HTTP proxy three readiness checks of 5 s, then kills it (its controller
    # log, twice beside the other test worker on 2 busy cores); the controller reads this when ray.init starts it
    monkeypatch.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app_builder({"directory": str(served[0]), "model": MODEL, "max_queue": "4", "num_cpus": "0.5"}),
                  name="dflash", route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = "def add(a, b):"
        want, count = solo(list(TextCodec(served[0]).encode(prompt)), 20)
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        assert reply.choices[0].text == want and reply.usage.completion_tokens == count
        streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == want
        with pytest.raises(NotFoundError):
            client.completions.create(model="another", prompt=prompt, max_tokens=2)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_the_ray_app_builder_refuses_bad_settings_in_the_driver(served):
    from dflash_onnx.runtime.errors import DFlashError
    from dflash_onnx.serving.ray_serve import app_builder

    for values, message in (({"directory": str(served[0]), "num_replicas": "0"}, "num_replicas must be at least 1"),
                            ({"directory": str(served[0]), "max_tokens": "lots"}, "is not a number"),
                            ({"directory": str(served[0]), "replicas": "2"}, "unknown engine setting(s) replicas")):
        with pytest.raises(DFlashError, match=re.escape(message)):
            app_builder(values)
