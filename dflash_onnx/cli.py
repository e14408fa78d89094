"""`dflash-onnx`: one function per subcommand; user errors print one line and exit 2."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
import time
import warnings
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError

_DEFAULT_ONLY = "<default only>"  # the help of a flag that has none of its own: its default is shown


def _has_default(value) -> bool:
    """A default worth showing: not unset, not a switch's False, not an empty list (0 is one)."""
    return not (value is None or value is False or value is argparse.SUPPRESS or value == [])


class _ShowDefaults(argparse.HelpFormatter):
    """Every flag's default in --help, unless its help already says it (argparse's own formatter for this adds it
    only where a flag has help text, and twice where the text names the default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = "" if action.help == _DEFAULT_ONLY else (action.help or "").strip()
        shown = _has_default(action.default) and action.option_strings
        if shown and "default" not in text.lower():
            text = f"{text} (default: %(default)s)".strip()
        return text


class Parser(argparse.ArgumentParser):
    """argparse with manners: a usage error is one line and where to read more, not the whole usage; defaults
    shown in every command's help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _ShowDefaults)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        if kwargs.get("help") is None and _has_default(kwargs.get("default")):
            kwargs["help"] = _DEFAULT_ONLY
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    """This package's version and the runtime's, as a bug report needs them."""
    import importlib.metadata
    import platform

    parts = [f"dflash-onnx {importlib.metadata.version('dflash-onnx')}"]
    try:
        parts.append(f"onnxruntime {importlib.metadata.version('onnxruntime')}")
    except importlib.metadata.PackageNotFoundError:
        parts.append("onnxruntime not installed")
    return f"{parts[0]} ({', '.join(parts[1:])}, Python {platform.python_version()})"


def add_revision_arguments(parser: argparse.ArgumentParser, draft: bool = True, recorded: bool = False) -> None:
    """--revision (and --draft-revision): the hub revision of a checkpoint given by hub name."""
    default = "default: the one recorded at export, else main" if recorded else "default: main"
    parser.add_argument("--revision", help=f"hub branch, tag or commit of a target given by hub name ({default})")
    if draft:
        parser.add_argument("--draft-revision", help=f"hub branch, tag or commit of a draft given by hub name "
                            f"({default})")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-onnx export`, shared with `optimum-cli export dflash`."""
    parser.add_argument("--target", help="Hugging Face target model directory, or a hub name (org/name) fetched "
                        "into the hub cache (default: the target the draft names: a speculators draft's verifier, a "
                        "published z-lab draft's pair)")
    parser.add_argument("--draft", required=True,
                        help="DFlash, DFlash2 or DSpark draft directory (config.json in z-lab's or the speculators "
                             "layout + safetensors), a hub name, or auto: the published draft of --target")
    add_revision_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="output directory (created atomically)")
    parser.add_argument("--block-size", type=int, help="draft block size (default: the draft's trained one)")
    parser.add_argument("--allow-longer-block", action="store_true", help="allow a block above the trained size")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset, 18..23 (default 18)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="load the whole pair in memory instead of tracing it without weights and writing each "
                             "weight from the checkpoints (the default: peak memory about one tensor)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--passes", help="graph passes to apply right after export, e.g. cleanup,int4")
    parser.add_argument("--pass-option", action="append", default=[], metavar="[PASS.]KEY=VALUE")


def run_export(args) -> int:
    from dflash_onnx.artifacts.hub import resolve_pair
    from dflash_onnx.exporter.export_request import check_export_request

    args.target, args.draft = resolve_pair(args.target, args.draft, getattr(args, "revision", None),
                                           getattr(args, "draft_revision", None), progress=not args.quiet)
    check_export_request(Path(args.target), Path(args.draft), Path(args.out), args.opset, args.overwrite,
                         args.block_size)
    from dflash_onnx.artifacts.publish import lock_out, scratch_directory
    from dflash_onnx.exporter.export import export_pair

    passes = [n.strip() for n in (getattr(args, "passes", None) or "").split(",") if n.strip()]
    if not passes:
        manifest = export_pair(
            args.target, args.draft, args.out, block_size=args.block_size, dtype=args.dtype, opset=args.opset,
            allow_longer_block=args.allow_longer_block, overwrite=args.overwrite, progress=not args.quiet,
            stream=getattr(args, "stream", True),
        )
    else:
        from dflash_onnx.passes.pipeline import apply_pipeline, parse_pass_options

        with lock_out(Path(args.out)), scratch_directory(Path(args.out)) as raw:  # OUT is ours for the whole run
            exported = export_pair(args.target, args.draft, raw / "raw", block_size=args.block_size,
                                   dtype=args.dtype, opset=args.opset, allow_longer_block=args.allow_longer_block,
                                   progress=not args.quiet, stream=getattr(args, "stream", True))
            manifest, _ = apply_pipeline(raw / "raw", passes, args.out, parse_pass_options(args.pass_option),
                                         overwrite=args.overwrite, progress=not args.quiet, manifest=exported,
                                         open_graph=_on_ort(raw / "raw", exported))
    sizes = {p.name: p.stat().st_size for p in Path(args.out).iterdir() if p.suffix in (".onnx", ".data")}
    print(f"exported to {args.out}: block size {manifest.block_size}, dtype {manifest.dtype}, opset {manifest.opset}")
    for name, size in sorted(sizes.items()):
        print(f"  {name:<22} {size / 2**20:10.2f} MiB")
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise DFlashError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _cost_model(args, manifest):
    """--cost-model FILE: a cost curve measured elsewhere, replayed instead of the directory's."""
    if args.cost_model is None:
        return None
    from dflash_onnx.runtime.costs import read_costs

    return read_costs(args.cost_model, manifest.verify_rows)


def _generate(args) -> int:
    from dflash_onnx.runtime.decode import check_max_new_tokens
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.runtime.policy import parse_verify
    from dflash_onnx.runtime.results import run_summary
    from dflash_onnx.runtime.sampling import SamplingParams
    from dflash_onnx.runtime.tokenizer import TextCodec, TextStream, has_tokenizer
    from dflash_onnx.targets import open_decoder

    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")
        except UnicodeEncodeError:  # undecodable bytes on the command line arrive as lone surrogates
            raise DFlashError("--prompt is not valid UTF-8 text: pass UTF-8, or --prompt-ids") from None
    verify = parse_verify(args.verify)
    # the flags are checked before the sessions open (seconds at scale): a typo fails at once
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    check_max_new_tokens(args.max_new_tokens)
    prompt = _parse_ids(args.prompt_ids) if args.prompt is None else None
    # a curve given for the run is weighed as given, not corrected by this machine's steps
    costs = _cost_model(args, load_manifest(args.source)) if args.cost_model else None
    opening = _opening_note(Path(args.source)) if not args.json else None
    if opening:
        print(opening, end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    decoder = open_decoder(args.source, backend=args.backend, batch_invariant=args.batch_invariant == "on",
                           guess_padding=args.lookup_guess == "on", costs=costs, **_session_overrides(args))
    if opening:
        print(f" {time.perf_counter() - started:.1f} s", file=sys.stderr)
    codec = TextCodec(args.source) if (args.prompt is not None or has_tokenizer(args.source)) else None
    if prompt is None:
        prompt = codec.prompt_ids(args.prompt, raw=args.raw)
        if not args.json:  # once, so that nobody wonders what the model was sent
            print(f"(prompt sent {codec.prompt_form(args.raw)})", file=sys.stderr)
    decoder.check(prompt, args.max_new_tokens, args.mode, sampling)  # a bad request: its one line, nothing before
    if args.mode == "dflash" and verify == "auto" and decoder.costs is None and not args.json:
        print(f"(no cost curve recorded in {args.source}: --verify auto verifies full blocks, as the reference does, "
              f"even where they lose to greedy; 'dflash-onnx calibrate {args.source}' measures one here)",
              file=sys.stderr)
    stream = TextStream(codec) if codec is not None else None

    def show(chunk: list[int]) -> None:
        if args.json:
            return
        if stream is None:
            print(" ".join(map(str, chunk)), end=" ", flush=True)
        else:
            print(stream.delta(chunk), end="", flush=True)

    result = decoder.generate(prompt, args.max_new_tokens, args.mode, sampling, on_tokens=show, verify=verify)
    block = decoder.manifest.verify_rows if args.mode == "dflash" else 1
    if args.json:
        payload = {
            "tokens": result.tokens, "prompt_tokens": result.prompt_tokens, "mode": args.mode,
            "acceptance_lengths": result.acceptance_lengths, "tau": result.tau,
            "acceptance_histogram": result.acceptance_histogram(block),
            "tokens_per_second": result.tokens_per_second,
            "end_to_end_tokens_per_second": result.end_to_end_tokens_per_second,
            "ttft_s": result.ttft_s, "decode_s": result.decode_s, "stopped": result.stopped,
            "verified": result.verified, "curve_check": decoder.curve_check(result),
        }
        if codec is not None:
            payload["text"] = codec.decode(result.tokens)
        print(json.dumps(payload))
    else:
        print()
        print(f"[{run_summary(result, args.mode)}]", file=sys.stderr)
        warning = decoder.curve_check(result)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
    return 0


# graphs this large take seconds to open (ONNX Runtime's session set-up grows with the weights): say so first
SLOW_OPEN_BYTES = 64 << 20


def _opening_note(directory: Path) -> str | None:
    """'opening DIR (N MiB of graphs) ...' where opening will take long enough for a silent wait to puzzle."""
    size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file() and ".onnx" in p.name) \
        if directory.is_dir() else 0
    return f"opening {directory} ({size / 2**20:.0f} MiB of graphs) ..." if size >= SLOW_OPEN_BYTES else None


def _lower(args) -> int:
    from dflash_onnx.targets import BACKENDS, LowerRequest, get_backend

    backend = get_backend(args.backend)
    given = {}  # flags on the command line: values other than argparse's None (a switch: set)
    for flag in (flag for b in BACKENDS.values() for flag in b.flags):
        value = getattr(args, flag.dest)
        if value is not None and value is not False:
            given[flag.name] = value
    foreign = sorted(set(given) - {flag.name for flag in backend.flags})
    if foreign:
        owners = {f: [b.name for b in BACKENDS.values() if f in {flag.name for flag in b.flags}] for f in foreign}
        raise DFlashError("; ".join(f"{f} is an option of --target {'/'.join(owners[f])}" for f in foreign)
                          + f", not of --target {backend.name}")
    if not backend.reexports and (args.target_dir or args.draft_dir):
        raise DFlashError(f"--target-dir and --draft-dir are for lowerings that convert the checkpoints again "
                          f"(ai100, coreml); --target {backend.name} reads only the export")
    request = LowerRequest(overwrite=args.overwrite, progress=not args.quiet, target_dir=args.target_dir,
                           draft_dir=args.draft_dir)
    manifest = backend.lower(args.source, args.out, backend.options(given), request)
    print(backend.summary(manifest, args.out))
    return 0


def _on_ort(directory: Path, manifest):
    """How the passes open an export's graphs to record calibration inputs: on ONNX Runtime, via the registry."""
    from dflash_onnx.targets import open_session

    return lambda graph: open_session(directory, manifest, graph, "ort")


def _optimize(args) -> int:
    from dflash_onnx.passes.pipeline import apply_pipeline, parse_pass_options
    from dflash_onnx.runtime.manifest import load_export

    names = [n.strip() for n in args.passes.split(",") if n.strip()]
    export = load_export(Path(args.source), "run passes on")
    manifest, report = apply_pipeline(args.source, names, args.out, parse_pass_options(args.pass_option),
                                      overwrite=args.overwrite, progress=not args.quiet, manifest=export,
                                      open_graph=_on_ort(Path(args.source), export))
    from dflash_onnx.artifacts.graph_files import graph_bytes

    print(f"{'graph':<7} {'nodes':>15}  {'MiB on disk':>19}")
    for graph in ("target", "draft"):  # each graph's own files as written (the export lists the same)
        rows = [row for row in report if row["graph"] == graph]
        before = graph_bytes(Path(args.source), getattr(export, graph).file) / 2**20
        after = graph_bytes(Path(args.out), getattr(manifest, graph).file) / 2**20
        print(f"{graph:<7} {rows[0]['nodes_before']:>6} -> {rows[-1]['nodes_after']:<6}  {before:8.2f} -> {after:.2f}")
    print(f"wrote {args.out} (passes: {', '.join(p['name'] for p in manifest.passes)}; each pass's figures in "
          "passes_report.json)")
    return 0


def _steps(args) -> int:
    from dflash_onnx.steps import markdown, measure, table

    if args.repeats < 1 or args.context < 0:
        raise DFlashError(f"--repeats must be at least 1 and --context at least 0, got {args.repeats} and "
                          f"{args.context}")

    rows = measure(args.dirs, context=args.context, repeats=args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown(rows, args.command_line) if args.markdown else table(rows))
    return 0


def _calibrate(args) -> int:
    from dflash_onnx.artifacts.publish import lock_out
    from dflash_onnx.runtime.costs import deepest, depth_contexts, measure_costs, read_costs
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.targets import backend_for, open_session, record_row_multiple

    if args.repeats < 1 or args.context < 0:
        raise DFlashError(f"--repeats must be at least 1 and --context at least 0, got {args.repeats} and "
                          f"{args.context}")
    with lock_out(args.source):
        manifest = load_manifest(args.source)
        if args.from_file is not None:
            costs = read_costs(args.from_file, manifest.verify_rows)
        else:
            backend = backend_for(args.source, manifest, args.backend).name
            if manifest.lowering is not None and manifest.lowering.backend == backend in ("ort", "mlx"):
                # as the lowering measures it, on its own backend
                record_row_multiple(manifest, open_session(args.source, manifest, "target", backend))
                print(f"row multiple {manifest.lowering.row_multiple} recorded (batch-invariant: "
                      f"{'yes' if manifest.lowering.report['batch_invariance']['invariant'] else 'no'})")
            depths = depth_contexts(manifest, args.context) if args.depths == "auto" else _depths(args.depths)
            if depths and (depths[0] <= args.context or depths[-1] > deepest(manifest)):
                raise DFlashError(f"--depths {args.depths}: each must lie past --context {args.context} and within "
                                  f"{deepest(manifest)} tokens (what {args.source} holds beside a block and a draft "
                                  "block)")
            costs = measure_costs(manifest, lambda graph: open_session(args.source, manifest, graph, backend),
                                  context=args.context, repeats=args.repeats, source="calibrate", depths=depths)
        manifest.costs = costs
        manifest.save(args.source)
    print(f"recorded in {args.source}/dflash.json: t(T) ms for T = 1..{len(costs.verify_ms)} "
          + " ".join(f"{t:.3g}" for t in costs.verify_ms) + f"; draft {costs.draft_ms:.3g} ms "
          f"(context {costs.context}, {costs.source})")
    for curve in costs.deeper:
        print(f"  at context {curve['context']}: " + " ".join(f"{t:.3g}" for t in curve["verify_ms"])
              + f"; draft {curve['draft_ms']:.3g} ms")
    return 0


def _depths(text: str) -> list[int]:
    """`calibrate --depths`: none, or contexts deeper than --context, rising, comma-separated."""
    if text == "none":
        return []
    try:
        depths = [int(part) for part in text.split(",")]
    except ValueError:
        depths = []
    if not depths or any(b <= a for a, b in zip(depths, depths[1:])):
        raise DFlashError(f"--depths {text}: give auto, none, or rising contexts such as 1024,4096")
    return depths


def _checkpoints(args) -> tuple:
    """parity's and bench's --target/--draft, hub names resolved (at --revision / --draft-revision)."""
    if not any((args.target, args.draft, args.revision, args.draft_revision)):
        return args.target, args.draft  # the ones recorded at export, found by the command itself
    from dflash_onnx.artifacts.hub import checkpoints
    from dflash_onnx.runtime.manifest import load_manifest

    return checkpoints(load_manifest(args.source), args.target, args.draft, args.revision, args.draft_revision)


def _parity(args) -> int:
    from dflash_onnx.parity import run_parity

    args.target, args.draft = _checkpoints(args)
    report = run_parity(args.source, args.target, args.draft, num_prompts=args.prompts,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 0 if report.ok else 1


def _distill(args) -> int:
    from dflash_onnx.training.distill import DistillOptions, distill

    tapped = None if args.target_layers_tapped == "auto" else [int(i) for i in args.target_layers_tapped.split(",")]
    options = DistillOptions(block_size=args.block_size, draft_layers=args.draft_layers, target_layer_ids=tapped,
                             steps=args.steps, time_budget_min=args.time_budget, seed=args.seed, lr=args.lr,
                             num_prompts=args.num_prompts, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, draft_type=args.draft_type,
                             conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                             selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                             markov_rank=args.markov_rank, markov_head_type=args.markov_head,
                             confidence_target=args.confidence_target)
    report = distill(args.target, args.out, options, data_paths=args.data, prompts_file=args.prompts,
                     resume=args.resume, progress=not args.quiet, revision=args.revision)
    print(f"wrote {args.out} ({args.draft_type}): {report['steps']} steps in {report['seconds']} s; held-out tau "
          f"{report['tau_before']:.2f} -> {report['tau_after']:.2f} (block {args.block_size})")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise DFlashError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise DFlashError(f"{flag} must list positive integers, got {text!r}")
    return values


def _bench(args) -> int:
    from dflash_onnx.bench import BenchOptions, bench_figures, depth_figures, format_report, run_bench
    from dflash_onnx.figures import render
    from dflash_onnx.runtime.manifest import load_manifest
    from dflash_onnx.runtime.policy import parse_verify

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--repeats", args.repeats),
                        ("--num-prompts", args.num_prompts), ("--curve-repeats", args.curve_repeats)):
        if value < 1:
            raise DFlashError(f"{flag} must be at least 1, got {value}")
    if args.load < 0:
        raise DFlashError(f"--load takes a count of busy processes (0: none), got {args.load}")
    options = BenchOptions(
        max_new_tokens=args.max_new_tokens, repeats=args.repeats, num_prompts=args.num_prompts,
        verify_lengths=_int_list(args.block_sizes, "--block-sizes") if args.block_sizes else None,
        contexts=_int_list(args.contexts, "--contexts") if args.contexts else None, curve_repeats=args.curve_repeats,
        prompt_tokens=_int_list(args.prompt_tokens, "--prompt-tokens") if args.prompt_tokens else None,
        verify=parse_verify(args.verify), load=args.load, batch_invariant=args.batch_invariant == "on",
        lookup_guess=args.lookup_guess == "on",
        session_overrides=_session_overrides(args), llama_cpp=args.llama_cpp, llama_cpp_type=args.llama_cpp_type)
    peers = [p.strip() for p in (args.peers or "").split(",") if p.strip()]
    if peers:  # the checkpoints the peers run, hub names resolved
        args.target, args.draft = _checkpoints(args)
    costs = _cost_model(args, load_manifest(args.source)) if args.cost_model else None
    report = run_bench(args.source, args.backend, args.prompts, options, peers, (args.target, args.draft),
                       progress=not args.quiet, costs=costs)
    print(format_report(report))
    record = bench_figures(report, args.command_line)
    depths = {"depth_figures": depth_figures(report, args.command_line)} if report.get("depths") else {}
    if args.markdown:
        print(f"\n{render(record)}" + "".join(f"\n\n{render(table)}" for table in depths.values()))
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "figures": record, **depths}, indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        from dflash_onnx.bench_plot import plot_report

        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    identical = report["aggregate"]["all_identical_to_greedy"]
    return 0 if identical and report.get("loaded", {}).get("aggregate", {}).get("all_identical_to_greedy", True) else 1


def _session_overrides(args) -> dict:
    """Session options given on the command line (a backend whose sessions take none refuses them)."""
    return {"compute_units": args.compute_units} if args.compute_units else {}


def _serve(args) -> int:
    from dflash_onnx.runtime.sampling import SamplingParams

    try:
        from dflash_onnx.serving.app import ServerOptions, create_app
        from dflash_onnx.serving.host import EngineSettings
        from dflash_onnx.serving.server import listen, run, url
    except ModuleNotFoundError as exc:
        raise DFlashError(f"serve needs {exc.name}, which is not installed: pip install 'dflash-onnx[serve]'") from None

    if not 0 <= args.port <= 65535:
        raise DFlashError(f"--port must lie in 0..65535, got {args.port}")
    for flag, value in (("--max-tokens", args.max_tokens), ("--max-body-bytes", args.max_body_bytes)):
        if value < 1:
            raise DFlashError(f"{flag} must be at least 1, got {value}")
    if not args.shutdown_grace >= 0:
        raise DFlashError(f"--shutdown-grace must be at least 0, got {args.shutdown_grace:g}")
    SamplingParams(args.temperature)  # the flags are checked before the sessions open
    settings = EngineSettings(args.source, backend=args.backend, max_batch=args.max_batch,
                              shared_draft=args.shared_draft == "on", max_queue=args.max_queue, verify=args.verify,
                              max_prompt_tokens=args.max_prompt_tokens, prefill_chunk=args.prefill_chunk,
                              batch_invariant=args.batch_invariant == "on", lookup_guess=args.lookup_guess == "on",
                              cost_model=args.cost_model,
                              session_options=_session_overrides(args))
    settings.check()
    listening = listen(args.host, args.port)  # a taken port is refused here, before the sessions open
    try:
        engine = settings.open()
    except BaseException:
        listening.close()
        raise
    options = ServerOptions(model=args.model or args.source.resolve().name, api_key=args.api_key,
                            max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens,
                            temperature=args.temperature,
                            access_log=None if args.log_format == "off" else args.log_format)
    running = "one request at a time" if args.max_batch == 1 else \
        f"up to {args.max_batch} requests side by side, {engine.drafting}"
    print(f"serving {options.model} from {args.source} on {url(listening)}/v1 (DFlash, verify "
          f"{args.verify}; {running}, {args.max_queue} may wait)", file=sys.stderr, flush=True)
    print(run(create_app(engine, options), listening, engine, args.shutdown_grace), file=sys.stderr)
    return 0


def _demo(args) -> int:
    from dflash_onnx.demo import run_demo

    if args.rounds < 1:
        raise DFlashError(f"--rounds must be at least 1, got {args.rounds}")
    return run_demo(as_json=args.json, max_new_tokens=args.max_new_tokens, num_prompts=args.prompts,
                    rounds=args.rounds)


def _add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verify", default="auto", metavar="auto|full|N",
                        help="drafted tokens each DFlash step verifies: auto (chosen per step from the draft's "
                             "confidence and the directory's cost curve; full when none is recorded), full (the "
                             "whole block), or N")
    parser.add_argument("--batch-invariant", choices=("on", "off"), default="on",
                        help="pad the target's calls to the row multiple the lowering measured, so a token's logits "
                             "do not depend on its call's size and greedy and DFlash give identical tokens (on, "
                             "default); off: greedy steps run one row (faster; tokens may differ where the top two "
                             "logits nearly tie)")
    parser.add_argument("--lookup-guess", choices=("on", "off"), default="on",
                        help="where calls are padded to 2 rows, a greedy step that verifies only its last token "
                             "carries a prompt-lookup guess of the next token in the padding row it pays for anyway "
                             "(verified: tokens unchanged; a right guess commits two tokens); off: a plain padding "
                             "row (default on; never on mixture-of-experts targets or when sampling)")
    parser.add_argument("--cost-model", type=Path, metavar="FILE",
                        help="a cost curve to use instead of the recorded one: JSON with verify_ms (t(1)..t(B)) "
                             "and draft_ms, e.g. measured on another machine; weighed as given (the policy then does "
                             "not correct it by the step times it measures here)")
    parser.add_argument("--compute-units", choices=("all", "cpu_and_ne", "cpu_and_gpu", "cpu_only"),
                        help="coreml: where CoreML may run the packages (default: as lowered): all (it chooses "
                             "among CPU, GPU and Neural Engine), cpu_and_ne, cpu_and_gpu, cpu_only")


BACKEND_HELP = ("backend to run on; default: the directory's own (ort for exports and for ORT and AI 100 "
                "lowerings, whose graphs ONNX Runtime runs; mlx and coreml for their lowerings); ai100 needs a "
                "compiled AI 100 lowering and the SDK, coreml macOS 15+")


def _shown(flag, value) -> str:
    """A flag's default as the user would type it."""
    if isinstance(value, bool) and flag.choices == ("on", "off"):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(value) or "none"
    return "none" if value is None else str(value)


def _add_lower(commands) -> None:
    """`lower`: the flags every backend takes, then each backend's own group (a flag several backends take
    is listed once, with each one's default)."""
    from dflash_onnx.targets import BACKENDS

    lower = commands.add_parser(
        "lower", help=f"lower an exported directory for a backend ({', '.join(BACKENDS)})",
        description="Lower an exported directory for a backend. A backend's options are refused with another "
                    "--target.")
    lower.add_argument("source", metavar="DIR", type=Path, help="directory written by 'dflash-onnx export'")
    lower.add_argument("--target", dest="backend", choices=list(BACKENDS), required=True, metavar="BACKEND",
                       help=f"the backend to lower for: {', '.join(BACKENDS)} (it names the backend, not the "
                            "target model)")
    lower.add_argument("--out", type=Path, required=True, help="lowered directory (created atomically)")
    lower.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    reexporting = [b.name for b in BACKENDS.values() if b.reexports]
    lower.add_argument("--target-dir", metavar="DIR_OR_HUB_NAME", help=f"{', '.join(reexporting)}: target "
                       "checkpoint (a directory or a hub name), if it moved since export")
    lower.add_argument("--draft-dir", metavar="DIR_OR_HUB_NAME", help=f"{', '.join(reexporting)}: draft "
                       "checkpoint (a directory or a hub name), if it moved since export")
    lower.add_argument("--quiet", action="store_true", help="no progress on stderr")
    owners: dict[str, list] = {}
    for backend in BACKENDS.values():
        for flag in backend.flags:
            owners.setdefault(flag.name, []).append((backend, flag))
    groups = {None: lower.add_argument_group("options of several backends")}
    groups.update({b.name: lower.add_argument_group(f"--target {b.name} ({b.title})") for b in BACKENDS.values()})
    for name, owned in owners.items():
        backend, flag = owned[0]
        group = groups[backend.name if len(owned) == 1 else None]
        defaults = ", ".join(f"{b.name + ' ' if len(owned) > 1 else ''}{_shown(f, b.default(f))}" for b, f in owned)
        if len({f.help for _, f in owned}) == 1:  # one meaning: said once, for every backend that takes it
            text = flag.help if len(owned) == 1 else f"{'/'.join(b.name for b, _ in owned)}: {flag.help}"
        else:  # a flag each backend reads its own way (--kv-dtype): each says what it does there
            text = "; ".join(f"{b.name}: {f.help}" for b, f in owned)
        # what any owner takes (each backend's options refuse what it does not)
        choices = None if any(f.choices is None for _, f in owned) else \
            list(dict.fromkeys(choice for _, f in owned for choice in f.choices))
        if flag.switch:
            group.add_argument(name, action="store_true", help=text)
        else:
            group.add_argument(name, type=flag.type, choices=choices, default=None,
                               help=f"{text} (default: {defaults})")
    lower.set_defaults(func=_lower)


def build_parser() -> argparse.ArgumentParser:
    from dflash_onnx.targets import BACKENDS

    backends = list(BACKENDS)
    parser = Parser(prog="dflash-onnx", description="DFlash speculative decoding: export to ONNX, run on any backend.",
                    epilog="'dflash-onnx COMMAND --help' for a command's flags; docs/cli.md for all of them.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands")

    export = commands.add_parser("export", help="export a target and its DFlash draft to ONNX")
    add_export_arguments(export)
    export.set_defaults(func=run_export)

    generate = commands.add_parser("generate", help="generate from an exported directory")
    generate.add_argument("source", metavar="DIR", type=Path, help="directory written by 'dflash-onnx export'")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs the target's tokenizer.json); sent as a user turn in "
                        "the tokenizer's chat template when it has one (Qwen3: thinking off)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated (never templated)")
    generate.add_argument("--raw", action="store_true",
                          help="send --prompt as it is, not as a user turn in the tokenizer's chat template")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--mode", choices=("dflash", "greedy"), default="dflash")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    generate.add_argument("--seed", type=int, help="sampling seed")
    generate.add_argument("--backend", choices=backends, help=BACKEND_HELP)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    _add_verify_arguments(generate)
    generate.set_defaults(func=_generate)

    optimize = commands.add_parser("optimize", help="apply graph passes to an exported directory")
    optimize.add_argument("source", metavar="DIR", type=Path, help="directory written by 'dflash-onnx export'")
    optimize.add_argument("--passes", required=True,
                          help="comma-separated, in order: cleanup, rope-fusion, ort-fusions, int8, int4, fp16, fp32, "
                               "tidy")
    optimize.add_argument("--out", type=Path, required=True, help="new directory (created atomically)")
    optimize.add_argument("--pass-option", action="append", default=[], metavar="[PASS.]KEY=VALUE",
                          help="e.g. int4.block_size=64, int4.graphs=draft, int4.lm_head=true, symmetric=false")
    optimize.add_argument("--overwrite", action="store_true")
    optimize.add_argument("--quiet", action="store_true")
    optimize.set_defaults(func=_optimize)

    steps = commands.add_parser("steps", help="median decode / verify / draft step latency, side by side")
    steps.add_argument("dirs", type=Path, nargs="+", help="exported directories to compare")
    steps.add_argument("--context", type=int, default=256, help="K/V length the steps run at")
    steps.add_argument("--repeats", type=int, default=20)
    shown = steps.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true")
    shown.add_argument("--markdown", action="store_true",
                       help="a table as docs/ prints it, with the command, date and machine under it")
    steps.set_defaults(func=_steps)

    bench = commands.add_parser(
        "bench", help="greedy vs DFlash tokens/s, tau, TTFT, loop overhead, verify-cost curve (and peers)",
        description="Measures greedy and DFlash decoding per prompt (alternating runs, medians), the target's "
                    "step time for T = 1..block new tokens at several contexts and the draft step, and what "
                    "those imply. Exits 1 if any DFlash output differs from greedy.")
    bench.add_argument("source", metavar="DIR", type=Path, help="an exported or lowered directory")
    bench.add_argument("--backend", choices=backends, help=BACKEND_HELP)
    bench.add_argument("--prompts", type=Path, help="one prompt per line (\\n for newlines), or .jsonl with "
                       "\"prompt\" or \"ids\"; default: held-out standard-library code (random ids without a "
                       "tokenizer)")
    bench.add_argument("--num-prompts", type=int, default=4, help="default prompts to take (default 4)")
    bench.add_argument("--prompt-tokens", metavar="N,N,...",
                       help="measure at these prompt lengths, e.g. 512,2048,8192: --num-prompts prompts of exactly N "
                       "tokens of held-out code each (random ids without a tokenizer); per length the time to first "
                       "token, the prefill rate and decoding at that depth, one-row greedy, greedy and DFlash, and the "
                       "peers on the same prompts")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--repeats", type=int, default=3, help="runs per prompt and mode (medians)")
    bench.add_argument("--block-sizes", help="verify lengths T of the cost curve (default 1,2,4,..,block)")
    bench.add_argument("--contexts", help="context lengths of the cost curve (default 256,1024, those the lowering "
                       "holds a block beyond)")
    bench.add_argument("--curve-repeats", type=int, default=10)
    bench.add_argument("--peers", help="also run hf (transformers greedy) and/or reference (dflash_generate at "
                       "block 1 and B) and/or ort-genai (greedy and n-gram speculative) and/or mlx-lm (greedy, at the "
                       "directory's precision) and/or llama.cpp (llama-bench greedy step, llama-server greedy and "
                       "draft-dflash, at the directory's precision) on the checkpoints, e.g. hf,reference,llama.cpp")
    bench.add_argument("--llama-cpp-type", metavar="TYPE",
                       help="llama-quantize's type for --peers llama.cpp instead of the one matching this directory's "
                       "precision, e.g. q4_k_m (llama.cpp's recommended 4-bit mix; it picks each tensor's type)")
    bench.add_argument("--llama-cpp", type=Path, metavar="DIR",
                       help="a built llama.cpp source tree for --peers llama.cpp (default: the llama.cpp vendored in "
                       "the llama-cpp-python sdist, downloaded and built once with cmake, cached)")
    bench.add_argument("--target", help="target checkpoint for --peers, a directory or a hub name (default: recorded "
                       "at export)")
    bench.add_argument("--draft", help="draft checkpoint for --peers, a directory or a hub name (default: recorded at "
                       "export)")
    add_revision_arguments(bench, recorded=True)
    bench.add_argument("--load", type=int, default=0, metavar="N",
                       help="measure the runs (and peers) again with N busy processes beside them, started and "
                       "ended by bench: quiet and loaded columns (default 0: quiet only)")
    bench.add_argument("--json", type=Path, help="write every figure to this JSON file")
    bench.add_argument("--plot", type=Path, help="write the curve and histogram to this PNG (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.add_argument("--markdown", action="store_true",
                       help="also print the summary as docs/ prints it, with the command, date and machine under it")
    _add_verify_arguments(bench)
    bench.set_defaults(func=_bench)

    _add_lower(commands)

    calibrate = commands.add_parser(
        "calibrate", help="measure (or replay) the cost curve the auto verify policy uses, into dflash.json",
        description="Measures the target's step for T = 1..block new tokens and the draft's step on the "
                    "directory's backend and records them in its dflash.json, and for an ORT or MLX lowering the "
                    "row multiple that makes the target batch-invariant (lower --target ort and mlx do both "
                    "already, unless they would take too long there); --from replays a curve measured elsewhere, "
                    "e.g. on the device of an AI 100 or CoreML lowering.")
    calibrate.add_argument("source", metavar="DIR", type=Path, help="an exported or lowered directory")
    calibrate.add_argument("--from", dest="from_file", type=Path, metavar="FILE",
                           help="JSON with verify_ms (t(1)..t(B)) and draft_ms, instead of measuring here")
    calibrate.add_argument("--context", type=int, default=256, help="K/V length the steps run at")
    calibrate.add_argument("--depths", default="auto",
                           help="deeper contexts measured too, where the policy prices a long request's steps: "
                                "auto (1024, 4096, 16384, each within what the directory holds), none, or a "
                                "rising comma list")
    calibrate.add_argument("--repeats", type=int, default=10)
    calibrate.add_argument("--backend", choices=backends, help=BACKEND_HELP)
    calibrate.set_defaults(func=_calibrate)

    parity = commands.add_parser("parity", help="check exported graphs against PyTorch and the reference")
    parity.add_argument("source", metavar="DIR", type=Path)
    parity.add_argument("--target", help="target checkpoint, a directory or a hub name (default: the one recorded at "
                        "export)")
    parity.add_argument("--draft", help="draft checkpoint, a directory or a hub name (default: the one recorded at "
                        "export)")
    add_revision_arguments(parity, recorded=True)
    parity.add_argument("--prompts", type=int, default=4)
    parity.add_argument("--max-new-tokens", type=int, default=32)
    parity.add_argument("--seed", type=int, default=0)
    parity.add_argument("--json", action="store_true")
    parity.set_defaults(func=_parity)

    distill = commands.add_parser("distill", help="train a DFlash, DFlash2 or DSpark draft for a frozen target")
    distill.add_argument("--target", required=True, help="target checkpoint (HF layout, tokenizer.json): a directory "
                         "or a hub name (org/name)")
    add_revision_arguments(distill, draft=False)
    distill.add_argument("--out", type=Path, required=True, help="draft directory to write (published layout)")
    distill.add_argument("--data", type=Path, nargs="+", help="text files or directories: prompts are random windows")
    distill.add_argument("--prompts", type=Path, help="a file with one prompt per line")
    distill.add_argument("--block-size", type=int, default=16)
    distill.add_argument("--draft-layers", type=int, default=1)
    distill.add_argument("--draft-type", choices=["dflash", "dflash2", "dspark"], default="dflash",
                         help="dflash (z-lab's layout), dflash2 (its convolutions and candidate selector, z-lab's "
                              "layout) or dspark (Markov and confidence heads, speculators' format)")
    heads = distill.add_argument_group("DFlash2 and DSpark sizes (speculators' defaults)")
    heads.add_argument("--conv-kernel-size", type=int, default=2, help="DFlash2: taps of each convolution")
    heads.add_argument("--conv-group-size", type=int, default=16, help="DFlash2: channels sharing a per-token delta")
    heads.add_argument("--selector-rank", type=int, default=256, help="DFlash2: the selector's pairwise rank")
    heads.add_argument("--selector-top-k", type=int, default=16, help="DFlash2: candidates re-scored per position")
    heads.add_argument("--markov-rank", type=int, default=256, help="DSpark: the Markov bias's rank (0: none)")
    heads.add_argument("--markov-head", choices=["vanilla", "gated", "rnn"], default="vanilla",
                       help="DSpark: the Markov head's kind")
    heads.add_argument("--confidence-target", choices=["sampled", "greedy"], default="sampled",
                       help="DSpark: what the confidence head learns: sampled (speculators': the probability the "
                            "draft gives the target's token) or greedy (whether its greedy proposal is that token, "
                            "what greedy verification accepts)")
    distill.add_argument("--target-layers-tapped", default="auto", help="auto (the reference's rule) or 1,5,9")
    length = distill.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps (default 1000)")
    length.add_argument("--time-budget", type=float, help="minutes to train for (the schedule fits the budget)")
    distill.add_argument("--seed", type=int, default=0)
    distill.add_argument("--lr", type=float, default=6e-4)
    distill.add_argument("--num-prompts", type=int, default=256, help="prompts drawn from --data")
    distill.add_argument("--prompt-tokens", type=int, default=32)
    distill.add_argument("--new-tokens", type=int, default=96, help="target continuation length per prompt")
    distill.add_argument("--resume", action="store_true", help="continue from OUT.ckpt/")
    distill.add_argument("--quiet", action="store_true")
    distill.set_defaults(func=_distill)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions) over DFlash")
    serve.add_argument("source", metavar="DIR", type=Path,
                       help="an exported or lowered directory with the target's tokenizer.json")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                       "only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", help="the model name clients send and /v1/models lists (default: the "
                       "directory's name)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ routes")
    serve.add_argument("--max-queue", type=int, default=16, help="requests that may wait; beyond, 429 with "
                       "Retry-After")
    serve.add_argument("--max-batch", type=int, default=1, help="requests decoded side by side, their target calls "
                       "joined into one per step (needs a lowering with --kv-attention ragged; 1: one at a time)")
    serve.add_argument("--shared-draft", choices=("on", "off"), default="on",
                       help="with --max-batch: greedy requests' draft calls joined into one per step too (a ragged "
                       "CPU lowering made since batched drafts; others draft one request at a time)")
    serve.add_argument("--max-tokens", type=int, default=512, help="a chat request's max_tokens when it sends none")
    serve.add_argument("--max-prompt-tokens", type=int, metavar="N",
                       help="longer prompts get 400 context_length_exceeded (default: as long as the lowering holds)")
    serve.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                       help="the most prompt tokens one prefill call takes: with --max-batch the other requests "
                       "decode between a long prompt's chunks, and a cancelled request stops at the next chunk "
                       "(smaller: steadier tokens for the others; larger: a faster prefill)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413 "
                       "(default 1 MiB); arrays and objects nested over 64 deep get 400")
    serve.add_argument("--log-format", choices=("text", "json", "off"), default="text",
                       help="the access log on stderr, one line per request (method, path, status, prompt and "
                       "completion tokens, tau, time to first token, total time): text (default), json (one JSON "
                       "object a line, for log collectors) or off")
    serve.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S",
                       help="on SIGTERM or Ctrl-C, the seconds requests under way get to finish before they are "
                       "cancelled (streams end with an error event and [DONE]); then exit 0 (default 10; a second "
                       "signal cancels at once)")
    serve.add_argument("--temperature", type=float, default=0.0,
                       help="a request's temperature when it sends none (default 0: the target's greedy output)")
    serve.add_argument("--backend", choices=backends, help=BACKEND_HELP)
    _add_verify_arguments(serve)
    serve.set_defaults(func=_serve)

    demo = commands.add_parser("demo", help="build, export and run a tiny pair: greedy vs DFlash")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--prompts", type=int, default=4, help="held-out code prompts to run")
    demo.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every mode on every prompt: the "
                      "table gives their medians and how far they moved")
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):  # bare: what there is to do, not an error
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    args.command_line = ["dflash-onnx", *(sys.argv[1:] if argv is None else argv)]  # as measured figures cite it
    warnings.filterwarnings("ignore")
    for library in ("onnxscript", "onnx_ir"):  # their optimizers log each rewrite they skip at INFO
        logging.getLogger(library).setLevel(logging.WARNING)
    try:
        return args.func(args)
    except DFlashError as exc:
        print(f"dflash-onnx {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the program: a full disk, a read-only or missing place
        where = f" ({exc.filename})" if exc.filename else ""
        hint = {errno.ENOSPC: "free some space or choose another --out", errno.EROFS: "choose a writable --out",
                errno.EACCES: "check the permissions or choose another --out"}.get(exc.errno, "check the path")
        print(f"dflash-onnx {args.command}: error: {exc.strerror or exc}{where}: {hint}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # the runtime needs neither; export, conversion and the torch peers do
        if exc.name is None or exc.name.split(".")[0] not in ("torch", "transformers", "safetensors"):
            raise
        print(f"dflash-onnx {args.command}: error: this needs PyTorch and transformers, which are not installed: "
              "pip install torch==2.13.0 && pip install 'dflash-onnx[export]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
