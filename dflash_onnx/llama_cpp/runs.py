"""llama.cpp's own runs of the GGUF pair: `llama-bench` for the greedy step (tg at the prompts' depth), and
`llama-server` for greedy and `draft-dflash` decoding of the bench's prompts, fed as token ids so both sides decode
the same context, with the server's own decode timings (prefill excluded, the first token counted, as ours)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dflash_onnx.llama_cpp.build import LlamaCpp, exit_reason, failure_line
from dflash_onnx.runtime.errors import DFlashError

START_TIMEOUT_S = 180.0


def bench_greedy_step(llama: LlamaCpp, target: Path, threads: int, tokens: int, depth: int, repeats: int,
                      block: int) -> dict:
    """llama-bench's text-generation rate (`tokens` tokens one at a time after a `depth`-token context), and its
    batch of `block` tokens at the same depth: llama.cpp's t(block) / t(1), the verify cost DFlash pays there."""
    command = [str(llama.tool("llama-bench")), "-m", str(target), "-t", str(threads), "-p", str(block),
               "-n", str(tokens), "-d", str(depth), "-r", str(max(1, repeats)), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise DFlashError(f"llama-bench failed ({exit_reason(done.returncode, done.stderr + done.stdout)})")
    try:
        tests = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise DFlashError(f"llama-bench printed no JSON: {failure_line(done.stdout + done.stderr)}") from None
    generation = [t for t in tests if t.get("n_gen")]
    batch = [t for t in tests if t.get("n_prompt") and not t.get("n_gen")]
    step_ms = 1000 / float(generation[0]["avg_ts"])
    block_ms = 1000 * block / float(batch[0]["avg_ts"]) if batch else None
    return {"tokens_per_second": float(generation[0]["avg_ts"]), "stdev": float(generation[0].get("stdev_ts", 0.0)),
            "verify_ratio": block_ms / step_ms if block_ms else None}


class Server:
    """A running llama-server: its URL, and its log for saying why it failed."""

    def __init__(self, url: str, log):
        self.url, self._log = url, log

    def complete(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, list[float]]:
        try:
            return complete(self.url, ids, max_new_tokens)
        except (urllib.error.URLError, http.client.HTTPException, OSError, json.JSONDecodeError, KeyError) as exc:
            self._log.seek(0)
            raise DFlashError(f"llama-server failed ({exc}): {failure_line(self._log.read())}") from None


@contextmanager
def server(llama: LlamaCpp, target: Path, threads: int, context: int, draft: Path | None = None,
           draft_tokens: int = 0, slots: int = 1):
    """A llama-server on 127.0.0.1 with `slots` parallel slots of `context` tokens each (and the draft as
    `draft-dflash` with `draft_tokens` proposals a step), stopped on exit."""
    port = _free_port()
    command = [str(llama.tool("llama-server")), "-m", str(target), "-t", str(threads), "-tb", str(threads),
               "-c", str(context * slots), "-np", str(slots), "--host", "127.0.0.1", "--port", str(port)]
    if draft is not None:
        command += ["-md", str(draft), "--spec-type", "draft-dflash", "-td", str(threads), "-tbd", str(threads),
                    "--spec-draft-n-max", str(draft_tokens), "--spec-draft-n-min", "0"]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, process, log)
            yield Server(url, log)
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def complete(url: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float, list[float]]:
    """One greedy completion of `ids`: (tokens, prefill s, decode s, [tokens per target step] when drafting)."""
    # not ignore_eos: llama-server implements it by banning the end-of-generation tokens, which changes greedy output
    body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "stream": False}
    reply = _post(f"{url}/completion", body)
    timings = reply.get("timings", {})
    steps = []
    if timings.get("draft_n"):  # tokens per target step: the accepted proposals plus one, over the steps drafted
        made = int(timings["predicted_n"])
        accepted = int(timings.get("draft_n_accepted", 0))
        verifies = made - accepted - 1  # the prefill's token, then each verify commits its accepted + 1
        steps = [(made - 1) / verifies] if verifies > 0 else []
    return ([int(t) for t in reply["tokens"]], timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000, steps)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise DFlashError(f"llama-server answered {exc.code}: {exc.read()[:300].decode(errors='replace')}") from None


def _wait_ready(url: str, process: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise DFlashError(f"llama-server exited ({exit_reason(process.returncode, log.read())})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise DFlashError(f"llama-server did not answer /health within {START_TIMEOUT_S:.0f} s")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def median_depth(prompts: list[dict]) -> int:
    return int(np.median([len(p["ids"]) for p in prompts]))
