"""`dflash-onnx serve` under K concurrent clients on loopback: total and per-request tokens/s, time to first token,
p50 / p99 latency, errors and the share of outputs identical to the directory's greedy decode run alone; then the
server's memory over many sequential requests. `--max-batch N`: the server decodes up to N requests side by side (a
lowering with --kv-attention ragged), `--own-drafts` beside it the same server drafting one request at a time
(--shared-draft off); `--greedy`: the same rounds against the server decoding greedily (--verify 0), batched
alike. `--peers llama.cpp`: the same rounds against llama-server on the directory's checkpoints at its precision
(GGUF files as `bench --peers llama.cpp` makes them), `-np K` slots for K clients, greedy and `draft-dflash`,
prompts sent as our tokenizer's ids and outputs compared by token id.

The server runs as its own process (`dflash-onnx serve DIR`, what a user starts); each client is a thread that
streams completions (text prompts from `--prompts-file` or built-in code prompts, temperature 0) one after
another until the round has `--requests` of them. The solo oracle is `Decoder.generate(..., "greedy")` on the same
directory in this process, decoded by the same tokenizer.

    python benchmarks/serve_load.py DIR [--clients 1,2,4,8] [--requests 16] [--max-tokens 64]
        [--memory-requests 1000] [--load 0|1] [--max-batch N [--own-drafts]] [--greedy] [--rounds 1]
        [--prompt-tokens 64,2048 [--prefill-chunk N]] [--peers llama.cpp [--llama-cpp DIR] [--llama-cpp-type TYPE]]

`--prompt-tokens`: before the throughput rounds, per client count, a round of the shortest prompts alone and one
of the lengths mixed (prompts of exactly those token counts cut from held-out code): time to first token per length
and the gaps between the short requests' streamed events, p50 / p99, the p99 over the short-only round's.
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
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def _stream(client: httpx.Client, url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed completion on the client's connection (a text prompt, or token ids): its text, tokens, time to
    first token, latency and the gaps between its streamed events (s), or its error."""
    started = time.perf_counter()
    first, texts, tokens, arrivals = None, [], 0, []
    try:
        with client.stream("POST", f"{url}/v1/completions", timeout=600,
                           json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                                 "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.read().decode()[:200]}"}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if "error" in payload:
                    return {"error": payload["error"]["message"]}
                tokens = (payload.get("usage") or {}).get("completion_tokens", tokens)  # the last chunk's, asked for
                if not payload["choices"]:
                    continue
                choice = payload["choices"][0]
                if choice["text"]:
                    arrivals.append(time.perf_counter() - started)
                    first = arrivals[0]
                texts.append(choice["text"])
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    latency = time.perf_counter() - started
    return {"text": "".join(texts), "tokens": tokens, "ttft": first if first is not None else latency,
            "latency": latency, "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


def _round(url: str, clients: int, prompts: list[str], requests: int, max_tokens: int) -> tuple[list[dict], float]:
    local = threading.local()  # a client keeps its connection, as an application's would

    def once(index: int) -> dict:
        if not hasattr(local, "connection"):
            local.connection = httpx.Client()
        return _stream(local.connection, url, prompts[index], max_tokens)

    return _rounds_of(once, clients, len(prompts), requests)


def _solo(directory: Path, prompts: list[str | list[int]], max_tokens: int) -> list[str]:
    from dflash_onnx.runtime.tokenizer import TextCodec
    from dflash_onnx.targets import open_decoder

    decoder, codec = open_decoder(directory), TextCodec(directory)
    stops = set(decoder.stop_token_ids)
    texts = []
    for prompt in prompts:
        tokens = decoder.generate(codec.encode(prompt) if isinstance(prompt, str) else prompt, max_tokens,
                                  "greedy").tokens
        texts.append(codec.decode(tokens[:-1] if tokens[-1] in stops else tokens))
    return texts


def _llama_cpp_rows(directory: Path, prompts: list[str], counts: list[int], requests: int, max_tokens: int,
                    llama_cpp_dir: Path | None, llama_type: str | None = None) -> list[list]:
    """The rounds against llama-server, greedy and draft-dflash, K slots for K clients (rows as main's, the server
    named first; a run llama.cpp cannot do becomes a row saying why)."""
    from dflash_onnx.artifacts.model_dirs import read_config
    from dflash_onnx.demo import cache_root
    from dflash_onnx.llama_cpp import build, gguf, runs
    from dflash_onnx.llama_cpp.peer import threads_of, unsupported_draft
    from dflash_onnx.peers import same_tokens
    from dflash_onnx.runtime.errors import DFlashError
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.runtime.tokenizer import TextCodec
    from dflash_onnx.targets import open_decoder

    manifest = load_manifest(directory)
    target_dir, draft_dir = manifest.checkpoints()
    llama = build.find(llama_cpp_dir) if llama_cpp_dir else build.cached(cache_root(), True)
    tied = bool(read_config(target_dir, "target").get("tie_word_embeddings"))
    precision = gguf.named_precision(manifest, llama_type) if llama_type else gguf.precision_for(manifest, tied)
    unsupported = unsupported_draft(manifest, target_dir)
    target, draft = gguf.ggufs(llama, target_dir, None if unsupported else draft_dir, precision, cache_root())
    codec, decoder = TextCodec(directory), open_decoder(directory)
    ids = [list(codec.encode(prompt)) for prompt in prompts]
    solo = [decoder.generate(prompt, max_tokens, "greedy").tokens for prompt in ids]
    threads, stops = threads_of(manifest), list(manifest.stop_token_ids)
    context = max(map(len, ids)) + max_tokens + manifest.block_size + 64
    rows = []
    for drafting in (False, True):
        name = (f"llama-server draft-dflash, {precision.weights.upper()}" if drafting else
                f"llama-server greedy, {precision.weights.upper()}")
        if drafting and unsupported:
            rows.append([name, "-", "-", "-", "-", "-", "-", "-", unsupported])
            continue
        for clients in counts:
            print(f"{name}: {clients} clients ...", file=sys.stderr)
            try:
                with runs.server(llama, target, threads, context, draft if drafting else None,
                                 manifest.block_size - 1, slots=clients) as server:
                    server.complete(ids[0], 8)  # warm-up
                    results, wall = _rounds_of(
                        lambda index, s=server: _timed(lambda: s.complete(ids[index], max_tokens)), clients,
                        len(prompts), requests)
            except DFlashError as exc:
                rows.append([name, clients, "-", "-", "-", "-", "-", "-", str(exc)])
                continue
            done = [r for r in results if "error" not in r]
            same = sum(same_tokens([r["tokens"]], [solo[r["prompt"]]], stops) for r in done)
            rows.append([name, *_figures(clients, results, done, wall, same)])
    return rows


def _rounds_of(once, clients: int, prompts: int, requests: int) -> tuple[list[dict], float]:
    """`requests` calls of `once(prompt index) -> result` from `clients` threads, each result with its prompt."""
    queue, lock, results = list(range(requests)), threading.Lock(), []

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                index = queue.pop(0)
            result = once(index % prompts)
            result["prompt"] = index % prompts
            with lock:
                results.append(result)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for _ in range(clients):
            pool.submit(client)
    return results, time.perf_counter() - started


def _timed(complete) -> dict:
    """One llama-server completion: its tokens, prefill (as its time to first token) and latency, or its error."""
    started = time.perf_counter()
    try:
        tokens, prefill, _, _ = complete()
    except Exception as exc:  # a failed request is counted, as the server's errors are
        return {"error": str(exc)}
    return {"tokens": tokens, "ttft": prefill, "latency": time.perf_counter() - started}


def _figures(clients: int, results: list[dict], done: list[dict], wall: float, same: int) -> list:
    """A round's row: clients, total and per-request tok/s, TTFT, latency p50 / p99, errors, identical share."""
    count = (lambda r: len(r["tokens"])) if done and isinstance(done[0]["tokens"], list) else (lambda r: r["tokens"])
    tokens = sum(count(r) for r in done)
    return [clients, f"{tokens / wall:.1f}",
            f"{statistics.median(count(r) / r['latency'] for r in done):.1f}" if done else "-",
            f"{1000 * statistics.median(r['ttft'] for r in done):.0f}" if done else "-",
            f"{_percentile([r['latency'] for r in done], 0.5):.2f}" if done else "-",
            f"{_percentile([r['latency'] for r in done], 0.99):.2f}" if done else "-",
            len(results) - len(done), f"{100 * same / max(1, len(results)):.0f} %"]


def _median_round(rounds: list[list]) -> list:
    """Of one server's rounds at one client count: the figures of the round with the median total tok/s, with
    the errors summed over every round and the lowest identical share of any."""
    ordered = sorted(rounds, key=lambda figures: float(figures[1]))
    row = list(ordered[(len(ordered) - 1) // 2])
    row[6] = sum(figures[6] for figures in rounds)
    row[7] = f"{min(int(figures[7].split()[0]) for figures in rounds)} %"
    return row


def _memory(server: Server, prompts: list[str], requests: int, max_tokens: int) -> tuple[float, list[float], float]:
    """The server's RSS before, along and after `requests` sequential short requests."""
    print(f"{requests} sequential requests ...", file=sys.stderr)
    before = _rss_mb(server.process.pid)
    samples, connection = [], httpx.Client()
    for index in range(requests):
        _stream(connection, server.url, prompts[index % len(prompts)], 8)
        if index % max(1, requests // 4) == 0:
            samples.append(_rss_mb(server.process.pid))
    return before, samples, _rss_mb(server.process.pid)


def _length_prompts(directory: Path, lengths: list[int], count: int) -> list[list[int]]:
    """`count` prompts of exactly the given token counts in turn (64, 2048, 64, ...), cut from held-out code."""
    from dflash_onnx.demo import held_out_texts
    from dflash_onnx.runtime.tokenizer import TextCodec

    codec = TextCodec(directory)
    pool = [codec.encode(text) for text in held_out_texts()]
    prompts = []
    for index in range(count):
        length = lengths[index % len(lengths)]
        source = [ids for ids in pool[index:] + pool[:index] if len(ids) >= length] or [sum(pool, [])]
        if len(source[0]) < length:
            raise SystemExit(f"--prompt-tokens {length}: the held-out code holds only {len(source[0])} tokens")
        prompts.append(source[0][:length])
    return prompts


def _latency_row(name: str, clients: int, mix: str, results: list[dict], prompts: list[list[int]],
                 short_only_p99: float | None) -> list:
    """Time to first token per prompt length and the gaps between streamed events of the shortest prompts' requests
    (p50 / p99, ms), with the short requests' p99 gap over what it is with short prompts only."""
    done = [r for r in results if "error" not in r]
    shortest = min(len(p) for p in prompts)
    by_length: dict[int, list[dict]] = {}
    for r in done:
        by_length.setdefault(len(prompts[r["prompt"]]), []).append(r)
    ttft = "; ".join(f"{length}: {1000 * _percentile([r['ttft'] for r in rs], 0.5):.0f} / "
                     f"{1000 * _percentile([r['ttft'] for r in rs], 0.99):.0f}"
                     for length, rs in sorted(by_length.items()))
    gaps = [gap for r in by_length.get(shortest, []) for gap in r["gaps"]]
    p99 = _percentile(gaps, 0.99) if gaps else float("nan")
    ratio = f"{p99 / short_only_p99:.2f}x" if short_only_p99 and gaps else "-"
    return [name, clients, mix, ttft, f"{1000 * _percentile(gaps, 0.5):.1f} / {1000 * p99:.1f}" if gaps else "-",
            ratio, len(results) - len(done)]


def _latency_rounds(names: list[str], started: list, directory: Path, lengths: list[int], counts: list[int],
                    requests: int, max_tokens: int) -> list[list]:
    """Per server and client count: a round of the shortest prompts only, then one of the lengths mixed; the
    latency rows of both."""
    mixed = _length_prompts(directory, lengths, 8)
    short = _length_prompts(directory, [min(lengths)], 8)
    rows = []
    for clients in counts:
        for name, server in zip(names, started):
            print(f"{name}: {clients} clients, prompts of {min(lengths)} tokens, then mixed ...", file=sys.stderr)
            alone, _ = _round(server.url, clients, short, requests, max_tokens)
            gaps = [gap for r in alone if "error" not in r for gap in r["gaps"]]
            baseline = _percentile(gaps, 0.99) if gaps else None
            rows.append(_latency_row(name, clients, f"{min(lengths)} only", alone, short, baseline))
            together, _ = _round(server.url, clients, mixed, requests, max_tokens)
            rows.append(_latency_row(name, clients, " / ".join(map(str, lengths)), together, mixed, baseline))
    return rows


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
    parser.add_argument("--rounds", type=int, default=1, help="rounds per server and client count, alternating "
                        "between the servers; each row is the round of median total tok/s")
    parser.add_argument("--prompts-file", type=Path, help="one prompt per line (default: built-in code prompts)")
    parser.add_argument("--max-batch", type=int, default=1, help="the server's --max-batch (a lowering with "
                        "--kv-attention ragged decodes that many requests side by side)")
    parser.add_argument("--greedy", action="store_true", help="also the rounds against the same server decoding "
                        "greedily (--verify 0)")
    parser.add_argument("--own-drafts", action="store_true", help="with --max-batch: also the rounds against the "
                        "server drafting one request at a time (--shared-draft off)")
    parser.add_argument("--prompt-tokens", help="prompt lengths mixed in turn, e.g. 64,2048: per client count a round "
                        "of the shortest only, then one mixed, reporting time to first token per length and the "
                        "gaps between the short requests' streamed tokens (p50 / p99) against the short-only round")
    parser.add_argument("--prefill-chunk", type=int, help="the server's --prefill-chunk")
    parser.add_argument("--peers", default="", help="llama.cpp: also the rounds against llama-server")
    parser.add_argument("--llama-cpp", type=Path, help="a built llama.cpp tree (default: the cached build)")
    parser.add_argument("--llama-cpp-type", help="llama-quantize's type for llama-server instead of the one matching "
                        "ours, e.g. q4_k_m (as `bench --llama-cpp-type`)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.llama_cpp_type:
        from dflash_onnx.llama_cpp.gguf import named_precision
        from dflash_onnx.runtime.errors import DFlashError
        from dflash_onnx.runtime.manifest import load_manifest

        if "llama.cpp" not in args.peers:
            parser.error("--llama-cpp-type names the type --peers llama.cpp runs: add --peers llama.cpp")
        try:
            named_precision(load_manifest(args.directory), args.llama_cpp_type)
        except DFlashError as exc:
            parser.error(str(exc))
    prompts = args.prompts_file.read_text().splitlines() if args.prompts_file else PROMPTS
    counts = [int(k) for k in args.clients.split(",")]
    print("solo greedy outputs ...", file=sys.stderr)
    solo = _solo(args.directory, prompts, args.max_tokens)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    batching = ["--max-batch", str(args.max_batch)] if args.max_batch > 1 else []
    if args.prefill_chunk:
        batching += ["--prefill-chunk", str(args.prefill_chunk)]
    lengths = sorted({int(n) for n in args.prompt_tokens.split(",")}) if args.prompt_tokens else []
    servers = [("DFlash, verify auto", ["--verify", "auto"])]
    if args.own_drafts:
        servers.append(("DFlash, verify auto, --shared-draft off", ["--verify", "auto", "--shared-draft", "off"]))
    if args.greedy:
        servers.append(("greedy (--verify 0)", ["--verify", "0"]))
    rows, memory, started, latency = [], None, [], []
    try:
        for _, flags in servers:  # all up at once: the rounds alternate between them, so that the machine's
            # drifts fall on every server alike
            server = Server(args.directory, [*flags, *batching])
            started.append(server)
            _round(server.url, 1, prompts, 2, args.max_tokens)  # warm-up: first calls, page faults
        names = [f"dflash-onnx serve, {kind}" + (f", --max-batch {args.max_batch}" if batching else "")
                 for kind, _ in servers]
        if lengths:
            latency = _latency_rounds(names, started, args.directory, lengths, counts, args.requests,
                                      args.max_tokens)
        figures: dict[tuple[str, int], list[list]] = {}
        for clients in counts:
            for turn in range(args.rounds):
                for name, server in zip(names, started):
                    print(f"{name}: {clients} clients, round {turn + 1} of {args.rounds} ...", file=sys.stderr)
                    results, wall = _round(server.url, clients, prompts, args.requests, args.max_tokens)
                    done = [r for r in results if "error" not in r]
                    same = sum(r["text"] == solo[r["prompt"]] for r in done)
                    figures.setdefault((name, clients), []).append(_figures(clients, results, done, wall, same))
        for name in names:  # each the round of median total tok/s
            for clients in counts:
                rows.append([name, *_median_round(figures[(name, clients)])])
        if args.memory_requests:
            memory = _memory(started[0], prompts, args.memory_requests, args.max_tokens)
        if "llama.cpp" in args.peers:
            for server in started:  # their sessions' memory and threads are not llama-server's to share
                server.stop()
            rows += _llama_cpp_rows(args.directory, prompts, counts, args.requests, args.max_tokens, args.llama_cpp,
                                    args.llama_cpp_type)
    finally:
        for server in started:
            server.stop()
        for process in busy:
            process.kill()
    print(markdown_table(["server", "clients", "total tok/s", "per-request tok/s (median)", "TTFT ms (median)",
                          "latency p50 s", "latency p99 s", "errors", "identical to solo greedy"], rows))
    if lengths:
        print("\n" + markdown_table(["server", "clients", "prompt tokens", "TTFT ms p50 / p99, by length",
                                     "short requests' token gaps ms p50 / p99", "p99 vs short prompts only",
                                     "errors"], latency))
    print("\n(llama-server: its time to first token is its prefill time; outputs compared by token id, a run that "
          "stops at a stop token ours also produced there counted as ours)" if "llama.cpp" in args.peers else "")
    if memory:
        before, samples, after = memory
        print(f"\nserver RSS over {args.memory_requests} sequential requests: {before:.0f} MB before, "
              f"{', '.join(f'{s:.0f}' for s in samples)} MB along the way, {after:.0f} MB after")
    print(f"\n{provenance()} " + (f"Beside {args.load} busy process(es)." if args.load else "Quiet."))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
