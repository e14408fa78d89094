"""DFlash on ONNX Runtime against HF greedy generate and the reference `dflash_generate`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import (  # skips the module when the oracle is missing
    DFlashDraftModel,
    dflash_model,
)
from transformers import AutoModelForCausalLM

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.runtime.runners import KVState


def _reference(pair, prompt, max_new_tokens, stops):
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(str(pair.draft_dir)).eval()
    out = dflash_model.dflash_generate(draft, target, torch.tensor(prompt)[None], max_new_tokens, stops,
                                       return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), out.acceptance_lengths


def _hf_greedy(pair, prompt, max_new_tokens, stops):
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), attn_implementation="sdpa").eval()
    ids = torch.tensor(prompt)[None]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=stops or None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _full_block_steps(prompt_len, max_new_tokens, block, lengths):
    """How many leading steps drafted a whole block (the reference drafts a shorter block at the tail)."""
    start, count = prompt_len, 0
    for produced in lengths:
        if prompt_len + max_new_tokens - start < block:
            break
        start += produced
        count += 1
    return count


def _prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab - 1, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", ["agree_b8", "causal_gqa4_b4", "llama_sliding_b16", "agree_b2"])
def test_dflash_ort_equals_reference_tokens_and_acceptance(name, exported, decoders):
    pair, decoder = exported(name), decoders(name)
    target = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), attn_implementation="sdpa").eval()
    draft = DFlashDraftModel.from_pretrained(str(pair.draft_dir)).eval()
    block = pair.spec.block_size
    all_lengths = []
    for prompt in _prompts(20, pair.spec.vocab_size, seed=len(name)):
        ref = dflash_model.dflash_generate(draft, target, torch.tensor(prompt)[None], 40, None, return_stats=True)
        ours = decoder.generate(prompt, 40, "dflash", stop_token_ids=[])
        assert ours.tokens == ref.output_ids[0, len(prompt):].tolist()
        steps = _full_block_steps(len(prompt), 40, block, ours.acceptance_lengths)
        assert ours.acceptance_lengths[:steps] == ref.acceptance_lengths[:steps]
        if pair.spec.is_causal:  # a causal draft's first positions ignore the padding: the tail matches too
            assert ours.acceptance_lengths == ref.acceptance_lengths
        all_lengths += ours.acceptance_lengths
    if name.startswith("agree"):  # lengths span 1..block, full blocks included
        assert set(all_lengths) == set(range(1, block + 1)), f"acceptance lengths {sorted(set(all_lengths))}"
    elif pair.spec.agree:
        assert max(all_lengths) >= block // 2, f"acceptance lengths {sorted(set(all_lengths))}"


@pytest.mark.parametrize("name", ["agree_b8", "llama_sliding_b16"])
def test_both_modes_equal_hf_greedy(name, exported, decoders):
    pair, decoder = exported(name), decoders(name)
    for prompt in _prompts(4, pair.spec.vocab_size, seed=11):
        hf = _hf_greedy(pair, prompt, 24, [])
        assert decoder.generate(prompt, 24, "greedy", stop_token_ids=[]).tokens == hf
        assert decoder.generate(prompt, 24, "dflash", stop_token_ids=[]).tokens == hf


def test_prompt_token_equal_to_pad_id_is_not_masked(exported, decoders):
    pair, decoder = exported("agree_b8"), decoders("agree_b8")
    prompt = [0, 5, 0, 9]  # 0 is the pad id: HF needs the explicit attention_mask the oracle passes
    assert decoder.generate(prompt, 16, "dflash", stop_token_ids=[]).tokens == _hf_greedy(pair, prompt, 16, [])


def test_stop_token_inside_accepted_run(exported, decoders):
    pair, decoder = exported("agree_b8"), decoders("agree_b8")
    favourite = pair.spec.favourite_token
    hits = truncated = 0
    for prompt in _prompts(12, pair.spec.vocab_size, seed=5):
        free = decoder.generate(prompt, 30, "dflash", stop_token_ids=[])
        if favourite not in free.tokens[1:]:
            continue
        ours = decoder.generate(prompt, 30, "dflash", stop_token_ids=[favourite])
        ref_tokens, ref_lengths = _reference(pair, prompt, 30, [favourite])
        assert ours.tokens == ref_tokens == _hf_greedy(pair, prompt, 30, [favourite])
        assert ours.tokens[-1] == favourite and ours.stopped
        assert ours.acceptance_lengths == ref_lengths
        step = len(ours.acceptance_lengths) - 1
        if step >= 0:  # stop cut the step short of what the free run committed
            truncated += ours.acceptance_lengths[step] < free.acceptance_lengths[step]
        hits += 1
    assert hits >= 3 and truncated >= 1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_budgets_smaller_than_a_block_and_one_token_prompts(max_new_tokens, exported, decoders):
    pair, decoder = exported("agree_b8"), decoders("agree_b8")
    for prompt in ([5], [40, 41, 42]):
        ours = decoder.generate(prompt, max_new_tokens, "dflash", stop_token_ids=[])
        ref_tokens, _ = _reference(pair, prompt, max_new_tokens, None)
        assert ours.tokens == ref_tokens == _hf_greedy(pair, prompt, max_new_tokens, [])
        assert len(ours.tokens) == max_new_tokens


def test_bad_generation_arguments(decoders):
    decoder = decoders("agree_b8")
    with pytest.raises(DFlashError, match="empty"):
        decoder.generate([], 4)
    with pytest.raises(DFlashError, match="max_new_tokens"):
        decoder.generate([3], 0)
    with pytest.raises(DFlashError, match="prompt ids"):
        decoder.generate([10_000], 4)
    with pytest.raises(DFlashError, match="mode"):
        decoder.generate([3], 4, mode="beam")


def test_kv_feeds_are_zero_copy_views(decoders):
    """Rollback is a length change: the committed prefix is fed back without copying."""
    decoder = decoders("agree_b8")
    kv = KVState(decoder.manifest.target, lambda heads, dim: (1, 0, heads, dim), np.float32)
    present = {name: np.random.rand(1, 9, 2, 16).astype(np.float32) for name in kv.outputs}
    kv.update(present, 5)
    for name, view in kv.prefix_feeds().items():
        source = present[kv.outputs[kv.inputs.index(name)]]
        assert view.shape[1] == 5 and view.flags.c_contiguous and np.shares_memory(view, source)


def test_kv_outputs_are_paired_with_inputs_by_name(decoders):
    import dataclasses

    graph = decoders("agree_b8").manifest.target
    shuffled = dataclasses.replace(graph, outputs=list(reversed(graph.outputs)))
    kv = KVState(shuffled, lambda heads, dim: (1, 0, heads, dim), np.float32)
    assert all(o == i.replace("past_key_values", "present") for i, o in zip(kv.inputs, kv.outputs))
    broken = dataclasses.replace(graph, outputs=[t for t in graph.outputs if t.name != "present.0.value"])
    with pytest.raises(DFlashError, match="present.0.value"):
        KVState(broken, lambda heads, dim: (1, 0, heads, dim), np.float32)


def test_chunked_prefill_changes_nothing(exported, decoders):
    from dflash_onnx.targets import open_decoder

    pair, whole = exported("agree_b8"), decoders("agree_b8")
    chunked = open_decoder(pair.out, prefill_chunk=3)
    for prompt in _prompts(5, pair.spec.vocab_size, seed=21):
        a = whole.generate(prompt, 20, "dflash", stop_token_ids=[])
        b = chunked.generate(prompt, 20, "dflash", stop_token_ids=[])
        assert (a.tokens, a.acceptance_lengths) == (b.tokens, b.acceptance_lengths)


def test_streaming_yields_what_generate_returns(decoders):
    decoder = decoders("agree_b8")
    chunks = []
    result = decoder.generate([3, 4, 5], 20, "dflash", stop_token_ids=[], on_tokens=chunks.append)
    assert [t for c in chunks for t in c] == result.tokens
    assert [len(c) for c in chunks[1:]] == result.acceptance_lengths
    stream = decoder.stream([3, 4, 5], 20, "dflash", stop_token_ids=[])
    assert [t for c in stream for t in c] == result.tokens


def test_time_spent_by_the_stream_consumer_is_not_decode_time(decoders, monkeypatch):
    import time as real_time

    import dflash_onnx.runtime.decode as decode_module

    class Clock:  # real time plus whatever the consumer "spends"
        offset = 0.0

        @classmethod
        def perf_counter(cls):
            return real_time.perf_counter() + cls.offset

    def slow_consumer(_chunk):
        Clock.offset += 10.0

    monkeypatch.setattr(decode_module, "time", Clock)
    result = decoders("agree_b8").generate([3, 4, 5], 12, "greedy", stop_token_ids=[], on_tokens=slow_consumer)
    assert result.decode_s < 10.0 and result.ttft_s < 10.0
