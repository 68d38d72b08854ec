"""The prepared GPU scripts run end to end in their --smoke mode (tiny shapes, interpret mode).

A lent H100 / H200 gives a session 15 minutes; a script that breaks there wastes them. These runs
keep `experiments/gpu_int4.py`, `gpu_kernels.py`, `gpu_quant_matmul.py`, `gpu_moe.py`, `gpu_tp.py`
and `gpu_decode.py` working on the CPU between loans: every step runs (checks, timings, tables, JSON), only the shapes
and the backend differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# XLA's CPU backend at LLVM -O0 (gpu_tp.py adds its device count to these flags): compiling is
# most of a smoke run's time, and -O0 leaves every program's HLO unchanged; each script's checks
# compare programs compiled alike, in the same run.
XLA_FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
ENV = {**os.environ, "XLA_FLAGS": XLA_FLAGS}


def smoke(script: str, tmp_path, *flags: str) -> dict:
    """experiments/<script> --smoke [flags] --out tmp_path (exit 0), and the JSON it wrote."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / script),
            "--smoke",
            *flags,
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / script.replace(".py", ".json")).read_text())


@pytest.mark.parametrize(
    "script,checks",
    [
        ("gpu_int4.py", ("check", "stack")),
        ("gpu_kernels.py", ("correctness", "large_pools")),
        # Mosaic GPU W4A16 / W8A16 beside Triton, bf16 and (INT4) XLA's own int4 dot
        ("gpu_quant_matmul.py", ("rows",)),
        # a mixture of experts' layer: the tiled kernels vs ragged_dot, quantized and bf16
        ("gpu_moe.py", ("rows",)),
    ],
)
def test_gpu_script_smoke(tmp_path, script, checks):
    out = smoke(script, tmp_path)
    assert out["smoke"] is True
    for part in checks:  # each check row says ok (or, for the stack timing, the same output)
        assert out[part] and all(c.get("ok", c.get("same")) for c in out[part]), part
    if script == "gpu_kernels.py":  # the Mosaic GPU kernels timed beside Triton's, checked
        for kind in ("decode", "prefill"):
            mosaic = [r for r in out[kind] if "mgpu_us" in r]
            assert mosaic and all(r["mgpu_ok"] for r in mosaic), out[kind]
            assert all(r["kernel_ok"] for r in out[kind]), out[kind]  # Triton's, at each timed row
            # cuDNN's row: skipped with its reason on the CPU (never timed there); for bf16 KV
            # the pool, page table and mask converted to cuDNN's layout give the reference's
            # output under cuDNN's documented semantics (emulated in jnp)
            for r in out[kind]:
                assert "cudnn_us" not in r and "cudnn_ok" not in r, r
                if r["kv"] == "bf16":
                    assert r["cudnn_skipped"].startswith("no CUDA GPU"), r
                    assert r["cudnn_inputs_ok"], r["cudnn_inputs_max_abs_err"]
                else:
                    assert "f16/bf16 K/V only" in r["cudnn_skipped"], r
    if script == "gpu_quant_matmul.py":  # XLA-native INT4 beside the INT4 kernels, checked
        for r in out["rows"]:
            if r["kind"] == "int4":
                assert r["xla_int4_rel_err"] < 2e-2, r
                assert r["xla_int4_us"] > 0 and r["xla_int4_noflag_us"] > 0, r
            else:
                assert "xla_int4_us" not in r, r
            # the engine's XLA path on the same stack: the third candidate of the kernel table
            assert r["xla_us"] > 0 and r["mosaic_ok"] and r["triton_ok"] and r["xla_ok"], r
    if script == "gpu_moe.py":  # every path checked against the reference, then timed
        got = {(r["fmt"], r["tokens"]): r["tile"] for r in out["rows"]}
        # 4 experts, top 2: 16 pairs take 16-row tiles; 256 pairs take FP8's 64-row tiles, but
        # INT4's kernel takes 16 rows, and 20 tiles are past MAX_TILES_PER_EXPERT: the engine's
        # path is then ragged_dot, and kernel_any lifts the cutoff
        assert got == {("int4", 8): 16, ("fp8", 8): 16, ("int4", 128): None, ("fp8", 128): 64}
        for r in out["rows"]:
            names = ("kernel", "kernel_any", "ragged", "bf16")
            assert all(r[f"{name}_us"] > 0 for name in names), r
    if script in ("gpu_kernels.py", "gpu_quant_matmul.py"):
        assert_reduced(tmp_path, script)


def test_a_failing_candidate_is_its_rows_result_not_the_runs_end(tmp_path, monkeypatch):
    """gpu_quant_matmul.py on a GPU times kernels never run there before (the Mosaic W4A16 /
    W8A16 kernels): one that fails to compile or run is recorded in its row (its error, ok false,
    no time) and the others are still timed; the run goes on, and the kernel table is still
    proposed from what ran (the failed candidate is not chosen)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import gpu_quant_matmul as script
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    real = script.kernels

    def kernels(kind, interpret):
        mosaic, *rest = real(kind, interpret)

        def broken(x, *args):
            raise RuntimeError("Mosaic GPU: no such instruction (a stand-in for a GPU failure)")

        return (broken, *rest)

    monkeypatch.setattr(script, "kernels", kernels)
    monkeypatch.setattr(sys, "argv", ["gpu_quant_matmul.py", "--smoke", "--out", str(tmp_path)])
    assert script.main() == 1  # not every candidate was right
    out = json.loads((tmp_path / "gpu_quant_matmul.json").read_text())
    assert [r["kind"] for r in out["rows"]] == list(script.KINDS)
    for r in out["rows"]:
        assert r["mosaic_error"].startswith("RuntimeError: Mosaic GPU") and not r["mosaic_ok"], r
        assert "mosaic_us" not in r and r["mosaic_vs_triton"] is None, r
        assert r["triton_ok"] and r["xla_ok"] and r["triton_us"] > 0 and r["xla_us"] > 0, r
    assert "| failed |" in (tmp_path / "gpu_quant_matmul.md").read_text()
    from jaxserve.bench import kernel_choices
    from jaxserve.config import gpu_choices

    samples = kernel_choices.matmul_samples(out)
    assert len(samples) == 3 and all("mgpu" not in s.us for s in samples), samples
    proposed = kernel_choices.propose(gpu_choices.load(), samples, "default", "smoke", False)
    chosen = {
        c.candidate for c in proposed if c.chip == "default" and c.op in gpu_choices.MATMUL_OPS
    }
    assert "mgpu" not in chosen, chosen


def test_a_failing_mosaic_attention_kernel_is_its_rows_result(monkeypatch):
    """gpu_kernels.py's timings go on when a Mosaic GPU attention kernel fails on the device: its
    row says why (mgpu_ok false, no time), Triton's and XLA's figures stay, and the markdown
    names the failure."""
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import gpu_kernels as script
    finally:
        sys.path.remove(str(ROOT / "experiments"))

    def broken(*args, **kwargs):
        raise RuntimeError("Mosaic GPU: barrier error (a stand-in for a GPU failure)")

    monkeypatch.setattr(script, "paged_attention_mgpu", broken)
    monkeypatch.setattr(script, "paged_prefill_mgpu", broken)
    deadline = time.monotonic() + 600
    res = dict(decode=script.bench_decode([2], [64], [16], True, deadline, 10.0))
    res["prefill"] = script.bench_prefill(1, 16, [64], True, deadline)
    failed = [r for r in res["decode"] + res["prefill"] if "mgpu_error" in r]
    assert {r["kernel"] for r in failed} == {"decode", "prefill"}, res
    for r in failed:
        assert r["mgpu_error"].startswith("RuntimeError: Mosaic GPU") and not r["mgpu_ok"], r
        assert "mgpu_us" not in r and r["kernel_us"] > 0 and r["xla_ref_us"] > 0, r
    whole = dict(device="cpu", jax="", kv_bytes_per_token=script.kv_bytes_per_token())
    res |= dict(correctness=[], large_pools=[], copy_gbs=10.0)
    text = script.markdown(whole | res | dict(targets=script.targets(res["decode"], 10.0)))
    assert "Mosaic GPU decode failed at batch 2" in text
    from jaxserve.bench import kernel_choices

    samples = kernel_choices.attention_samples(res)
    assert samples and all("mgpu" not in s.us and "pallas" in s.us for s in samples), samples


def assert_reduced(out_dir, script):
    """The smoke run's JSON through `python -m jaxserve.bench.kernel_choices`: a table the engine
    can run, from its "default" chip (the CPU's device kind), with no row measured."""
    from jaxserve.config import gpu_choices

    md = out_dir / "kernel_choices.md"
    cmd = [sys.executable, "-m", "jaxserve.bench.kernel_choices", str(out_dir), "--table", str(md)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proposed = gpu_choices.parse(proc.stdout, "the proposed table")
    assert not any(c.measured for c in proposed)
    ops = gpu_choices.ATTENTION_OPS if script == "gpu_kernels.py" else gpu_choices.MATMUL_OPS
    timed = [c for c in proposed if c.chip == "default" and c.op in ops and "smoke" in c.source]
    assert timed and all("cpu (default) run of " in c.source for c in timed), timed
    candidates = {line.split(" | ")[2] for line in md.read_text().splitlines()[2:]}
    engine = {"pallas", "mgpu", "reference" if script == "gpu_kernels.py" else "xla"}
    assert engine <= candidates, candidates


def test_gpu_tp_smoke(tmp_path):
    """experiments/gpu_tp.py on 4 host CPU devices (it sets the flag itself): the TP 2 and TP 4
    decode steps (4 replicating the tiny model's 2 KV heads) give TP 1's tokens, and every
    timing row (f32 and INT4 at TP 1 and 2, against the narrow one-device model) runs."""
    out = smoke("gpu_tp.py", tmp_path)
    assert out["smoke"] is True and out["devices"] == 4
    assert [r["tp"] for r in out["correctness"]] == [1, 2, 4]
    assert all(r["ok"] and r["tokens_equal"] for r in out["correctness"]), out["correctness"]
    timed = [r for r in out["timing"] if "skipped" not in r]
    assert {(r["weights"], r["tp"]) for r in timed} == {
        (w, t) for w in ("float32", "int4") for t in (1, 2)
    }
    assert all(r["step_ms"] > 0 and r["roofline_ms"] > 0 for r in timed)
    assert all("narrow_step_ms" in r for r in timed if r["tp"] > 1)


def test_gpu_decode_smoke(tmp_path):
    """experiments/gpu_decode.py: the engine's decode step (decode_forward + decode_sample) of the
    tiny preset, bf16 (fused q/k/v and gate/up stacks, and separate), INT4 and INT8, under the
    engine's XLA options, the same without the layer loop unrolled into its CUDA graph, and XLA's
    defaults, with the same greedy tokens from all three; the profile path reduces the CPU trace
    to its table; no GPU target config on the CPU, said so."""
    out = smoke("gpu_decode.py", tmp_path, "--profile")
    assert out["smoke"] is True and "meaningless" in out["note"]
    assert "skipped" in out["target_config"]
    rows = {r["weights"]: r for r in out["cases"]}
    assert set(rows) == {"bf16", "bf16-sep", "int4", "int8", "int4-k64"}, out["cases"]
    assert rows["bf16"]["weight_bytes"] == rows["bf16-sep"]["weight_bytes"]  # one layout each
    for w, r in rows.items():
        for v in ("engine", "no_unroll", "xla_default"):
            assert r[v]["step_ms"] > 0 and len(r[v]["step_ms_runs"]) == out["spec"]["repeats"], w
        assert r["options"]["xla_default"] == {}
        engine, no_unroll = r["options"]["engine"], r["options"]["no_unroll"]
        assert engine.pop("xla_gpu_command_buffer_unroll_loops") == "True" and engine == no_unroll
        assert r["tokens_match"] and r["first_tokens_match"], (w, r["logits_max_rel_diff"])
    # the engine's options: CUDA graphs for both, and cuBLAS GEMMs for the float weights only
    assert "xla_gpu_enable_command_buffer" in rows["int4"]["options"]["engine"]
    assert "xla_gpu_enable_triton_gemm" not in rows["int4"]["options"]["engine"]
    assert rows["bf16"]["options"]["engine"]["xla_gpu_enable_triton_gemm"] == "False"
    prof = out["profile"]
    assert prof["kernels"] and prof["options"]["xla_enable_command_buffers_during_profiling"]
    assert (tmp_path / "profile_kernels.md").is_file() and (tmp_path / "gpu_decode.md").is_file()
