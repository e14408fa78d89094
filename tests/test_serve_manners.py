"""`dflash-onnx serve`'s manners: a taken port refused in one line before anything claims to be serving; request
bodies read within limits (size, nesting depth, Unicode), every bad one a 4xx in the OpenAI error shape, never a 500;
one access-log line per request, text or JSON; and a shutdown on SIGTERM or Ctrl-C that lets the requests under way
finish or cancels them cleanly, stops the engine, says what it did in one line and exits 0.

Most servers here run over a fake decoder (tokens as fast or as slow as a test needs); the command line itself runs
once over a tiny exported pair. Shutdowns run in a subprocess (signals reach a process), synchronised on what the
server prints and answers, each wait bounded by a deadline."""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve import Server

from dflash_onnx.serving.app import ServerOptions, create_app
from dflash_onnx.serving.engine import Engine
from dflash_onnx.serving.protocol import nesting_depth

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"


class _Decoder:
    """A decoder that commits its first token, then `per_step` tokens a step, `step_s` seconds a step (a fake
    model's step time, not a wait for the test)."""

    stop_token_ids: list[int] = []

    def __init__(self, per_step: int = 3, step_s: float = 0.0):
        self.per_step, self.step_s = per_step, step_s

    def check(self, prompt_ids, max_tokens, mode, sampling):
        return prompt_ids

    def stream(self, prompt_ids, max_tokens, mode, sampling, stop_token_ids, verify, cancelled=None):
        def steps():
            made = 0
            while made < max_tokens:
                time.sleep(self.step_s)
                chunk = [5] * (1 if made == 0 else min(self.per_step, max_tokens - made))
                made += len(chunk)
                yield chunk

        return steps()


class _Codec:
    def decode(self, ids):
        return "x" * len(ids)

    def encode(self, text):
        return [1] * len(text)

    def chat_ids(self, messages):
        return [1] * sum(len(m["content"]) + 1 for m in messages)


@pytest.fixture
def fake_server():
    """serve(**options) -> a Server over a fast fake engine; stopped after the test."""
    started = []

    def serve(**options) -> Server:
        engine = Engine(_Decoder(), _Codec(), max_queue=4)
        server = Server(create_app(engine, ServerOptions(model=MODEL, **options)))
        started.append((server, engine))
        return server

    yield serve
    for server, engine in started:
        server.stop()
        engine.close()


# -- a taken port ---------------------------------------------------------------------------------------------------


def test_a_taken_port_or_a_foreign_address_is_refused_in_one_line_before_serving(tmp_path, capsys):
    """The socket is bound before the sessions open, so the refusal needs no model: an empty directory passes
    the flag checks and never gets opened."""
    from dflash_onnx.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"dflash-onnx serve: error: cannot listen on 127.0.0.1:{port}: the port is taken by another "
                       "process; choose another --port (0: a free one)"]
    assert main(["serve", str(tmp_path), "--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1: nobody's
    assert capsys.readouterr().err.strip().splitlines() == [
        "dflash-onnx serve: error: 192.0.2.1 is not an address of this machine: choose another --host"]
    assert main(["serve", str(tmp_path), "--shutdown-grace", "-1"]) == 2
    assert "--shutdown-grace must be at least 0" in capsys.readouterr().err


# -- bodies within limits -------------------------------------------------------------------------------------------


def _json_depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_json_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_json_depth, value.values()), default=0)
    return 0


def test_nesting_depth_counts_brackets_outside_strings_as_a_parser_nests():
    rng = random.Random(5)
    pieces = ["[", "]", "{", "}", '"', "\\", '\\"', "a", "\n", "é"]

    def value(depth: int):
        roll = rng.random()
        if depth > 8 or roll < 0.3:
            return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
        if roll < 0.65:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {f"{rng.choice(pieces)}{i}": value(depth + 1) for i in range(rng.randint(0, 3))}

    for _ in range(500):
        tree = value(0)
        for ascii_only in (True, False):
            assert nesting_depth(json.dumps(tree, ensure_ascii=ascii_only).encode()) == _json_depth(tree)
    assert nesting_depth(b"[" * 100_000) == 100_000
    assert nesting_depth(b'{"prompt": "' + b"[{" * 50_000 + b'"}') == 1
    assert nesting_depth(b'"\\\\"[[') == 2  # an escaped backslash does not escape the quote after it


def _assert_openai_error(response: httpx.Response, status: int, message: str, what: str) -> None:
    assert response.status_code == status, (what, response.status_code, response.text[:200])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, what
    assert message in error["message"] and error["type"], (what, error)


def test_bad_bodies_get_4xx_in_the_openai_shape_never_500(fake_server):
    url = fake_server().url
    deep = b"[" * 100_000 + b"]" * 100_000
    cases = [  # (what, body, status, message)
        ("100,000 nested arrays", deep, 400, "nests arrays and objects 100000 deep: at most 64"),
        ("100,000 nested objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400, "100000 deep"),
        ("nested arrays in the prompt", b'{"prompt": ' + deep + b"}", 400, "100001 deep"),
        ("65 levels", json.dumps({"prompt": "x", "user": json.loads("[" * 64 + "]" * 64)}).encode(), 400,
         "65 deep"),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON ('utf-8' codec can't decode"),
        ("not JSON", b'{"prompt": ', 400, "not valid JSON"),
        ("empty", b"", 400, "not valid JSON"),
        ("an array", b"[1, 2]", 400, "must be a JSON object, got an array"),
        ("a string", b'"hi"', 400, "must be a JSON object, got a string"),
        ("a number", b"3", 400, "got a number"),
        ("null", b"null", 400, "got null"),
        ("true", b"true", 400, "got a boolean"),
        ("a 5000-digit number", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400,
         "Exceeds the limit (4300 digits)"),
        ("a lone surrogate", b'{"prompt": "a\\ud800"}', 400, "lone UTF-16 surrogate (\\ud800)"),
        ("a lone surrogate in chat", b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', 400,
         "lone UTF-16 surrogate"),
        ("prompt a number", b'{"prompt": 5}', 422, "prompt"),
        ("max_tokens a string", b'{"prompt": "x", "max_tokens": "many"}', 422, "max_tokens"),
        ("stream a list", b'{"prompt": "x", "stream": [1]}', 422, "stream"),
        ("temperature NaN", b'{"prompt": "x", "temperature": NaN}', 422, "temperature"),
        ("messages a string", b'{"messages": "hi"}', 422, "messages"),
        ("an unknown role", b'{"messages": [{"role": "robot", "content": "hi"}]}', 422, "role"),
        ("a body over --max-body-bytes", json.dumps({"prompt": "x" * (1 << 20)}).encode(), 413, "over 1048576"),
    ]
    with httpx.Client(base_url=url, timeout=30) as client:
        for what, body, status, message in cases:
            route = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
            _assert_openai_error(client.post(route, content=body, headers={"content-type": "application/json"}),
                                 status, message, what)
            if b'"messages"' not in body:  # the chat route reads its body the same way
                answer = client.post("/v1/chat/completions", content=body)
                assert 400 <= answer.status_code < 500 and answer.json()["error"]["message"], what
        chunked = client.post("/v1/completions", content=iter([b'{"prompt": "', b"x" * (1 << 20), b'"}']))
        _assert_openai_error(chunked, 413, "over 1048576", "a chunked body over the limit")
        # within the limits: 64 levels, brackets inside strings, a surrogate pair, served
        within = [{"prompt": "x", "max_tokens": 2, "user": json.loads("[" * 63 + "]" * 63)},
                  {"prompt": "[{" * 5000, "max_tokens": 2}, {"prompt": "\U0001f600", "max_tokens": 2}]
        for body in within:
            assert client.post("/v1/completions", json=body).status_code == 200, str(body)[:60]
        # a valid body cut or with a byte changed anywhere: 200 or 4xx, never 500
        rng = random.Random(11)
        valid = json.dumps({"prompt": "def f(x):", "max_tokens": 3, "stop": ["\n"], "temperature": 0.0,
                            "user": {"id": [1, 2]}}).encode()
        for _ in range(120):
            cut = rng.randrange(len(valid))
            broken = valid[:cut] if rng.random() < 0.5 else valid[:cut] + bytes([rng.randrange(256)]) + valid[cut + 1:]
            answer = client.post("/v1/completions", content=broken)
            assert answer.status_code == 200 or (400 <= answer.status_code < 500 and answer.json()["error"]), broken


# -- the access log -------------------------------------------------------------------------------------------------


def _lines(capsys, count: int, deadline_s: float = 10.0) -> list[str]:
    """The first `count` lines written to stderr (a line is written once its response has gone: polled)."""
    lines: list[str] = []
    deadline = time.monotonic() + deadline_s
    while len(lines) < count:
        lines += capsys.readouterr().err.splitlines()
        assert time.monotonic() < deadline, f"{len(lines)} of {count} access-log lines: {lines}"
        time.sleep(0.01)
    return lines


TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z 127\.0\.0\.1:\d+ (?P<method>[A-Z]+) (?P<path>\S+) "
                       r"(?P<status>\d{3}) prompt_tokens=(?P<prompt>\S+) completion_tokens=(?P<completion>\S+) "
                       r"tau=(?P<tau>\S+) ttft_ms=(?P<ttft>\S+) total_ms=(?P<total>[\d.]+) finish=(?P<finish>\S+)$")


def test_one_text_access_line_per_request(fake_server, capsys):
    url = fake_server(access_log="text").url
    capsys.readouterr()
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 7}).status_code == 200
        with client.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 4, "stream": True}) as streamed:
            assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", content=b"[" * 1000).status_code == 400
        assert client.get("/v1/nothing%0Afake 200").status_code == 404
    lines = _lines(capsys, 5)
    assert len(lines) == 5, lines
    parsed = [TEXT_LINE.match(line) for line in lines]
    assert all(parsed), lines
    by_kind = {(m["path"], m["status"]): m.groupdict() for m in parsed}  # a stream's line may come after the next
    whole, streamed, health, refused, missing = (by_kind[key] for key in (
        ("/v1/completions", "200"), ("/v1/chat/completions", "200"), ("/health", "200"), ("/v1/completions", "400"),
        ("/v1/nothing%0Afake%20200", "404")))
    assert (whole["method"], whole["path"], whole["status"], whole["prompt"], whole["completion"], whole["tau"],
            whole["finish"]) == ("POST", "/v1/completions", "200", "4", "7", "3.0", "length")  # 1 + 3 + 3 tokens
    assert float(whole["ttft"]) <= float(whole["total"])
    assert (streamed["path"], streamed["prompt"], streamed["completion"], streamed["tau"], streamed["finish"]) == (
        "/v1/chat/completions", "3", "4", "3.0", "length")
    assert (health["method"], health["path"], health["status"], health["prompt"], health["tau"], health["ttft"],
            health["finish"]) == ("GET", "/health", "200", "-", "-", "-", "-")
    assert (refused["status"], refused["completion"]) == ("400", "-")
    assert (missing["status"], missing["path"]) == ("404", "/v1/nothing%0Afake%20200")  # one line, not forged


def test_json_access_lines_are_one_object_each(fake_server, capsys):
    url = fake_server(access_log="json", api_key="sesame").url
    capsys.readouterr()
    with httpx.Client(base_url=url, timeout=30) as client:
        headers = {"authorization": "Bearer sesame"}
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 1}, headers=headers).is_success
        assert client.post("/v1/completions", json={"prompt": "ab"}).status_code == 401
    first, refused = (json.loads(line) for line in _lines(capsys, 2))
    keys = ["time", "client", "method", "path", "status", "prompt_tokens", "completion_tokens", "tau", "ttft_ms",
            "total_ms", "finish"]
    assert list(first) == keys and list(refused) == keys
    assert (first["status"], first["prompt_tokens"], first["completion_tokens"], first["tau"], first["finish"]) == (
        200, 2, 1, None, "length")  # one token: no decoding step, no tau
    assert 0 <= first["ttft_ms"] <= first["total_ms"]
    assert (refused["status"], refused["prompt_tokens"], refused["ttft_ms"]) == (401, None, None)


# -- shutdown -------------------------------------------------------------------------------------------------------

SLOW_SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_serve_manners import _Codec, _Decoder
from dflash_onnx.serving.app import ServerOptions, create_app
from dflash_onnx.serving.engine import Engine
from dflash_onnx.serving.server import listen, run, url

engine = Engine(_Decoder(per_step=1, step_s=0.02), _Codec(), max_queue=4)
sock = listen("127.0.0.1", 0)
print("listening on", url(sock), file=sys.stderr, flush=True)
print(run(create_app(engine, ServerOptions(model="tiny", access_log="text")), sock, engine, float(sys.argv[1])),
      file=sys.stderr, flush=True)
"""


class _Process:
    """A server subprocess whose stderr lines are read as they come (a thread), waited for with deadlines."""

    def __init__(self, command: list[str]):
        self.popen = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.popen.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, pattern: str, deadline_s: float = 60.0) -> re.Match:
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {deadline_s} s: {self.seen}") from None
            assert line is not None, f"the server ended without a line matching {pattern!r}: {self.seen}"
            self.seen.append(line)
            found = re.search(pattern, line)
            if found:
                return found

    def rest(self, deadline_s: float = 30.0) -> tuple[int, list[str]]:
        """(exit code, the lines after those waited for) once the process has ended."""
        code = self.popen.wait(timeout=deadline_s)
        rest = []
        while (line := self.lines.get(timeout=deadline_s)) is not None:
            rest.append(line)
        return code, rest

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()


def _slow_server(grace: float) -> tuple[_Process, str]:
    process = _Process([sys.executable, "-c", SLOW_SERVER.format(tests=str(ROOT / "tests")), str(grace)])
    return process, process.wait_line(r"listening on (http://\S+)", 60).group(1)


def _under_way(url: str, tokens: int) -> tuple[dict, threading.Thread, threading.Thread]:
    """A stream running and a whole completion waiting behind it (one at a time), `tokens` each: started, the
    stream's first chunk read and the second request seen queued (its /health count), before returning."""
    got: dict = {"stream": [], "first": threading.Event()}

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "a", "max_tokens": tokens,
                                                                 "stream": True}, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    got["stream"].append(line)
                    got["first"].set()

    def whole():
        got["whole"] = httpx.post(f"{url}/v1/completions", json={"prompt": "b", "max_tokens": tokens}, timeout=60)

    streaming, waiting = threading.Thread(target=stream), threading.Thread(target=whole)
    streaming.start()
    assert got["first"].wait(30), "the stream did not start"
    waiting.start()
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").json()["waiting"] != 1:
        assert time.monotonic() < deadline, "the second request was not queued"
        time.sleep(0.01)
    return got, streaming, waiting


def _refused(url: str) -> None:
    """Returns once a new connection to the server is refused (its listening socket closed)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/health", timeout=5)
        except httpx.ConnectError:
            return
        except httpx.TransportError:  # accepted just before the listener closed, then closed unanswered
            pass
        assert time.monotonic() < deadline, "still accepting connections"
        time.sleep(0.01)


def test_sigterm_lets_the_requests_under_way_finish_and_exits_0():
    process, url = _slow_server(grace=60)
    try:
        got, streaming, waiting = _under_way(url, 40)  # 0.8 s each: well within the grace
        process.popen.send_signal(signal.SIGTERM)
        _refused(url)  # new connections are refused at once; those under way go on
        streaming.join(60)
        waiting.join(60)
        assert got["stream"][-1] == "data: [DONE]"
        assert json.loads(got["stream"][-2][6:])["choices"][0]["finish_reason"] == "length"
        assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in got["stream"][:-1]) == "x" * 40
        assert got["whole"].status_code == 200 and got["whole"].json()["usage"]["completion_tokens"] == 40
        code, rest = process.rest()
        assert code == 0, rest
        assert rest[-1] == ("dflash-onnx serve: shut down on SIGTERM: 2 requests under way, 2 finished, "
                            "0 cancelled; the engine stopped"), rest
        assert all(" 200 " in line for line in rest[:-1] if "/v1/completions" in line), rest
    finally:
        process.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_shutdown_past_its_grace_cancels_cleanly_and_exits_0(sig):
    """Grace 0: the stream ends with an error event in the OpenAI shape and [DONE], the waiting completion gets
    503, both well before their 30 s of tokens; SIGINT is Ctrl-C."""
    process, url = _slow_server(grace=0)
    try:
        started = time.monotonic()
        got, streaming, waiting = _under_way(url, 1500)
        process.popen.send_signal(sig)
        streaming.join(60)
        waiting.join(60)
        assert time.monotonic() - started < 20
        assert got["stream"][-1] == "data: [DONE]"
        error = json.loads(got["stream"][-2][6:])["error"]
        assert error["code"] == "shutting_down" and error["message"].startswith("the server is shutting down")
        _assert_openai_error(got["whole"], 503, "the server is shutting down", "the waiting completion")
        code, rest = process.rest()
        assert code == 0, rest
        assert rest[-1] == (f"dflash-onnx serve: shut down on {sig.name}: 2 requests under way, 0 finished, "
                            "2 cancelled (2 at the end of the 0 s grace); the engine stopped"), rest
    finally:
        process.kill()


def test_a_second_signal_cancels_at_once_and_still_ends_cleanly():
    process, url = _slow_server(grace=60)
    try:
        started = time.monotonic()
        got, streaming, waiting = _under_way(url, 1500)  # 30 s each: the grace would let them run
        process.popen.send_signal(signal.SIGTERM)
        _refused(url)  # the shutdown has begun
        process.popen.send_signal(signal.SIGINT)
        streaming.join(60)
        waiting.join(60)
        assert time.monotonic() - started < 20
        assert got["stream"][-1] == "data: [DONE]" and '"code": "shutting_down"' in got["stream"][-2]
        _assert_openai_error(got["whole"], 503, "cancelled before its first token", "the waiting completion")
        code, rest = process.rest()
        assert code == 0, rest
        assert not any("Traceback" in line for line in rest), rest
        assert rest[-1] == ("dflash-onnx serve: shut down on SIGTERM: 2 requests under way, 0 finished, "
                            "2 cancelled (2 on a second signal); the engine stopped"), rest
    finally:
        process.kill()


def test_the_command_serves_on_a_free_port_logs_json_and_stops_on_sigterm(exported):
    """`python -m dflash_onnx serve DIR --port 0 --log-format json` over a tiny exported pair: the serving line
    names the port it got, each request is one JSON line (uvicorn's own access log off), SIGTERM ends it, exit 0."""
    directory = exported("agree_b8").out
    process = _Process([sys.executable, "-m", "dflash_onnx", "serve", str(directory), "--port", "0",
                        "--log-format", "json"])
    try:
        url = process.wait_line(r"^serving \S+ from \S+ on (http://127\.0\.0\.1:\d+)/v1 ", 120).group(1)
        assert not url.endswith(":0")
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 12}, timeout=60)
        assert reply.status_code == 200
        usage = reply.json()["usage"]
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "import os", "max_tokens": 12,
                                                                 "stream": True}, timeout=60) as response:
            assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"
        whole = json.loads(process.wait_line(r"^\{").string)
        streamed = json.loads(process.wait_line(r"^\{").string)
        assert (whole["method"], whole["path"], whole["status"]) == ("POST", "/v1/completions", 200)
        assert (whole["prompt_tokens"], whole["completion_tokens"]) == (usage["prompt_tokens"],
                                                                        usage["completion_tokens"])
        assert whole["tau"] is None or whole["tau"] >= 1.0
        assert 0 < whole["ttft_ms"] <= whole["total_ms"] and streamed["status"] == 200
        process.popen.send_signal(signal.SIGTERM)
        code, rest = process.rest(60)
        assert code == 0
        assert rest == ["dflash-onnx serve: shut down on SIGTERM: no request was under way; the engine stopped"]
    finally:
        process.kill()
