"""`bench --peers`: what a user would run instead, on the same checkpoints, prompts and machine.

- `hf`: Hugging Face transformers greedy `generate` (PyTorch CPU).
- `reference`: the reference `dflash` package's `dflash_generate` at block 1 (its baseline) and at the
  export's block size (PyTorch CPU), with our draft checkpoint.
- `ort-genai`: onnxruntime-genai on the target rebuilt by its model builder (cached): greedy, and its
  speculative decoding on CPU, n-gram lookup (draft-free). It cannot run our draft: its block drafters are
  DFlash 2 and DSpark checkpoints (paged attention), not DFlash.
- `llama.cpp`: llama.cpp's llama-bench (the greedy step) and llama-server (greedy, and `draft-dflash` with our draft)
  on GGUF files made by its own converter and quantized to the directory's precision (llama_cpp/).
- `mlx-lm`: mlx-lm's native model of the target and its `generate_step` (greedy, its pipelined loop), at the
  directory's precision: its dtype, and for an MLX lowering with --bits the same bits and group size
  (`nn.quantize`, as mlx-lm's own conversion quantizes).
Timing follows the reference's definitions: tokens/s = output tokens over decode time (prefill
excluded, the first token counted), TTFT = prefill. HF's TTFT is taken when its streamer receives the
first generated token.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

from dflash_onnx.artifacts.hub import checkpoints
from dflash_onnx.artifacts.model_dirs import checkpoint_stamp, read_config, weight_files
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import Manifest

PEERS = ("hf", "reference", "ort-genai", "mlx-lm", "llama.cpp")


def _hf_greedy(lm, prompts: list[dict], max_new_tokens: int, repeats: int) -> dict:
    from transformers.generation.streamers import BaseStreamer

    from dflash_onnx.exporter.models.target import hf_greedy

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first_at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call carries the prompt
                self.first_at = time.perf_counter()

        def end(self):
            pass

    def once(ids: list[int]):
        streamer = FirstToken()
        started = time.perf_counter()
        tokens = hf_greedy(lm, ids, max_new_tokens, None, streamer)
        ended = time.perf_counter()
        return tokens, streamer.first_at - started, ended - streamer.first_at

    return _collect("hf greedy (transformers, torch CPU)", prompts, repeats, once, tau=False)


def _reference(draft, lm, prompts: list[dict], max_new_tokens: int, repeats: int, block_size: int) -> dict:
    import torch
    from dflash import model as reference_model

    reference_model._cuda_time = time.perf_counter  # it synchronizes CUDA; on CPU the plain clock is right

    def once(ids: list[int]):
        tensor = torch.tensor(ids)[None]
        stats = reference_model.dflash_generate(draft, lm, tensor, max_new_tokens, None, block_size=block_size,
                                                return_stats=True)
        tokens = stats.output_ids[0, len(ids):].tolist()
        return tokens, stats.time_to_first_token, stats.time_per_output_token * stats.num_output_tokens, \
            stats.acceptance_lengths

    label = f"reference dflash_generate block {block_size} (torch CPU)"
    return _collect(label, prompts, repeats, once, tau=block_size > 1)


def genai_build(manifest: Manifest) -> tuple[str, str]:
    """The model builder's precision and execution provider that match this directory: its weight-only
    quantization (int4 against `-p int4`, int8 against `-p int8`), else its float dtype, and its provider."""
    dtype = manifest.dtype if manifest.backend != "coreml" else "float32"
    precision = manifest.weight_quantization or {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[dtype]
    provider = manifest.lowering.provider if manifest.backend == "ort" and manifest.lowering else "cpu"
    return precision, "cuda" if provider == "cuda" else "cpu"


def genai_block_size(manifest: Manifest) -> int | None:
    """The block size of the directory's int4/int8 weights, for the builder's `block_size` (None when float)."""
    quantized = [p for p in manifest.passes if p.get("name") in ("int4", "int8")]
    if not quantized:
        return None
    return int(quantized[-1].get("options", {}).get("block_size", 32))  # unrecorded: the default was 32 then


def genai_model_dir(target_dir: Path, precision: str, provider: str, block_size: int | None = None) -> Path:
    """The target rebuilt by onnxruntime-genai's model builder (int4/int8 in blocks of `block_size`, as ours), cached
    per checkpoint (path, file sizes and modification times: cheap for multi-GB weights), precision and
    provider."""
    import hashlib
    import subprocess

    from dflash_onnx.demo import cache_root

    digest = checkpoint_stamp(hashlib.sha256(), Path(target_dir))
    blocks = f"-b{block_size}" if block_size else ""
    out = cache_root() / "ort-genai" / f"{digest.hexdigest()[:12]}-{precision}-{provider}{blocks}"
    if (out / "genai_config.json").is_file():
        _keep_rewinds_resident(out / "genai_config.json")  # builds cached by an earlier version
        return out
    read_config(target_dir, "target")  # the builder loads the checkpoint: no custom code, no pickle
    weight_files(target_dir, "target")
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target_dir), "-o", str(out),
               "-p", precision, "-e", provider, "-c", str(out.parent / "build-cache")]
    if block_size:
        command += ["--extra_options", f"block_size={block_size}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not (out / "genai_config.json").is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise DFlashError(f"onnxruntime-genai's model builder cannot build {target_dir}: {last[0]}")
    _drop_out_of_vocab_eos(out / "genai_config.json")
    _keep_rewinds_resident(out / "genai_config.json")
    return out


def _drop_out_of_vocab_eos(path: Path) -> None:
    """The builder can add eos ids past the vocabulary (tokenizers without the specials it looks for), which
    the runtime then refuses; runs here generate a fixed number of tokens, so only valid ids are kept."""
    import json

    config = json.loads(path.read_text())
    model = config["model"]
    eos = model["eos_token_id"] if isinstance(model["eos_token_id"], list) else [model["eos_token_id"]]
    valid = [i for i in eos if 0 <= i < model["vocab_size"]] or [0]
    if valid != eos:
        model["eos_token_id"] = valid if len(valid) > 1 else valid[0]
        path.write_text(json.dumps(config, indent=4))


def _keep_rewinds_resident(path: Path) -> None:
    """A sliding-window cache that keeps every position of the context resident (the window still masks), so the
    n-gram speculative run can rewind over the drafted tokens it rejects: the builder writes a slack of 0, with
    which the runtime refuses those rewinds once the cache has slid (it names this setting)."""
    import json

    config = json.loads(path.read_text())
    window = config["model"]["decoder"].get("sliding_window")
    context = int(config["model"].get("context_length") or config.get("search", {}).get("max_length") or 0)
    if window is not None and int(window.get("cache_slack", 0)) < context:
        window["cache_slack"] = context
        path.write_text(json.dumps(config, indent=4))


def _genai(model, build: tuple[str, ...], prompts: list[dict], max_new_tokens: int, repeats: int,
           speculative: dict | None) -> dict:
    import onnxruntime_genai as og

    def once(ids: list[int]):
        try:
            return generated(ids)
        except RuntimeError as exc:  # ORT's status from inside the generator: one line, and whose model it was
            raise DFlashError(f"onnxruntime-genai failed on its {' '.join(build)} build of the target: "
                              f"{str(exc).splitlines()[0][:300]}") from None

    def generated(ids: list[int]):
        params = og.GeneratorParams(model)
        # no min_length: it masks end-of-generation until then, so a run where ours emits it would leave ours there
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        if speculative:
            params.set_speculative_options(**speculative)
        generator = og.Generator(model, params)
        started = time.perf_counter()
        generator.append_tokens(ids)
        tokens, first_at = [], None
        while not generator.is_done():
            generator.generate_next_token()
            tokens.extend(int(t) for t in generator.get_next_tokens())
            first_at = first_at or time.perf_counter()
        ended = time.perf_counter()
        stats = generator.get_speculative_stats() if speculative else {}
        return tokens, first_at - started, ended - first_at, [stats.get("mean_emitted_tokens_per_round", 0.0)]

    if speculative:
        label = (f"ort-genai n-gram speculative ({' '.join(build)}, n={speculative['ngram_size']}, "
                 f"k={speculative['max_draft_tokens']})")
    else:
        label = f"ort-genai greedy ({' '.join(build)}; C++ loop, its own graph)"
    return _collect(label, prompts, repeats, once, tau=bool(speculative))


def mlx_lm_model(target_dir: Path):
    """mlx-lm's native model of a target checkpoint (its own loader; rope_theta given where transformers 5 nests it
    in rope_parameters and mlx-lm reads it at the top of the config)."""
    import json

    from mlx_lm.utils import load_model

    config = json.loads((Path(target_dir) / "config.json").read_text())
    theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    model, _ = load_model(Path(target_dir), model_config={"rope_theta": theta} if theta else {})
    return model


def _mlx_lm(target_dir: Path, manifest: Manifest, prompts: list[dict], max_new_tokens: int, repeats: int) -> dict:
    import mlx.core as mx
    import mlx.nn as nn

    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    model = mlx_lm_model(target_dir)
    model.set_dtype({"float16": mx.float16, "bfloat16": mx.bfloat16}.get(manifest.dtype, mx.float32))
    options = manifest.lowering.options if manifest.backend == "mlx" else {}
    precision = manifest.dtype
    if options.get("bits"):
        nn.quantize(model, group_size=options["group_size"], bits=options["bits"])
        precision = f"{options['bits']}-bit, group {options['group_size']}"

    def once(ids: list[int]):
        tokens, started, first_at = [], time.perf_counter(), None
        for token, _ in generate_step(mx.array(ids), model, max_tokens=max_new_tokens):
            tokens.append(int(token))
            first_at = first_at or time.perf_counter()
        return tokens, first_at - started, time.perf_counter() - first_at

    return _collect(f"mlx-lm greedy ({precision}; its own model and generate_step)", prompts, repeats, once,
                    tau=False)


def _collect(name: str, prompts: list[dict], repeats: int, once, tau: bool) -> dict:
    """Runs `once(ids) -> (tokens, ttft_s, decode_s[, acceptance lengths])` per prompt, medians of timings."""
    tokens, decode_s, ttft_s, lengths, outputs = 0, 0.0, [], [], []
    for prompt in prompts:
        runs = [once(prompt["ids"]) for _ in range(repeats)]
        outputs.append(runs[0][0])
        tokens += len(runs[0][0])
        decode_s += float(np.median([r[2] for r in runs]))
        ttft_s.append(float(np.median([r[1] for r in runs])))
        if tau:
            lengths += runs[0][3]
    return {"name": name, "tokens": tokens, "tokens_per_second": tokens / decode_s,
            "end_to_end_tokens_per_second": tokens / (decode_s + sum(ttft_s)),
            "ttft_ms_median": 1000 * float(np.median(ttft_s)),
            "tau": float(np.mean(lengths)) if lengths else None, "outputs": outputs}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def check_peer_names(names: list[str]) -> None:
    """Refuse unknown peers, and torch peers where torch is missing, before anything is measured."""
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise DFlashError(f"unknown peers {unknown}: choose from {', '.join(PEERS)}")
    torch_peers = sorted({"hf", "reference"} & set(names))
    if torch_peers and not (_installed("torch") and _installed("transformers")):
        raise DFlashError(f"peers {', '.join(torch_peers)} run PyTorch and transformers, which are not installed: "
                          "pip install torch==2.13.0 && pip install 'dflash-onnx[export]'")


def run_peers(manifest: Manifest, prompts: list[dict], options, names: list[str], target_dir: Path | None,
              draft_dir: Path | None, ours: dict, our_tokens: list[list[int]], progress: bool = True) -> dict:
    """Each named peer's aggregate figures, ours beside them, and the ratios the bench reports."""
    from dflash_onnx.exporter.pair import load_reference_draft, load_target

    check_peer_names(names)
    lossy = [p["name"] for p in manifest.passes if p.get("lossy")]
    if lossy:  # exact passes and lowerings compute the same model; a quantized one does not
        print(f"note: peers run the original checkpoints; this directory's target is transformed by {lossy}, "
              "so its tokens may differ from theirs", file=sys.stderr)
    target_dir, draft_dir = checkpoints(manifest, target_dir, draft_dir)
    dtype = manifest.dtype if manifest.backend != "coreml" else "float32"
    lm = load_target(target_dir, dtype) if {"hf", "reference"} & set(names) else None
    rows = []
    if "hf" in names:
        if progress:
            print("peers: hf greedy ...", file=sys.stderr, flush=True)
        rows.append(_hf_greedy(lm, prompts, options.max_new_tokens, options.repeats))
    if "reference" in names:
        draft = load_reference_draft(draft_dir, dtype)
        if draft is None:
            why = (f"this is a {manifest.draft_kind} draft in the speculators format" if
                   manifest.draft_layout != "zlab" else "it is not installed")
            raise DFlashError("peer 'reference' runs z-lab's DFlash and DFlash2 drafts with the reference package "
                              f"(pip install --no-deps dflash==0.1.0): {why}")
        for block in (1, manifest.block_size):
            if progress:
                print(f"peers: reference block {block} ...", file=sys.stderr, flush=True)
            rows.append(_reference(draft, lm, prompts, options.max_new_tokens, options.repeats, block))
    if "ort-genai" in names:
        try:
            import onnxruntime_genai as og
        except ImportError:
            raise DFlashError("peer 'ort-genai' needs onnxruntime-genai: pip install onnxruntime-genai") from None
        build, block = genai_build(manifest), genai_block_size(manifest)
        label = (*build, f"block {block}") if block else build
        if progress:
            print(f"peers: ort-genai (model builder {' '.join(label)}, then greedy and n-gram speculative) ...",
                  file=sys.stderr, flush=True)
        model = og.Model(str(genai_model_dir(Path(target_dir), *build, block)))
        speculative = {"ngram_size": 3, "max_draft_tokens": min(16, manifest.block_size)}
        for run in (None, speculative):  # each stops at end-of-generation, where ours runs on
            rows.append({**_genai(model, label, prompts, options.max_new_tokens, options.repeats, run),
                         "stops_at": list(manifest.stop_token_ids)})
    if "mlx-lm" in names:
        if not _installed("mlx_lm"):
            raise DFlashError("peer 'mlx-lm' needs mlx-lm: pip install mlx-lm")
        if progress:
            print("peers: mlx-lm greedy ...", file=sys.stderr, flush=True)
        rows.append(_mlx_lm(Path(target_dir), manifest, prompts, options.max_new_tokens, options.repeats))
    if "llama.cpp" in names:
        from dflash_onnx.llama_cpp.peer import llama_cpp_rows

        rows += llama_cpp_rows(manifest, prompts, options.max_new_tokens, options.repeats, Path(target_dir),
                               Path(draft_dir), options.llama_cpp, progress, _collect, options.llama_cpp_type)
    for row in rows:  # every peer decodes greedily (or losslessly): its tokens must be ours
        outputs = row.pop("outputs", None)
        row["identical_to_ours"] = None if outputs is None else same_tokens(outputs, our_tokens, row.get("stops_at"))
    return {"rows": rows, "ratios": _ratios(rows, ours)}


def same_tokens(theirs: list[list[int]], ours: list[list[int]], stops_at: list[int] | None) -> bool:
    """Each prompt's tokens equal; a peer that stops at end-of-generation (`stops_at`, where ours runs on) may end
    early, right after a stop token that ours produced at the same place."""
    if stops_at is None:
        return theirs == ours
    for got, want in zip(theirs, ours):
        if want[:len(got)] != got:
            return False
        if len(got) < len(want) and not (got and got[-1] in stops_at) and want[len(got)] not in stops_at:
            return False
    return len(theirs) == len(ours)


def _ratios(rows: list[dict], ours: dict) -> dict:
    ratios = {}
    for row in rows:
        if "unavailable" in row:
            continue
        if row["name"].startswith("ort-genai"):
            kind = "greedy" if "greedy" in row["name"] else "speculative"
            theirs = row["tokens_per_second"]
            ratios[f"ours dflash / ort-genai {kind}"] = ours["dflash"]["tokens_per_second"] / theirs
            if kind == "greedy":
                ratios["ours greedy / ort-genai greedy"] = ours["greedy"]["tokens_per_second"] / theirs
        elif row["name"].startswith("hf greedy"):
            ratios["ours greedy / hf greedy"] = ours["greedy"]["tokens_per_second"] / row["tokens_per_second"]
            ratios["ours dflash / hf greedy"] = ours["dflash"]["tokens_per_second"] / row["tokens_per_second"]
        elif row["name"].startswith("mlx-lm greedy"):
            ratios["ours greedy / mlx-lm greedy"] = ours["greedy"]["tokens_per_second"] / row["tokens_per_second"]
            ratios["ours dflash / mlx-lm greedy"] = ours["dflash"]["tokens_per_second"] / row["tokens_per_second"]
        elif row["name"].startswith("llama.cpp"):
            mode = "dflash" if "draft-dflash" in row["name"] else "greedy"
            kind = "llama-bench tg" if "llama-bench" in row["name"] else f"llama.cpp {mode}"
            ratios[f"ours {mode} / {kind}"] = ours[mode]["tokens_per_second"] / row["tokens_per_second"]
        elif row["tau"] is None:
            ratios["ours greedy / reference block 1"] = ours["greedy"]["tokens_per_second"] / row["tokens_per_second"]
        else:
            ratios["ours dflash / reference dflash"] = ours["dflash"]["tokens_per_second"] / row["tokens_per_second"]
            ratios["reference tau"] = row["tau"]
    return ratios


def format_peers(peers: dict) -> str:
    lines = [f"{'peer':<52} {'tok/s':>9} {'e2e tok/s':>10} {'ttft ms':>8} {'tau':>6} {'same tokens':>11}"]
    notes = []
    for row in peers["rows"]:
        if "unavailable" in row:
            lines.append(f"{row['name']:<52} unavailable: {row['unavailable']}")
            continue
        tau = f"{row['tau']:.2f}" if row["tau"] is not None else "-"
        e2e, ttft = row["end_to_end_tokens_per_second"], row["ttft_ms_median"]
        same = "-" if row["identical_to_ours"] is None else str(row["identical_to_ours"])
        lines.append(f"{row['name']:<52} {row['tokens_per_second']:>9.1f} {_or_dash(e2e, 10)} {_or_dash(ttft, 8)} "
                     f"{tau:>6} {same:>11}")
        if row.get("precision") and row["precision"] not in notes:
            notes.append(row["precision"])
        if row.get("verify_ratio"):
            notes.append(f"llama.cpp's batch of {row['verify_rows']} tokens costs {row['verify_ratio']:.2f}x its "
                         "one-token step at that depth (llama-bench pp/tg): the verify cost its DFlash pays")
    lines += [f"{name}: {value:.2f}{'' if name.endswith('tau') else 'x'}" for name, value in peers["ratios"].items()]
    lines += [f"{'' if note.startswith('llama.cpp') else 'precision: '}{note}" for note in notes]
    return "\n".join(lines)


def _or_dash(value: float | None, width: int) -> str:
    return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"
