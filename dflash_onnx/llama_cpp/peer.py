"""`bench --peers llama.cpp`: llama.cpp's greedy step (llama-bench), greedy decode and `draft-dflash` decode
(llama-server) on the directory's checkpoints at its precision, with the threads ours runs with."""

from __future__ import annotations

import sys
from pathlib import Path

from dflash_onnx.artifacts.model_dirs import read_config
from dflash_onnx.llama_cpp import build, gguf, runs
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest


def threads_of(manifest: Manifest) -> int:
    """The intra-op threads our target session runs with: the lowering's setting, else ONNX Runtime's default of one
    per physical core (the same count goes to llama.cpp, so both sides get the same cores)."""
    options = manifest.lowering.options if manifest.lowering else {}
    return int(options.get("intra_op_threads") or 0) or physical_cores()


def physical_cores() -> int:
    cores = set()
    try:
        block: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines() + [""]:
            if ":" in line:
                key, value = (part.strip() for part in line.split(":", 1))
                block[key] = value
            elif block:
                cores.add((block.get("physical id"), block.get("core id"), block.get("processor")
                           if "core id" not in block else None))
                block = {}
    except OSError:
        pass
    allowed = build.allowed_cpus()
    return max(1, min(len(cores) or allowed, allowed))


def llama_cpp_rows(manifest: Manifest, prompts: list[dict], max_new_tokens: int, repeats: int, target_dir: Path,
                   draft_dir: Path, llama_cpp_dir: Path | None, progress: bool, collect,
                   llama_type: str | None = None) -> list[dict]:
    """Rows as peers.run_peers makes them: llama-bench's greedy step, llama-server greedy, llama-server DFlash;
    `llama_type`: llama-quantize's type to run instead of the one matching ours (gguf.named_precision)."""
    from dflash_onnx.demo import cache_root

    try:
        llama = build.find(llama_cpp_dir) if llama_cpp_dir else build.cached(cache_root(), progress)
        tied = bool(read_config(target_dir, "target").get("tie_word_embeddings", False))
        precision = gguf.named_precision(manifest, llama_type) if llama_type else gguf.precision_for(manifest, tied)
        unsupported = unsupported_draft(manifest, target_dir)
        target, draft = gguf.ggufs(llama, target_dir, None if unsupported else draft_dir, precision, cache_root(),
                                   progress)
    except DFlashError as exc:  # our runs are measured by now: the report keeps them and says why
        return [{"name": "llama.cpp", "unavailable": str(exc)}]
    threads = threads_of(manifest)
    depth = runs.median_depth(prompts)
    label = f"{precision.weights.upper()}, {threads} threads"
    if progress:
        print(f"peers: llama.cpp {llama.version()} ({label}): llama-bench, llama-server greedy and draft-dflash ...",
              file=sys.stderr, flush=True)
    name = f"llama.cpp llama-bench tg{max_new_tokens} @ depth {depth} ({label})"
    try:
        step = runs.bench_greedy_step(llama, target, threads, max_new_tokens, depth, repeats, manifest.block_size)
        rows = [{"name": name, "tokens": None, "tokens_per_second": step["tokens_per_second"],
                 "end_to_end_tokens_per_second": None, "ttft_ms_median": None, "tau": None, "outputs": None,
                 "precision": precision.note, "verify_ratio": step["verify_ratio"],
                 "verify_rows": manifest.block_size}]
    except DFlashError as exc:
        rows = [{"name": name, "unavailable": str(exc)}]
    context = max(len(p["ids"]) for p in prompts) + max_new_tokens + manifest.block_size + 64
    for drafting in (False, True):
        kind = f"draft-dflash, {manifest.block_size - 1} proposals" if drafting else "greedy"
        name = f"llama.cpp {kind} (llama-server, {label})"
        if drafting and unsupported:
            rows.append({"name": name, "unavailable": unsupported})
            continue
        try:
            with runs.server(llama, target, threads, context, draft if drafting else None,
                             manifest.block_size - 1) as server:
                server.complete(prompts[0]["ids"], min(8, max_new_tokens))  # warm-up, as ours
                row = collect(name, prompts, repeats, lambda ids, s=server: s.complete(ids, max_new_tokens),
                              tau=drafting)
        except DFlashError as exc:
            rows.append({"name": name, "unavailable": str(exc)})
            continue
        row["precision"], row["stops_at"] = precision.note, list(manifest.stop_token_ids)
        rows.append(row)
    return rows


def unsupported_draft(manifest: Manifest, target_dir: Path) -> str | None:
    """Why llama.cpp's draft-dflash cannot run this pair, known before converting it (None: it can)."""
    if manifest.draft_kind not in ("dflash", "dflash2") or manifest.draft_layout != "zlab":
        return (f"this run covers z-lab-format DFlash and DFlash2 drafts (llama.cpp's converter takes those); this "
                f"is a {manifest.draft_layout}-format {manifest.draft_kind} draft")
    layers = int(read_config(target_dir, "target").get("num_hidden_layers", 0))
    if layers and max(manifest.target_layer_ids) >= layers - 1:
        return (f"the draft taps the target's last layer ({layers - 1}), whose output llama.cpp's graph does not "
                "expose (it taps layer inputs, up to the last layer's)")
    return None
