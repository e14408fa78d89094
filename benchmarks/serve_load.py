"""`dflash-onnx serve` under K concurrent clients on loopback: total and per-request tokens/s, time to first token,
p50 / p99 latency, errors and the share of outputs identical to the directory's greedy decode run alone; then the
server's memory over many sequential requests.

The server runs as its own process (`dflash-onnx serve DIR`, what a user starts); each client is a thread that
streams completions (text prompts from `--prompts-file` or built-in code prompts, temperature 0) one after
another until the round has `--requests` of them. The solo oracle is `Decoder.generate(..., "greedy")` on the same
directory in this process, decoded by the same tokenizer.

    python benchmarks/serve_load.py DIR [--clients 1,2,4,8] [--requests 16] [--max-tokens 64]
        [--memory-requests 1000] [--load 0|1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from dflash_onnx.figures import markdown_table, provenance

PROMPTS = ["def fibonacci(n):", "import os\n\n", "class Stack:\n", "for i in range(", "def parse(text):",
           "with open(path) as f:", "if __name__ == '__main__':", "return sorted("]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, directory: Path, extra: list[str]):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen([sys.executable, "-m", "dflash_onnx.cli", "serve", str(directory), "--port",
                                         str(self.port), "--max-queue", "64", *extra],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited: {self.process.stderr.read().strip()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the server did not answer /health within 300 s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def _stream(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion on the client's connection: its text, tokens, time to first token and latency
    (s), or its error."""
    started = time.perf_counter()
    first, texts, tokens = None, [], 0
    try:
        with client.stream("POST", f"{url}/v1/completions", timeout=600,
                           json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read().decode()[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    return {"error": payload["error"]["message"]}
                choice = payload["choices"][0]
                if choice["text"] and first is None:
                    first = time.perf_counter() - started
                texts.append(choice["text"])
                tokens = payload.get("usage", {}).get("completion_tokens", tokens)
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - started
    return {"text": "".join(texts), "tokens": tokens, "ttft": first if first is not None else latency,
            "latency": latency}


def _round(url: str, clients: int, prompts: list[str], requests: int, max_tokens: int) -> tuple[list[dict], float]:
    queue = list(range(requests))
    lock = threading.Lock()
    results: list[dict] = []

    def client() -> None:
        connection = httpx.Client()  # a client keeps its connection, as an application's would
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            result = _stream(connection, url, prompts[index % len(prompts)], max_tokens)
            result["prompt"] = index % len(prompts)
            with lock:
                results.append(result)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    return results, time.perf_counter() - started


def _solo(directory: Path, prompts: list[str], max_tokens: int) -> list[str]:
    from runtime.tokenizer import TextCodec
    from targets import open_decoder

    decoder, codec = open_decoder(directory), TextCodec(directory)
    stops = set(decoder.stop_token_ids)
    texts = []
    for prompt in prompts:
        tokens = decoder.generate(codec.encode(prompt), max_tokens, "greedy").tokens
        texts.append(codec.decode(tokens[:-1] if tokens[-1] in stops else tokens))
    return texts


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--memory-requests", type=int, default=1000, help="sequential requests for the memory "
                        "check (0: skip)")
    parser.add_argument("--load", type=int, default=0, help="busy processes beside the server")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line (default: built-in code prompts)")
    args = parser.parse_args(argv)
    prompts = args.prompts_file.read_text().splitlines() if args.prompts_file else PROMPTS
    counts = [int(k) for k in args.clients.split(",")]
    print("solo greedy outputs ...", file=sys.stderr)
    solo = _solo(args.directory, prompts, args.max_tokens)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    server = Server(args.directory, [])
    rows, memory = [], None
    try:
        _round(server.url, 1, prompts, 2, args.max_tokens)  # warm-up: first calls, page faults
        for clients in counts:
            print(f"{clients} clients ...", file=sys.stderr)
            results, wall = _round(server.url, clients, prompts, args.requests, args.max_tokens)
            done = [r for r in results if "error" not in r]
            tokens = sum(r["tokens"] for r in done)
            same = sum(r["text"] == solo[r["prompt"]] for r in done)
            rows.append([clients, f"{tokens / wall:.1f}",
                         f"{statistics.median(r['tokens'] / r['latency'] for r in done):.1f}" if done else "-",
                         f"{1000 * statistics.median(r['ttft'] for r in done):.0f}" if done else "-",
                         f"{_percentile([r['latency'] for r in done], 0.5):.2f}" if done else "-",
                         f"{_percentile([r['latency'] for r in done], 0.99):.2f}" if done else "-",
                         len(results) - len(done), f"{100 * same / max(1, len(results)):.0f} %"])
        if args.memory_requests:
            print(f"{args.memory_requests} sequential requests ...", file=sys.stderr)
            before = _rss_mb(server.process.pid)
            samples, connection = [], httpx.Client()
            for index in range(args.memory_requests):
                _stream(connection, server.url, prompts[index % len(prompts)], 8)
                if index % max(1, args.memory_requests // 4) == 0:
                    samples.append(_rss_mb(server.process.pid))
            memory = (before, samples, _rss_mb(server.process.pid))
    finally:
        server.stop()
        for process in busy:
            process.kill()
    print(markdown_table(["clients", "total tok/s", "per-request tok/s (median)", "TTFT ms (median)", "latency p50 s",
                          "latency p99 s", "errors", "identical to solo greedy"], rows))
    if memory:
        before, samples, after = memory
        print(f"\nserver RSS over {args.memory_requests} sequential requests: {before:.0f} MB before, "
              f"{', '.join(f'{s:.0f}' for s in samples)} MB along the way, {after:.0f} MB after")
    print(f"\n{provenance()} " + (f"Beside {args.load} busy process(es)." if args.load else "Quiet."))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
