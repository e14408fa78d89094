"""Faults the equality tests must catch: each test here plants one deliberate fault in a hot path (by monkeypatch, for
the test's length only), runs the test meant to catch it, and expects that test to fail. An equality test whose
pairs emit one token whatever the prompt, or whose draft is always right, would let these pass; the pairs whose
output depends on the prompt and whose drafts are accepted in part (conftest.VARIED) do not.

- a request's K/V left to its neighbour when a slot moves (OrtBatchSession.move_slot): caught by test_batching's
  each-request-decodes-as-alone;
- position ids one off after the prompt (runners' BufferTarget): caught by test_ort_lowering's lowered pair decoding
  the export's greedy tokens, and by the lowering's own check where it lowers with the fault in place;
- a rejected token's K/V kept (BufferTarget.commit): caught by the same lowering test;
- a sliding window one row too wide (the kv-buffer rewrite's local_window_size): caught by the lowering's check,
  which test_ort_lowering's sliding-window test runs;
- an expert's int4 nibbles swapped, and its scales written transposed ([blocks, rows] read as [rows, blocks]), by
  the MoE quantization (passes/experts.py QuantizedExperts): caught by test_moe_oracle's numpy dequantization;
- the same faults in Gemma 4's routed experts (passes/routed_experts.py, which writes through QuantizedExperts too):
  nibbles swapped in the two-QMoE int4 form and in the GatherBlockQuantized int4 form, scales transposed in int8;
  caught by test_routed_experts_oracle's numpy dequantization.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import test_batching
import test_moe_oracle
import test_ort_lowering
import test_routed_experts_oracle
from test_batching import ragged  # noqa: F401  the fixture the batching test takes

import dflash_onnx.passes.experts as experts
import dflash_onnx.runtime.runners as runners
import dflash_onnx.targets.ort.lower as ort_lower
from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.targets.ort.batch_session import OrtBatchSession


def test_kv_left_to_the_neighbour_when_a_slot_moves_is_caught(ragged, monkeypatch):  # noqa: F811
    """When a request leaves, the last slot's request moves into its slot with its K/V; without the copy it decodes
    on the K/V the departed request left there."""
    monkeypatch.setattr(OrtBatchSession, "move_slot", lambda self, source, dest: None)
    with pytest.raises(AssertionError):
        test_batching.test_each_request_decodes_as_it_does_alone(ragged, "varied_b4")


def test_positions_one_off_after_the_prompt_are_caught(exported, decoders, ort_lowered, monkeypatch):
    """Every decode and verify step's position ids one ahead of its tokens' (RoPE rotates them as the next ones);
    the K/V rows are written where they belong."""
    original = runners._padded_positions

    def shifted(positions, padded_rows):
        return original(positions + 1 if positions[0, 0] > 0 else positions, padded_rows)

    ort_lowered("varied_b4")  # lowered (and checked) before the fault: the decoding is what must catch it
    monkeypatch.setattr(runners, "_padded_positions", shifted)
    with pytest.raises(AssertionError):
        test_ort_lowering.test_lowered_pair_decodes_the_exports_greedy_tokens("varied_b4", exported, decoders,
                                                                              ort_lowered)


def test_a_rejected_tokens_kv_kept_is_caught(exported, decoders, ort_lowered, monkeypatch):
    """A verify step's rejected rows stay in the cache: commit keeps every row the last call wrote, so the next
    step's tokens sit after K/V the output never had."""
    original_call = runners.BufferTarget._call

    def recording(self, ids, start, logits):
        self.written = start + len(ids)
        return original_call(self, ids, start, logits)

    def keep_everything(self, length):
        self.length = max(length, getattr(self, "written", length))

    ort_lowered("varied_b4")
    monkeypatch.setattr(runners.BufferTarget, "_call", recording)
    monkeypatch.setattr(runners.BufferTarget, "commit", keep_everything)
    with pytest.raises(AssertionError):
        test_ort_lowering.test_lowered_pair_decodes_the_exports_greedy_tokens("varied_b4", exported, decoders,
                                                                              ort_lowered)


def test_a_window_one_row_too_wide_is_caught(exported, tmp_path, monkeypatch):
    """The ORT lowering's GroupQueryAttention given local_window_size one wider than the export's window."""
    original = ort_lower.start_lowering

    def widened(*args, **kwargs):
        manifest, checkpoints = original(*args, **kwargs)
        windows = [w + 1 if w else 0 for w in manifest.target.kv_windows]
        return replace(manifest, target=replace(manifest.target, kv_windows=windows)), checkpoints

    monkeypatch.setattr(ort_lower, "start_lowering", widened)
    with pytest.raises(DFlashError, match="changes target logits"):
        test_ort_lowering.test_sliding_window_layers_get_their_window_in_the_buffer_form(exported, tmp_path)


def _planted(monkeypatch, fault) -> None:
    """QuantizedExperts writes `fault(packed, scales)` instead of what it computed."""
    original = experts.QuantizedExperts._quantize

    def faulty(self):
        arrays = original(self)
        arrays[0], arrays[1] = fault(arrays[0], arrays[1])
        return arrays

    monkeypatch.setattr(experts.QuantizedExperts, "_quantize", faulty)


def _swapped(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return ((packed & 0x0F) << 4) | (packed >> 4), scales


def _transposed(packed: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales laid out [experts, blocks, rows], read as [experts, rows, blocks]."""
    return packed, np.ascontiguousarray(scales.transpose(0, 2, 1)).reshape(scales.shape)


FAULTS = {"nibbles swapped": _swapped, "scales transposed": _transposed}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_experts_packing_fault_is_caught(exported, tmp_path, monkeypatch, fault):
    _planted(monkeypatch, FAULTS[fault])
    source = exported(test_moe_oracle.PAIR).out
    out = test_moe_oracle.quantize_experts(source, tmp_path / "int4", 4)
    with pytest.raises(AssertionError):
        test_moe_oracle.check_expert_weights(source, out, 4)


@pytest.mark.parametrize(("form", "fault"), [("int4", "nibbles swapped"), ("int4-gathered", "nibbles swapped"),
                                             ("int8", "scales transposed")])
def test_a_routed_experts_packing_fault_is_caught(exported, tmp_path, monkeypatch, form, fault):
    """Gemma 4's experts, written with the fault in each form their quantization takes."""
    _planted(monkeypatch, FAULTS[fault])
    source = exported(test_routed_experts_oracle.PAIR).out
    out = test_routed_experts_oracle.quantize(source, tmp_path / form, form)
    with pytest.raises(AssertionError, match="experts"):
        test_routed_experts_oracle.check_routed_experts(source, out, form)
