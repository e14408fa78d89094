"""What `qaic-compile` receives from `lower --target ai100`: flags, placement, compile.sh's SDK discovery,
hardware version and flat-specialization fallback (a fake compiler records what it is given)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import LowerRequest
from dflash_onnx.targets.ai100.compiler import (
    SDK_EXEC,
    compile_commands,
    compile_flags,
    compile_script,
    partition_config,
)
from dflash_onnx.targets.ai100.lower import lower_ai100
from dflash_onnx.targets.ai100.options import Ai100Options

RECORDER = '#!/usr/bin/env bash\necho "$(basename "$0") $@" >> "$FAKE_QAIC_LOG"\n{extra}'


def test_compile_sh_runs_what_the_manifest_reports(lowered):
    directory, log = lowered("agree_b8")
    manifest = load_manifest(directory)
    options = Ai100Options(**manifest.lowering.options)
    recorded = [shlex.split(line) for line in log.read_text().splitlines()]
    assert recorded == [command[1:] for command in compile_commands(options)]
    assert manifest.lowering.report["compile_commands"] == compile_commands(options)
    target, draft = recorded
    for flag in ("-aic-hw", "-aic-hw-version=ai100", "-m=target.onnx", "-retained-state", "-convert-to-fp16",
                 "-mxfp6-matmul", "-aic-num-cores=12", "-mos=1", "-node-precision-info=target_npi.yaml",
                 "-network-specialization-config=target_specializations.json",
                 "-custom-IO-list-file=target_custom_io.yaml", "-aic-binary-dir=qpc/target"):
        assert flag in target
    assert "-aic-num-cores=4" in draft and not any(a.startswith("-mdp") for a in target + draft)
    assert manifest.lowering.compiled and (directory / "qpc" / "target" / "programqpc.bin").is_file()


def test_node_precision_lists_every_rmsnorm_output(lowered):
    import onnx

    directory, _ = lowered("agree_b8")
    # target: 4 layers x (input, post-attention, q, k) + final + the draft's hidden_norm; draft: 1 layer x (input,
    # post-attention, q, k on context rows, k on block rows) + final
    for graph, norms in (("target", 4 * 4 + 2), ("draft", 5 + 1)):
        listed = (directory / f"{graph}_npi.yaml").read_text().splitlines()
        assert listed[0] == "FP32NodeInstanceNames:"
        names = [line.removeprefix("  - ") for line in listed[1:]]
        model = onnx.load(str(directory / f"{graph}.onnx"), load_external_data=False)
        producers = {o: n for n in model.graph.node for o in n.output}
        assert all(name in producers for name in names)
        # each RMSNorm: x^2, its mean, + eps, the root, its reciprocal, x * that, * weight
        assert sum(producers[n].op_type == "ReduceMean" for n in names) == norms
        assert {producers[n].op_type for n in names} <= {"Pow", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Mul",
                                                         "Cast"}


def _script_dir(tmp_path: Path, options: Ai100Options) -> Path:
    directory = tmp_path / "ai"
    directory.mkdir()
    (directory / "compile.sh").write_text(compile_script(options))
    return directory


def _run(directory: Path, tmp_path: Path, tools: dict[str, str], **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in tools.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    path = f"{bin_dir}:{os.path.dirname(shutil.which('bash'))}:/usr/bin:/bin"
    return subprocess.run(["bash", "compile.sh"], cwd=directory, capture_output=True, text=True,
                          env={"PATH": path, "FAKE_QAIC_LOG": str(tmp_path / "log"), **env})


def _log(tmp_path: Path) -> list[list[str]]:
    return [shlex.split(line) for line in (tmp_path / "log").read_text().splitlines()]


@pytest.mark.skipif(Path(SDK_EXEC).exists(), reason="a Cloud AI 100 SDK is installed on this machine")
def test_compile_sh_without_an_sdk_says_what_it_needs(tmp_path):
    done = _run(_script_dir(tmp_path, Ai100Options()), tmp_path, {})
    assert done.returncode == 127
    assert "qaic-compile not found (PATH, /opt/qti-aic/exec): install the Cloud AI 100 Apps SDK or set " \
           "QAIC_COMPILE" in done.stderr


def test_compile_sh_prefers_qaic_compile_then_qaic_exec(tmp_path):
    directory = _script_dir(tmp_path, Ai100Options())
    done = _run(directory, tmp_path, {"qaic-exec": RECORDER.format(extra="")})
    assert done.returncode == 0, done.stderr
    assert [line[:3] for line in _log(tmp_path)] == [["qaic-exec", "-compile-only", "-aic-hw"]] * 2
    (tmp_path / "log").unlink()
    done = _run(directory, tmp_path, {"qaic-compile": RECORDER.format(extra="")})
    assert [line[:2] for line in _log(tmp_path)] == [["qaic-compile", "-aic-hw"]] * 2


def test_compile_sh_asks_qaic_util_for_the_hardware_unless_told(tmp_path):
    directory = _script_dir(tmp_path, Ai100Options())
    util = '#!/usr/bin/env bash\necho "FW IMAGE_VARIANT: AIC200_xyz"\n'
    tools = {"qaic-compile": RECORDER.format(extra=""), "qaic-util": util}
    assert _run(directory, tmp_path, tools).returncode == 0
    assert all("-aic-hw-version=ai200" in line for line in _log(tmp_path))
    (tmp_path / "log").unlink()
    assert _run(directory, tmp_path, tools, AIC_HW_VERSION="ai100").returncode == 0
    assert all("-aic-hw-version=ai100" in line for line in _log(tmp_path))
    fixed = compile_script(Ai100Options(hw_version="ai200"))
    assert "echo ai200" in fixed and "qaic-util" not in fixed


def test_compile_sh_falls_back_to_flat_specializations_for_an_older_sdk(tmp_path):
    older = RECORDER.format(extra='case "$*" in *_specializations.json*) '
                                  'echo "error: unknown key name in specialization config" >&2; exit 1;; esac\n')
    done = _run(_script_dir(tmp_path, Ai100Options()), tmp_path, {"qaic-compile": older})
    assert done.returncode == 0, done.stderr
    specs = [next(a for a in line if a.startswith("-network-specialization-config")) for line in _log(tmp_path)]
    assert specs == ["-network-specialization-config=target_specializations.json",
                     "-network-specialization-config=target_specializations_flat.json",
                     "-network-specialization-config=draft_specializations.json",
                     "-network-specialization-config=draft_specializations_flat.json"]
    assert "rejected target_specializations.json; trying the flat format" in done.stderr


def test_compile_sh_reports_a_failed_compile_with_the_compilers_words(tmp_path):
    broken = RECORDER.format(extra='echo "error: node /model/x unsupported" >&2; exit 3\n')
    done = _run(_script_dir(tmp_path, Ai100Options()), tmp_path, {"qaic-compile": broken})
    assert done.returncode == 1
    assert "compiling target failed" in done.stderr and "node /model/x unsupported" in done.stderr
    assert len(_log(tmp_path)) == 1  # no flat retry for an error that is not about specializations


def test_a_tensor_sliced_target_gets_a_partition_config(exported, tmp_path):
    options = Ai100Options(ctx_len=64, prefill_len=4, target_devices="0,1,2,3", draft_devices="4", target_cores=16,
                           draft_cores=16, dry_run=True)
    assert "-mdp-load-partition-config=target_mdp.json" in compile_flags("target", options)
    assert not any(f.startswith("-mdp") for f in compile_flags("draft", options))
    assert partition_config(4, 16) == {
        "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
        "partitions": [{"name": "Partition0", "devices": [{"deviceId": d, "numCores": 16} for d in range(4)]}]}
    out = tmp_path / "ai"
    lower_ai100(exported("agree_b2").out, out, options, LowerRequest(progress=False))
    import json

    assert json.loads((out / "target_mdp.json").read_text()) == partition_config(4, 16)
    assert "-mdp-load-partition-config=target_mdp.json" in (out / "compile.sh").read_text()


@pytest.mark.parametrize("changes,message", [
    ({"target_cores": 12}, "device 0 would hold 20 cores \\(target 12 \\+ draft 8\\) but has 16"),
    ({"target_cores": 16, "draft_devices": "0"}, "device 0 would hold 24 cores"),
    ({"target_cores": 0}, "--target-cores 0 must be in 1..16"),
    ({"draft_cores": 17, "draft_devices": "1"}, "--draft-cores 17 must be in 1..16"),
    ({"target_devices": "0,0"}, "device ids must be distinct"),
    ({"target_devices": "a"}, "--target-devices 'a': give comma-separated integers"),
    ({"draft_devices": "1,2"}, "the draft runs on one device"),
    ({"ccl": "64,100"}, "must be positive and end at --ctx-len 4096"),
    ({"mos": -1}, "--mos -1"),
    ({"mxfp6_matmul": "yes"}, "--mxfp6-matmul yes"),
])
def test_placement_and_precision_options_are_checked(changes, message):
    with pytest.raises(DFlashError, match=message):
        Ai100Options(**changes).validate(block_size=8)


def test_defaults_fit_one_card_with_qefficients_dflash_recipe():
    options = Ai100Options()
    options.validate(block_size=16)
    assert (options.target_cores, options.draft_cores, options.target_devices, options.draft_devices) == \
        (8, 8, "0", "0")
    assert options.compute_context_lengths() == [1024, 2048, 4096]
    assert Ai100Options(target_cores=16, draft_devices="1").validate(16) is None  # a card each
    flags = compile_flags("target", options)
    assert {"-mxfp6-matmul", "-mos=1", "-aic-num-cores=8"} <= set(flags)
    assert not {"-mxfp6-matmul", "-mos=1"} & set(compile_flags("draft", Ai100Options(mxfp6_matmul="off", mos=0)))
