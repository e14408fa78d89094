"""The AI 100 Session against a stand-in SDK (tests/fake_qaic_sdk) whose 'device' runs the compiled graph on ORT
and enforces the runtime's rules we know of: core budgets, uncleared memory, partial buffers, dtypes, shapes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.manifest import load_manifest
from dflash_onnx.targets import open_decoder

FAKE = Path(__file__).parent / "fake_qaic_sdk"


@pytest.fixture
def qaicrt(monkeypatch):
    monkeypatch.syspath_prepend(str(FAKE))
    for module in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(module, None)
    import qaicrt

    qaicrt.reset()
    yield qaicrt
    for module in ("qaicrt", "QAicApi_pb2"):
        sys.modules.pop(module, None)


def _fake_compiled(source: Path, out: Path, partial: list[str]) -> Path:
    """A copy of a dry-run lowering with the fake QPCs the fake compiler would have written."""
    shutil.copytree(source, out)
    for graph, cores in (("target", 8), ("draft", 8)):
        (out / "qpc" / graph).mkdir(parents=True)
        (out / "qpc" / graph / "fake_qpc.json").write_text(json.dumps({
            "onnx": f"../../{graph}.onnx", "specializations": f"../../{graph}_specializations.json", "cores": cores,
            "partial": partial}))
    return out


def test_device_decode_matches_ort_keeps_state_on_device_and_moves_ids_only(lowered, qaicrt):
    directory, _ = lowered("agree_b8")
    device = open_decoder(directory, backend="ai100")
    emulated = open_decoder(directory, backend="ort")
    assert qaicrt.ACTIVE == {0: 16}  # target 12 + draft 4 cores on device 0
    for prompt in ([3, 4, 5], list(range(2, 40)), [7] * 70):  # the device state is reused across prompts
        ours = device.generate(prompt, 30, "dflash", stop_token_ids=[])
        twin = emulated.generate(prompt, 30, "dflash", stop_token_ids=[])
        assert (ours.tokens, ours.acceptance_lengths) == (twin.tokens, twin.acceptance_lengths)
    assert not qaicrt.ERRORS
    target_calls = [shapes for name, shapes, _ in qaicrt.CALLS if name == "target.onnx"]
    assert {s["input_ids"][1] for s in target_calls} == {8, 16}  # verify and prefill specializations only
    assert {s["comp_ctx_lengths"][0] for s in target_calls} == {64, 160}  # short contexts read 64 slots
    copied = {name for _, _, names in qaicrt.CALLS for name in names}
    assert copied == {"greedy_ids", "context_hidden", "draft_ids", "draft_confidence"}  # no logits, no K/V


def test_fresh_device_memory_is_zeroed_before_it_is_read(lowered, qaicrt):
    """The fake device starts its retained state as NaN: without the first call's zeros, masked slots
    (weight 0 x NaN) would poison every output."""
    directory, _ = lowered("agree_b8")
    device = open_decoder(directory, backend="ai100")
    result = device.generate([5, 6, 7, 8], 12, "dflash", stop_token_ids=[])
    assert result.tokens == open_decoder(directory, backend="ort").generate([5, 6, 7, 8], 12, "greedy",
                                                                           stop_token_ids=[]).tokens


@pytest.mark.parametrize("partial", [[], ["logits"]])
def test_logits_are_skipped_only_where_the_binding_allows_partial_buffers(lowered, qaicrt, tmp_path, partial):
    directory = _fake_compiled(lowered("agree_b2")[0], tmp_path / "ai", partial)  # graphs with logits
    device = open_decoder(directory, backend="ai100")
    tokens = device.generate([3, 4, 5], 10, "dflash", stop_token_ids=[]).tokens
    assert tokens == open_decoder(directory, backend="ort").generate([3, 4, 5], 10, "greedy", stop_token_ids=[]).tokens
    assert not qaicrt.ERRORS
    copied = {name for _, _, names in qaicrt.CALLS for name in names}
    assert ("logits" in copied) == (not partial)  # fetched (and dropped) when skipping it would be refused


def test_a_second_card_is_needed_when_the_cores_do_not_fit(lowered, qaicrt):
    directory, _ = lowered("agree_b8")
    qaicrt.ACTIVE[0] = 8  # another program holds half of device 0
    with pytest.raises(DFlashError, match="cannot load .*qpc/target on AI 100 device\\(s\\) \\[0\\].*cores"):
        open_decoder(directory, backend="ai100")
    qaicrt.reset()
    decoder = open_decoder(directory, backend="ai100", draft_devices=[1], target_devices=[2])
    assert qaicrt.ACTIVE == {2: 12, 1: 4}
    emulated = open_decoder(directory, backend="ort")  # the ORT emulation of the same graphs: the tokens' oracle
    assert decoder.generate([3, 4, 5], 8, "dflash", stop_token_ids=[]).tokens == \
        emulated.generate([3, 4, 5], 8, "greedy", stop_token_ids=[]).tokens
    with pytest.raises(DFlashError, match="compiled for 1 device\\(s\\) \\[0\\], not 2"):
        open_decoder(directory, backend="ai100", target_devices=[0, 1])


def test_a_shape_outside_the_specializations_fails_in_one_line(lowered, qaicrt):
    directory, _ = lowered("agree_b8")
    session = open_decoder(directory, backend="ai100").target
    with pytest.raises(DFlashError, match="inputs .*input_ids.*\\[1, 5\\].*must match a compiled specialization"):
        session.run({"input_ids": np.array([[3] * 5]), "position_ids": np.arange(5)[None],
                     "comp_ctx_lengths": np.zeros(64, np.int64)}, ["greedy_ids"])
    assert "no compiled specialization" in qaicrt.ERRORS[-1]


def test_binding_types_follow_qefficients_map():
    sys.path.insert(0, str(FAKE))
    try:
        import QAicApi_pb2 as aicapi

        from dflash_onnx.targets.ai100.session import binding_dtypes

        types = binding_dtypes(aicapi)
    finally:
        sys.path.remove(str(FAKE))
        sys.modules.pop("QAicApi_pb2", None)
    assert types[aicapi.FLOAT_TYPE] == np.float32 and types[aicapi.FLOAT_16_TYPE] == np.float16
    assert types[aicapi.BFLOAT16_TYPE] == np.float16  # bfloat16 bindings carry float16 data, as in QEfficient
    assert types[aicapi.INT32_I_TYPE] == np.int32 and types[aicapi.INT64_I_TYPE] == np.int64
    assert types[aicapi.INT8_TYPE] == np.int8


def test_manifest_records_placement(lowered):
    options = load_manifest(lowered("agree_b8")[0]).lowering.options
    assert (options["target_cores"], options["draft_cores"], options["target_devices"]) == (12, 4, "0")
