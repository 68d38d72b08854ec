"""Sliding-window decode on the CPU paths: on 'ragged' a windowed layer gathers only the pages its
window touches (a flat bucket of rows * (ceil(window / page_size) + 1) pages, not every live page);
the C++ kernel ('cpu_kernel') starts each row at its window's first page. Both engines' greedy
tokens equal the reference attention's, far beyond the window."""

from __future__ import annotations

import dataclasses

from jaxserve import LLM, SamplingParams
from jaxserve.config import PRESETS
from jaxserve.runner import steps

# Every layer slides with a window of 8 over 4-token pages (Mistral's layout, scaled down).
WINDOWED = dataclasses.replace(PRESETS["tiny"], name="tiny-window", sliding_window=8)


def test_window_flat_bucket_follows_the_window():
    assert steps._window_flat(WINDOWED, rows=8, num_flat=256, ps=4) == 8 * 3
    assert steps._window_flat(WINDOWED, rows=8, num_flat=16, ps=4) == 16  # never above all pages
    assert steps._window_flat(PRESETS["tiny"], rows=8, num_flat=256, ps=4) == 0  # no window


def test_cpu_windowed_decode_equals_the_reference():
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 120 + 3 for j in range(40 + 9 * i)]} for i in range(3)
    ]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(load_format="dummy", dtype="float32", num_slots=4, max_model_len=128, page_size=4)
    outs = {
        impl: [
            o.outputs[0].token_ids
            for o in LLM(WINDOWED, attention_impl=impl, **kw).generate(prompts, sp, use_tqdm=False)
        ]
        for impl in ("cpu_kernel", "ragged", "reference")
    }
    assert outs["cpu_kernel"] == outs["ragged"] == outs["reference"]
    assert all(len(t) == 24 for t in outs["ragged"])
