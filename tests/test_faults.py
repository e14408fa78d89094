"""Bad inputs and faults, as a hostile or careless user meets them: every case runs the CLI in a subprocess and
must exit 2 with exactly one line on stderr saying what is wrong, leave no output (not even a hidden staging
directory) and leave its inputs byte-identical. Then the faults that must not lose data: kill -9 at the publish
step (injected at the rename, not timed), two writers of one --out, a disk that fills up.

Faults are injected by running a line of Python in the child before the CLI starts (DFLASH_TEST_INJECT).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RUNNER = """
import os, sys
exec(os.environ.get("DFLASH_TEST_INJECT", ""))
from dflash_onnx.cli import main
sys.exit(main(sys.argv[1:]))
"""
KILL_AT = "import dflash_onnx.artifacts.publish as p, os; p.{0} = lambda *a, **k: os.kill(os.getpid(), 9)"
# the disk fills up while the first graph's weights are written: part of the file is on disk, then ENOSPC
FULL_DISK = ("import errno, onnx_ir\n"
             "def full(model, path, **k):\n"
             "    open(path + '.data', 'wb').write(b'partial')\n"
             "    raise OSError(errno.ENOSPC, 'No space left on device', path + '.data')\n"
             "onnx_ir.save = full")
NO_SPACE = ("import shutil, collections\n"
            "shutil.disk_usage = lambda p: collections.namedtuple('u', 'total used free')(10**6, 10**6, 1000)")
# a directory the user may not write in (the tests run as root, whom chmod does not stop): creating anything for
# `ro_out` beside it is refused, as the kernel would
READ_ONLY = ("import os, errno\n"
             "real = os.open\n"
             "def refuse(path, *a, **k):\n"
             "    if os.path.basename(path).startswith('.ro_out.'):\n"
             "        raise PermissionError(errno.EACCES, 'Permission denied', str(path))\n"
             "    return real(path, *a, **k)\n"
             "os.open = refuse")


def cli(*args: str, inject: str = "", wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-c", RUNNER, *map(str, args)]
    env = {**os.environ, "DFLASH_TEST_INJECT": inject}
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def digest(*paths: Path) -> str:
    """One hash over every file below `paths` (names and bytes): inputs must come back byte-identical."""
    h = hashlib.sha256()
    for root in paths:
        for path in sorted(Path(root).rglob("*")) if Path(root).is_dir() else [Path(root)]:
            if path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@dataclass
class World:
    """Copies of a tiny pair and its export that cases tamper with (the shared fixtures stay untouched)."""

    root: Path
    target: Path
    draft: Path
    export: Path

    def copy(self, what: str, name: str) -> Path:
        dest = self.root / name
        shutil.copytree(getattr(self, what), dest)
        return dest

    def config(self, directory: Path, **changes) -> None:
        path = directory / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@dataclass
class Case:
    id: str
    expect: str  # in the one stderr line
    argv: list = field(default_factory=list)
    inject: str = ""
    inputs: list = field(default_factory=list)  # must be byte-identical afterwards
    out: Path | None = None  # must not exist afterwards, nor anything hidden beside it


def _cases(w: World) -> list[Case]:
    r = w.root
    cases = []

    def export(case_id, expect, target=w.target, draft=w.draft, out=None, extra=(), inject=""):
        out = out or r / f"out_{case_id}"
        cases.append(Case(case_id, expect, ["export", "--target", target, "--draft", draft, "--out", out, "--quiet",
                                            *extra], inject, [target, draft], out))

    def run(case_id, expect, argv, inputs, inject=""):
        cases.append(Case(case_id, expect, argv, inject, inputs))

    # --- never run a model directory's code, never unpickle
    t = w.copy("target", "t_auto_map")
    w.config(t, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    export("target_auto_map", "has 'auto_map': the model needs Python code shipped in its directory", target=t)
    t = w.copy("target", "t_pickle")
    (t / "model.safetensors").rename(t / "pytorch_model.bin")
    export("target_pickle_only", "has only pickle weights \\(pytorch_model.bin\\)", target=t)
    d = w.copy("draft", "d_pickle")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    export("draft_pickle_only", "has only pickle weights \\(pytorch_model.bin\\)", draft=d)
    # --- damaged or unsuitable checkpoints
    t = w.copy("target", "t_truncated")
    data = (t / "model.safetensors").read_bytes()
    (t / "model.safetensors").write_bytes(data[: len(data) // 2])
    export("target_truncated", "target weights .* are damaged or truncated", target=t)
    d = w.copy("draft", "d_truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-10])
    export("draft_truncated", "draft weights .* are damaged or truncated", draft=d)
    t = w.copy("target", "t_bert")
    w.config(t, model_type="bert", architectures=["BertForMaskedLM"])
    export("target_is_bert", "is a bert model, an encoder", target=t)
    t = w.copy("target", "t_no_json")
    (t / "config.json").write_text("{not json")
    export("target_config_not_json", "config.json is not valid JSON", target=t)
    d = w.copy("draft", "d_wrong_size")
    w.config(d, hidden_size=32)
    export("pair_mismatch", "draft hidden_size 32 != target hidden_size 64", draft=d)
    export("block_size_one", "block size 1 is too small", extra=("--block-size", "1"))
    export("opset_17", "opset 17 is not supported", extra=("--opset", "17"))
    export("missing_target", "target directory .* does not exist", target=r / "nowhere")
    # --- where the output goes
    export("out_is_the_target", "would replace the model directory", out=w.target)
    cases[-1].out = None  # it is an input: checked byte-identical
    (r / "a_file").write_text("x")
    export("out_below_a_file", "a_file is a file, not a directory", out=r / "a_file" / "out")
    existing = r / "existing_out"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    export("out_exists", "already exists: choose another --out or pass --overwrite", out=existing)
    cases[-1].inputs.append(existing)
    cases[-1].out = None
    export("read_only_parent", "cannot write in .* \\(Permission denied\\)", out=r / "ro_out", inject=READ_ONLY)
    export("not_enough_space", "this needs about .* MiB and .* has 0.0 MiB free", inject=NO_SPACE)
    export("disk_fills_up", "No space left on device .*: free some space or choose another --out", inject=FULL_DISK)
    # --- tampered artifacts: nothing outside the directory is opened
    e = w.copy("export", "e_escape")
    manifest = json.loads((e / "dflash.json").read_text())
    manifest["target"]["file"] = "../victim/target.onnx"
    (e / "dflash.json").write_text(json.dumps(manifest))
    victim = r / "victim"
    shutil.copytree(w.export, victim)
    run("graph_file_escapes", "'../victim/target.onnx', which is not a plain relative name",
        ["generate", e, "--prompt-ids", "3,4"], [e, victim])
    e = w.copy("export", "e_absolute")
    manifest = json.loads((e / "dflash.json").read_text())
    manifest["draft"]["file"] = "/etc/passwd"
    (e / "dflash.json").write_text(json.dumps(manifest))
    run("graph_file_absolute", "'/etc/passwd', which is not a plain relative name",
        ["generate", e, "--prompt-ids", "3,4"], [e])
    e = w.copy("export", "e_symlink")
    (e / "target.onnx").unlink()
    (e / "target.onnx").symlink_to(victim / "target.onnx")
    run("graph_file_symlink_out", "leads outside", ["generate", e, "--prompt-ids", "3,4"], [e, victim])
    e = w.copy("export", "e_external")
    _point_external_data(e / "target.onnx", "../victim/target.onnx.data")
    run("external_data_escapes", "external data .* '../victim/target.onnx.data', which is not a plain relative name",
        ["generate", e, "--prompt-ids", "3,4"], [e, victim])
    run("optimize_external_data_escapes", "external data .* not a plain relative name",
        ["optimize", e, "--passes", "cleanup", "--out", r / "out_opt_escape"], [e, victim])
    cases[-1].out = r / "out_opt_escape"
    e = w.copy("export", "e_tokenizer")
    (e / "tokenizer.json").unlink()
    (e / "tokenizer.json").symlink_to(victim / "tokenizer.json")
    run("tokenizer_symlink_out", "the tokenizer file 'tokenizer.json' leads outside",
        ["generate", e, "--prompt", "hi"], [e, victim])
    e = w.copy("export", "e_truncated_graph")
    (e / "draft.onnx").write_bytes((e / "draft.onnx").read_bytes()[:100])
    run("graph_truncated", "draft.onnx is not a readable ONNX graph", ["generate", e, "--prompt-ids", "3,4"], [e])
    e = w.copy("export", "e_bad_manifest")
    (e / "dflash.json").write_text("[1, 2]")
    run("manifest_not_an_object", "dflash.json is corrupt \\(not a JSON object\\)",
        ["generate", e, "--prompt-ids", "3,4"], [e])
    e = w.copy("export", "e_old_lowering")
    manifest = json.loads((e / "dflash.json").read_text())
    manifest.update(format_version=1, lowering={"target": "ort"})
    (e / "dflash.json").write_text(json.dumps(manifest))
    run("old_format_lowering", "re-run 'dflash-onnx lower'", ["generate", e, "--prompt-ids", "3,4"], [e])
    run("not_an_export", "has no dflash.json", ["generate", w.target, "--prompt-ids", "3,4"], [w.target])
    # --- bad flags and prompts
    x = w.export
    run("prompt_not_utf8", "--prompt is not valid UTF-8", ["generate", x, "--prompt", b"caf\xe9".decode(
        "utf-8", "surrogateescape")], [x])
    run("prompt_ids_not_ints", "--prompt-ids must be comma-separated integers", ["generate", x, "--prompt-ids",
                                                                                  "3,x"], [x])
    run("prompt_id_out_of_vocab", "prompt ids must lie in 0..95", ["generate", x, "--prompt-ids", "3,96"], [x])
    run("max_new_tokens_zero", "max_new_tokens must be at least 1", ["generate", x, "--prompt-ids", "3",
                                                                      "--max-new-tokens", "0"], [x])
    run("temperature_negative", "--temperature must be 0 \\(greedy\\) or more", ["generate", x, "--prompt-ids", "3",
                                                                             "--temperature", "-1"], [x])
    run("top_p_zero", "--top-p must lie in \\(0, 1\\]", ["generate", x, "--prompt-ids", "3", "--temperature", "1",
                                                     "--top-p", "0"], [x])
    run("top_k_negative", "--top-k must be 0 \\(no top-k\\) or more", ["generate", x, "--prompt-ids", "3",
                                                                   "--temperature", "1", "--top-k", "-2"], [x])
    for case_id, content, expect in (
            ("bench_prompts_json_array", b'["not", "an", "object"]\n', "not a JSON object"),
            ("bench_prompts_string_ids", b'{"ids": ["3", "4"]}\n', '"ids" must be a list of integers'),
            ("bench_prompts_not_utf8", b'{"prompt": "caf\xe9"}\n', "is not UTF-8 text")):
        prompts = r / f"{case_id}.jsonl"
        prompts.write_bytes(content)
        run(case_id, expect, ["bench", x, "--prompts", prompts, "--quiet"], [x, prompts])
    run("bench_unknown_peer", "unknown peers \\['foo'\\]", ["bench", x, "--peers", "foo", "--quiet"], [x])
    run("steps_zero_repeats", "--repeats must be at least 1", ["steps", x, "--repeats", "0"], [x])
    run("optimize_bad_int_option", "--pass-option int4.block_size='abc': give an integer",
        ["optimize", x, "--passes", "int4", "--pass-option", "int4.block_size=abc", "--out", r / "out_opt_abc"], [x])
    cases[-1].out = r / "out_opt_abc"
    run("optimize_lowering_pass", "kv-buffer: applied by 'dflash-onnx lower --target ort'",
        ["optimize", x, "--passes", "kv-buffer", "--out", r / "out_opt_kv"], [x])
    cases[-1].out = r / "out_opt_kv"
    run("lower_foreign_flag", "--bits is an option of --target mlx/coreml, not of --target ort",
        ["lower", x, "--target", "ort", "--bits", "4", "--out", r / "out_low_bits"], [x])
    cases[-1].out = r / "out_low_bits"
    run("lower_zero_cores", "--target-cores 0 must be in 1..16",
        ["lower", x, "--target", "ai100", "--target-cores", "0", "--dry-run", "--out", r / "out_low_cores"], [x])
    cases[-1].out = r / "out_low_cores"
    run("lower_unknown_provider", "--provider tpu: choose one of",
        ["lower", x, "--target", "ort", "--provider", "tpu", "--out", r / "out_low_tpu"], [x])
    cases[-1].out = r / "out_low_tpu"
    return cases


def _point_external_data(graph: Path, location: str) -> None:
    import onnx

    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(model, str(graph))


@pytest.fixture(scope="module")
def world(exported, tmp_path_factory) -> World:
    pair = exported("agree_b2")
    root = tmp_path_factory.mktemp("faults")
    w = World(root, root / "target", root / "draft", root / "export")
    for name, source in (("target", pair.target_dir), ("draft", pair.draft_dir), ("export", pair.out)):
        shutil.copytree(source, root / name)
    return w


@pytest.fixture(scope="module")
def outcomes(world):
    """Every case, run four at a time (each is a separate interpreter); inputs hashed before and after."""
    cases = _cases(world)

    def one(case: Case):
        before = digest(*case.inputs)
        done = cli(*case.argv, inject=case.inject)
        return case, done, before, digest(*case.inputs)

    with ThreadPoolExecutor(4) as pool:
        return {result[0].id: result for result in pool.map(one, cases)}


# the table's ids, in order (test_the_table_is_complete checks them against the cases built)
CASE_IDS = [
    "target_auto_map", "target_pickle_only", "draft_pickle_only", "target_truncated",
    "draft_truncated", "target_is_bert", "target_config_not_json", "pair_mismatch", "block_size_one", "opset_17",
    "missing_target", "out_is_the_target", "out_below_a_file", "out_exists", "read_only_parent", "not_enough_space",
    "disk_fills_up", "graph_file_escapes", "graph_file_absolute", "graph_file_symlink_out", "external_data_escapes",
    "optimize_external_data_escapes", "tokenizer_symlink_out", "graph_truncated", "manifest_not_an_object",
    "old_format_lowering", "not_an_export", "prompt_not_utf8", "prompt_ids_not_ints", "prompt_id_out_of_vocab",
    "max_new_tokens_zero", "temperature_negative", "top_p_zero", "top_k_negative", "bench_prompts_json_array",
    "bench_prompts_string_ids", "bench_prompts_not_utf8", "bench_unknown_peer", "steps_zero_repeats",
    "optimize_bad_int_option", "optimize_lowering_pass", "lower_foreign_flag", "lower_zero_cores",
    "lower_unknown_provider",
]


def test_the_table_is_complete(outcomes):
    assert list(outcomes) == CASE_IDS and len(CASE_IDS) >= 40


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input_gets_one_line_and_changes_nothing(case_id, outcomes):
    case, done, before, after = outcomes[case_id]
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (case.argv, done.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[0].startswith(f"dflash-onnx {case.argv[0]}: error: ")
    assert re.search(case.expect, lines[0]), (case.expect, lines[0])
    assert after == before, "an input changed"
    if case.out is not None and case.out.parent.is_dir():
        assert not case.out.exists(), "a partial output was left"
        leftovers = [p.name for p in case.out.parent.iterdir() if p.name.startswith(f".{case.out.name}.")]
        assert not leftovers, leftovers


def test_flags_and_checkpoints_are_refused_before_torch_or_onnx_loads(world, tmp_path):
    """The checks that need no model run before the imports that take seconds (torch, transformers, onnx): with
    those made unimportable, a wrong path, a pickle-only checkpoint, a bad opset or block size, a lowering's bad
    flags and bad generate flags still get their one-line error."""
    blocked = "import sys; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'onnx', 'onnx_ir'), None))"
    pickled = world.copy("target", "t_pickle_early")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    out = tmp_path / "out"
    for argv, expect in (
            (["export", "--target", tmp_path / "nowhere", "--draft", world.draft, "--out", out], "does not exist"),
            (["export", "--target", pickled, "--draft", world.draft, "--out", out], "has only pickle weights"),
            (["export", "--target", world.target, "--draft", world.draft, "--out", out, "--opset", "17"],
             "opset 17 is not supported"),
            (["export", "--target", world.target, "--draft", world.draft, "--out", out, "--block-size", "1"],
             "block size 1 is too small"),
            (["lower", world.export, "--target", "ai100", "--target-cores", "0", "--dry-run", "--out", out],
             "--target-cores 0 must be in"),
            (["generate", world.export, "--prompt-ids", "3,x"], "must be comma-separated integers"),
            (["generate", world.export, "--prompt-ids", "3", "--max-new-tokens", "0"], "at least 1"),
            (["generate", world.export, "--prompt-ids", "3", "--temperature", "-1"], "--temperature must be")):
        done = cli(*argv, inject=blocked)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr[-2000:])
        assert re.search(expect, done.stderr), (expect, done.stderr)
    assert not out.exists()


# --- faults that must not lose data ------------------------------------------------------------------------------

def _writer_args(world: World, out: Path, *extra: str) -> list:
    """A quick writer: `optimize` publishes through the same publisher as export and every lowering."""
    return ["optimize", world.export, "--passes", "tidy", "--out", out, "--quiet", *extra]


def _hidden(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


@pytest.mark.parametrize("replacing", [False, True], ids=["fresh", "overwrite"])
def test_kill_at_the_publish_step_leaves_out_complete_and_the_next_run_cleans_up(replacing, world, tmp_path):
    out = tmp_path / "out"
    if replacing:
        assert cli(*_writer_args(world, out)).returncode == 0
        old = digest(out)
    # killed exactly where the staging directory becomes OUT: by the exchange (OUT exists) or the rename
    killed = cli(*_writer_args(world, out, "--overwrite"),
                 inject=KILL_AT.format("_exchange" if replacing else "_renameat2"))
    assert killed.returncode == -signal.SIGKILL
    if replacing:
        assert digest(out) == old  # OUT still names the complete old export
    else:
        assert not out.exists()  # never a half-written OUT
    # left behind: the dead run's staging directory and its lock file (the kernel released the lock itself)
    assert [name.rsplit("-", 1)[0] for name in _hidden(out)] == [f".{out.name}.lock", f".{out.name}.staging"]
    done = cli(*_writer_args(world, out, "--overwrite"))
    assert done.returncode == 0, done.stderr
    assert _hidden(out) == [] and (out / "dflash.json").is_file()  # the dead run's staging is gone


def test_a_second_writer_of_one_out_fails_at_once(world, tmp_path):
    out, go = tmp_path / "out", tmp_path / "go"
    hold = ("import dflash_onnx.artifacts.publish as p, time, pathlib\n"
            "real = p._publish\n"
            f"def held(*a):\n    while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n    return real(*a)\n"
            "p._publish = held")
    first = cli(*_writer_args(world, out), inject=hold, wait=False)
    try:
        deadline = time.monotonic() + 300
        while not any(n.startswith(f".{out.name}.staging") for n in _hidden(out)):  # the first holds OUT now
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.1)
        started = time.monotonic()
        second = cli(*_writer_args(world, out, "--overwrite"))
        assert second.returncode == 2 and time.monotonic() - started < 60
        assert f"pid {first.pid}) is writing {out}" in second.stderr and len(second.stderr.splitlines()) == 1
        other = tmp_path / "other"
        assert cli(*_writer_args(world, other)).returncode == 0  # another OUT in the same folder is not blocked
    finally:
        go.write_text("go")
        _, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert (out / "dflash.json").is_file() and _hidden(out) == []


def test_a_live_runs_staging_is_never_cleaned(world, tmp_path):
    out = tmp_path / "out"
    mine = tmp_path / f".out.staging-{os.getpid()}"  # this test process is alive
    dead = tmp_path / ".out.staging-999999999"
    for path in (mine, dead):
        path.mkdir()
        (path / "partial.onnx").write_text("x")
    assert cli(*_writer_args(world, out)).returncode == 0
    assert mine.is_dir() and not dead.exists()
