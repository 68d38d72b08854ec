"""GPU check and benchmark of the paged-attention kernels (one prepared script, < 8 min on an H200).

    python experiments/gpu_kernels.py [--out DIR]        # on the GPU machine; DIR defaults to $OUT
    python experiments/gpu_kernels.py --smoke            # tiny shapes, interpret mode, any CPU

Steps, each printed and written to DIR/gpu_kernels.json and DIR/gpu_kernels.md:

1. KV bytes per token (Llama-3-8B, 32 layers x 8 KV heads x 128), from the arrays `kv_cache.init`
   allocates: bf16 vs int8 vs fp8 (scales included) -- quantized should be about half.
2. Copy bandwidth: a jitted `x + 1` over a large u32 buffer (read + write), the ceiling decode can reach.
3. Correctness on the device: decode and prefill kernels against `prefill_reference` for
   f32/bf16 queries x auto/int8/fp8 KV x page 16/32, ragged lengths (0, 1, ps-1, ps, ps+1, max) and
   chunk offsets (0, 1, mid-page), random permuted page tables.
3b. Pools past 2^31 elements, pages at the pool's far end, decode and prefill against the reference:
   a 3 GiB int8 pool (Pallas' Triton lowering computes offsets in 32 bits for arrays up to 4 GiB,
   and Triton's offsets are signed, so a 1-byte array of 2-4 GiB is the case at risk) and a 5 GiB
   bf16 pool (64-bit offsets). Smoke mode runs the same code on tiny pools.
4. Decode timings at Llama-3-8B attention shapes (32 q heads, 8 KV heads, head_dim 128): batch
   8/64/256 x context 512/4096/8192 x page 16/32 x bf16/int8/fp8 KV, one layer of the pool; the
   Triton kernel, the Mosaic GPU kernel (`mgpu_decode.py`, issue 55: its output checked
   against the reference too), the XLA reference (gather + einsum) and cuDNN's paged attention
   (jax's `cudnn.fused_attention_stablehlo.paged_attention`, bf16 KV only: its output checked
   against the reference, then timed), timed in turn in this process; achieved GB/s of KV read
   beside the copy bandwidth.
5. Prefill timings: batch 8 x 256-token chunks at the end of 512/4096-token contexts; the Triton
   kernel, the Mosaic GPU kernel (`mgpu_prefill.py`, its output checked against the
   reference), the XLA reference and cuDNN (bf16 KV; the chunk's causal mask as a bias, below).
6. Targets from the issue: decode at batch 64 x 4096 >= 70% of copy bandwidth and >= 3x the XLA
   reference; int8/fp8 KV >= 1.6x faster than bf16 KV at the same shape.

Every time is per call on the device: the op runs N times inside one jitted fori_loop
(`jaxserve.bench.device_loop`, N from one host-timed call so a loop lasts ~0.1 s), so the host's
dispatch and launch are not in it. A wall-clock budget (--budget_s, default 420 s) skips the
remaining timing configurations rather than overrun; skipped rows are marked, and so is a candidate
that cannot run (cuDNN on a CPU or with int8/fp8 KV: `cudnn_skipped` says why). Each timed row
checks its candidates' outputs against the reference's (`kernel_ok`, `mgpu_ok`, `cudnn_ok`), and
`python -m jaxserve.bench.kernel_choices DIR` turns the JSON into the GPU kernel table's proposed
rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import paged_attention as cudnn_paged_attention

from jaxserve.bench.device_loop import seconds_per_call
from jaxserve.layers import kv_cache as kvc
from pallas_kernels.attention.mgpu_decode import paged_attention_mgpu
from pallas_kernels.attention.mgpu_prefill import paged_prefill_mgpu
from pallas_kernels.attention.paged_kv import PagedKV
from pallas_kernels.attention.reference import prefill_reference
from pallas_kernels.attention.triton_decode import paged_attention
from pallas_kernels.attention.triton_prefill import paged_prefill_attention

log = logging.getLogger("gpu_kernels")
H, KVH, D = 32, 8, 128  # Llama-3-8B attention
KV_DTYPES = ("bf16", "int8", "fp8")
KV_CACHE_DTYPE = {"bf16": "auto", "int8": "int8", "fp8": "fp8"}


def timeit(fn, *args, min_time=0.1, max_iters=200):
    """Seconds per call on the device: fn(*args) N times inside one jitted fori_loop
    (`device_loop`: nothing hoisted out of it, no host launch per call), best of 2 runs. N comes
    from one host-timed call (which overstates a short kernel's time, so N errs low: at least 2)."""
    jax.block_until_ready(fn(*args))  # compiled, warm
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - t0
    iters = int(min(max_iters, max(2, min_time / max(once, 1e-6))))
    return seconds_per_call(fn, args, iters, repeats=2)


def mosaic_call(fn, args, ref_out, interpret: bool) -> tuple[float, float]:
    """(seconds per call, max abs error against the reference's output) of a Mosaic GPU kernel:
    timed on a GPU; interpreted, one call's wall time (the smoke run's figure)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    seconds = time.perf_counter() - t0
    err = float(jnp.max(jnp.abs(out - ref_out).astype(jnp.float32)))
    return (seconds if interpret else timeit(fn, *args)), err


def random_pool(key, layers, pages, ps, kv, kvh=KVH, d=D):
    """(k, v, k_scale, v_scale) of a random pool in the KV dtype `kv`, made on the device."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    shape = (layers, kvh, pages, ps, d)
    if kv == "bf16":
        return (
            jax.random.normal(k1, shape, jnp.bfloat16),
            jax.random.normal(k2, shape, jnp.bfloat16),
            None,
            None,
        )
    if kv == "int8":
        k = jax.random.randint(k1, shape, -127, 128, jnp.int8)
        v = jax.random.randint(k2, shape, -127, 128, jnp.int8)
    else:
        # e4m3fn has no inf: values past +-448 would become NaN, so clip.
        k = jnp.clip(jax.random.normal(k1, shape) * 100, -448, 448).astype(kvc.FP8_DTYPE)
        v = jnp.clip(jax.random.normal(k2, shape) * 100, -448, 448).astype(kvc.FP8_DTYPE)
    ks = jax.random.uniform(k3, shape[:-1], jnp.float32, 0.005, 0.02)
    vs = jax.random.uniform(k4, shape[:-1], jnp.float32, 0.005, 0.02)
    return k, v, ks, vs


def page_table(key, batch, width, pages):
    return (
        jax.random.permutation(key, pages)[: batch * width].reshape(batch, width).astype(jnp.int32)
    )


# cuDNN's paged attention (jax 0.11.2: `jax._src.cudnn.fused_attention_stablehlo.paged_attention`,
# an XLA `__cudnn$fmhaSoftmax` custom call whose cuDNN graph XLA builds when it compiles for a
# device). What it takes, and so what the rows below convert outside the timed region:
# - K and V as [num_blocks, block_size, KVH, D] (qkv_layout "BTNH"; or [num_blocks, KVH,
#   block_size, D] for "BNTH"): one layer's pages, page-major. The engine's pool is
#   [L, KVH, P, ps, D] (head-major, the layout its kernels read), so each row transposes layer 0 to
#   [P, ps, KVH, D]. The engine could hold its pool that way (vLLM's flash-attention layout) only
#   by changing every kernel's indexing and the K/V scatter, and jax's wrapper also requires
#   num_blocks == B * pages-per-row (its `check_layout`): a pool shared by all slots, larger than
#   the batch's tables, is refused, so the bench's pools hold exactly B * W pages.
# - page tables i32[B, 1, W, 1], one for K and one for V (the same here); q_seqlen and kv_seqlen
#   i32[B]; f16/bf16 K/V only ("Paged attention doesn't support fp8 for now"; no int8, no scales).
# - masks: padding (the seq lens) and top-left causal only. Decode (T = 1) needs only the padding
#   mask. A prefill chunk at the end of its context needs bottom-right causal alignment, which
#   jax's wrapper does not offer: its mask goes in as a bf16 bias [B, 1, T, W*ps] (0 / -2^41),
#   built outside the timed region and read by cuDNN on every call, a cost the kernels do not pay.
# XLA builds the cuDNN graph only with a device (its cuDNN compiler passes need a StreamExecutor),
# so this cannot run on a CPU, in interpret mode or deviceless: those rows say so.
CUDNN_NO_GPU = (
    "no CUDA GPU: cuDNN paged attention has no interpret mode, and XLA builds its cuDNN graph "
    "only when compiling for a device"
)
CUDNN_KV_DTYPE = "cuDNN paged attention takes f16/bf16 K/V only (no int8, no fp8 with scales)"


def cudnn_pool(k, v):
    """The engine pool's layer 0, [1, KVH, P, ps, D] -> cuDNN's [P, ps, KVH, D] ("BTNH")."""
    return k[0].transpose(1, 2, 0, 3), v[0].transpose(1, 2, 0, 3)


def cudnn_attention(q, k, v, q_lens, kv_lens, pt, bias=None):
    """q [B, T, H, D] bf16, k/v [P, ps, KVH, D] bf16, q_lens/kv_lens i32[B], pt i32[B, W], bias
    bf16[B, 1, T, W*ps] | None -> [B, T, H, D]: cuDNN's paged attention, scale 1/sqrt(D)."""
    pt4 = pt[:, None, :, None]  # (B, 1, W, 1)
    return cudnn_paged_attention(
        q,
        k,
        v,
        q_lens,
        kv_lens,
        pt4,
        pt4,
        bias,
        scale=q.shape[-1] ** -0.5,
        mask_type=MaskType.PADDING,
        qkv_layout="BTNH",
    )


def cudnn_emulated(q, k, v, q_lens, kv_lens, pt, bias=None):
    """cuDNN's paged attention by its documented contract, in jnp (f32), on cudnn_attention's
    arguments: key s of row b is k[pt[b, s // ps], s % ps]; keys s >= kv_lens[b] and queries
    t >= q_lens[b] are padding; the bias is added to the scaled logits. The CPU check that the
    rows hand cuDNN the pool, table and mask the reference sees (cuDNN itself needs the GPU)."""
    b, t, h, d = q.shape
    _, ps, kvh, _ = k.shape
    s_len = pt.shape[1] * ps
    keys = k[pt].reshape(b, s_len, kvh, d).astype(jnp.float32)  # (B, S, KVH, D)
    values = v[pt].reshape(b, s_len, kvh, d).astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(b, t, kvh, h // kvh, d)  # (B, T, KVH, G, D)
    logits = jnp.einsum("btkgd,bskd->bkgts", qf, keys) * d**-0.5
    if bias is not None:  # (B, 1, T, S) over every head
        logits = logits + bias[:, :, None].astype(jnp.float32)
    valid = (jnp.arange(t)[:, None] < q_lens[:, None, None]) & (
        jnp.arange(s_len)[None, :] < kv_lens[:, None, None]
    )  # (B, T, S)
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    probs = jnp.nan_to_num(jax.nn.softmax(logits, axis=-1))  # a fully padded query gives zeros
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values)
    return out.reshape(b, t, h, d).astype(q.dtype)


def cudnn_row(row, op, args, ref_out, t_triton, rate, interpret, kv) -> str:
    """Checks cuDNN's output (op(*args)) against the reference's, then times it; fills the row's
    cudnn_* fields (or cudnn_skipped) and returns the printed fragment. rate(t) -> the row's
    {"gbs": ...} or {"tflops": ...} at t seconds. Without a GPU it checks the converted inputs
    (`cudnn_emulated`) instead: cudnn_inputs_max_abs_err / cudnn_inputs_ok."""
    if kv != "bf16":
        row["cudnn_skipped"] = CUDNN_KV_DTYPE
        return ""
    if interpret:
        row["cudnn_skipped"] = CUDNN_NO_GPU
        q, *rest = args
        if q.shape[1] == 1:  # decode: cudnn_decode's [B, H, D] output
            emulated = cudnn_emulated(q, *rest)[:, 0]
        else:
            emulated = cudnn_emulated(q, *rest)
        err = float(jnp.max(jnp.abs(emulated.astype(jnp.float32) - ref_out.astype(jnp.float32))))
        row.update(cudnn_inputs_max_abs_err=err, cudnn_inputs_ok=err < 0.05)
        return f"  cudnn skipped (no GPU; its inputs emulated: err {err:.1e})"
    try:  # a graph cuDNN rejects is a finding, not a reason to lose the run
        out = jax.block_until_ready(op(*args))
    except Exception as e:  # noqa: BLE001 - XLA / cuDNN raise XlaRuntimeError, ValueError, ...
        row["cudnn_skipped"] = f"failed: {type(e).__name__}: {str(e)[:400]}"
        log.warning("cuDNN paged attention failed: %s", row["cudnn_skipped"])
        return "  cudnn FAILED"
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
    row.update(cudnn_max_abs_err=err, cudnn_ok=err < 0.05)  # bf16 products, f32 softmax
    if not row["cudnn_ok"]:  # a wrong answer is not timed
        return f"  cudnn WRONG (err {err:.1e})"
    t_c = timeit(op, *args)
    row.update(cudnn_us=t_c * 1e6, cudnn_vs_triton=t_triton / t_c)
    row.update({f"cudnn_{key}": value for key, value in rate(t_c).items()})
    return f"  cudnn {t_c * 1e6:9.1f} us (x{t_triton / t_c:5.2f} vs triton, err {err:.1e})"


def kv_bytes_per_token() -> dict:
    """Bytes per token of the arrays `kv_cache.init` allocates (all 32 layers, K + V + scales)."""
    out = {}
    for kv in KV_DTYPES:
        cache = jax.eval_shape(
            lambda kv=kv: kvc.init(32, KVH, 64, 16, D, KV_CACHE_DTYPE[kv], "bfloat16")
        )
        nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
        out[kv] = nbytes / (64 * 16)
    out["int8_over_bf16"] = out["int8"] / out["bf16"]
    out["fp8_over_bf16"] = out["fp8"] / out["bf16"]
    return out


def copy_bandwidth(nbytes: int) -> float:
    """GB/s of a jitted elementwise `x + 1` over nbytes of u32 (counts read + write). u8 read
    1,696 GB/s on the H200 (JOURNAL.md 48b), far under its ~4.3 TB/s copy: too narrow a word."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda x: x + jnp.uint32(1))
    t = timeit(f, x, min_time=0.5)
    return 2 * nbytes / t / 1e9


def check_correctness(interpret: bool, small: bool) -> list[dict]:
    """Kernels vs reference on ragged batches; returns one row per configuration."""
    rows = []
    key = jax.random.key(0)
    # --smoke keeps the script's every path on CPU, not the kernels' coverage (tests/pallas_kernels
    # has that): bf16 queries only there.
    for q_dt in (jnp.bfloat16,) if small else (jnp.float32, jnp.bfloat16):
        for kv in KV_DTYPES:
            for ps in (16,) if small else (16, 32):
                kvh, g, d, w = 2, 4, 64 if small else 128, 6
                lens = jnp.asarray([0, 1, ps - 1, ps, ps + 1, w * ps], jnp.int32)
                b = lens.shape[0]
                pages = b * w + 1
                key, *ks_ = jax.random.split(key, 5)
                kv_dtype = "bf16" if kv == "bf16" and q_dt == jnp.bfloat16 else kv
                k, v, ksc, vsc = random_pool(ks_[0], 2, pages, ps, kv_dtype, kvh, d)
                if kv == "bf16" and q_dt == jnp.float32:  # 'auto' KV of an f32 model
                    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
                pt = page_table(ks_[1], b, w, pages)
                q = jax.random.normal(ks_[2], (b, kvh * g, d), jnp.float32).astype(q_dt)
                kv1 = PagedKV(k, v, ksc, vsc, 1)
                out = paged_attention(q, kv1, lens, pt, interpret=interpret)
                # The reference at full f32 ("highest": no TF32 on the GPU; JOURNAL.md 48b), so
                # an f32 error left is the kernel's own rounding.
                with jax.default_matmul_precision("highest"):
                    ref = prefill_reference(q[:, None], kv1, lens[:, None] - 1, lens, pt)
                dec_err = float(
                    jnp.max(jnp.abs(out.astype(jnp.float32) - ref[:, 0].astype(jnp.float32)))
                )
                # Prefill: offsets 0, 1, mid-page; 5 real tokens each out of a chunk of 8.
                t = 8
                starts = jnp.asarray([0, 1, ps + ps // 2, w * ps - 5, 0, 2], jnp.int32)
                counts = jnp.asarray([t, 5, t, 5, 0, t], jnp.int32)
                seq = jnp.where(counts > 0, starts + counts, 0)
                pos = starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
                qp = jax.random.normal(ks_[3], (b, t, kvh * g, d), jnp.float32).astype(q_dt)
                outp = paged_prefill_attention(qp, kv1, pos, seq, pt, interpret=interpret)
                with jax.default_matmul_precision("highest"):
                    refp = prefill_reference(qp, kv1, pos, seq, pt)
                real = (jnp.arange(t)[None, :] < counts[:, None])[..., None, None]
                pre_err = float(
                    jnp.max(
                        jnp.where(
                            real, jnp.abs(outp.astype(jnp.float32) - refp.astype(jnp.float32)), 0
                        )
                    )
                )
                # The reference's output magnitude scales with V's values (|v| up to ~2.5 for
                # quantized pools): tolerances relative to that.
                scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-6
                tol = (3e-2 if q_dt == jnp.bfloat16 else 1e-4) * max(scale, 1.0)
                ok = dec_err <= tol and pre_err <= tol and bool(jnp.all(out[0] == 0))
                rows.append(
                    dict(
                        q=jnp.dtype(q_dt).name,
                        kv=kv,
                        page_size=ps,
                        decode_max_err=dec_err,
                        prefill_max_err=pre_err,
                        tol=tol,
                        ok=ok,
                    )
                )
                print(
                    f"  correctness q={jnp.dtype(q_dt).name:8s} kv={kv:4s} ps={ps}: decode err {dec_err:.2e} "
                    f"prefill err {pre_err:.2e} (tol {tol:.1e}) {'ok' if ok else 'FAIL'}"
                )
    return rows


def check_large_pools(interpret: bool, small: bool) -> list[dict]:
    """Step 3b of the module doc: K/V pools of more than 2^31 elements, read at their far end."""
    rows = []
    kvh, g, d, ps, b, w = (2, 2, 64, 16, 2, 2) if small else (8, 4, 128, 16, 4, 4)
    cases = (
        [("int8", 1 << 20), ("bf16", 1 << 20)] if small else [("int8", 3 << 30), ("bf16", 5 << 30)]
    )
    key = jax.random.key(7)
    for kv, nbytes in cases:
        dtype = jnp.int8 if kv == "int8" else jnp.bfloat16
        pages = nbytes // (kvh * ps * d * jnp.dtype(dtype).itemsize)
        key, k1, k2, k3, k4 = jax.random.split(key, 5)
        # Only the pages the table names get values (the rest stay 0): the last b*w - 1 pages of
        # the pool, shuffled, and page 0.
        used = jnp.concatenate(
            [jnp.zeros((1,), jnp.int32), pages - 1 - jax.random.permutation(k1, b * w - 1)]
        ).astype(jnp.int32)
        vals = [jax.random.normal(kk, (1, kvh, b * w, ps, d)) for kk in (k2, k3)]
        if kv == "int8":
            vals = [jnp.clip(jnp.round(x * 40), -127, 127) for x in vals]
        k, v = (
            jnp.zeros((1, kvh, pages, ps, d), dtype).at[:, :, used].set(x.astype(dtype))
            for x in vals
        )
        ksc = vsc = None
        if kv == "int8":
            ksc = jnp.full((1, kvh, pages, ps), 0.01, jnp.float32)
            vsc = jnp.full((1, kvh, pages, ps), 0.02, jnp.float32)
        pt = used.reshape(b, w)
        lens = jnp.asarray([w * ps, w * ps - 3, ps + 1, 1][:b], jnp.int32)
        q = jax.random.normal(k4, (b, kvh * g, d), jnp.float32).astype(jnp.bfloat16)
        kv0 = PagedKV(k, v, ksc, vsc, 0)
        out = paged_attention(q, kv0, lens, pt, interpret=interpret)
        ref = prefill_reference(q[:, None], kv0, lens[:, None] - 1, lens, pt)
        dec_err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[:, 0].astype(jnp.float32))))
        t = 8  # a prefill chunk of 8 at the end of each row's length
        pos = jnp.maximum(lens[:, None] - t, 0) + jnp.arange(t, dtype=jnp.int32)[None, :]
        seq = jnp.max(pos, axis=1) + 1
        qp = jax.random.normal(k4, (b, t, kvh * g, d), jnp.float32).astype(jnp.bfloat16)
        outp = paged_prefill_attention(qp, kv0, pos, seq, pt, interpret=interpret)
        refp = prefill_reference(qp, kv0, pos, seq, pt)
        pre_err = float(jnp.max(jnp.abs(outp.astype(jnp.float32) - refp.astype(jnp.float32))))
        scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-6
        tol = 3e-2 * max(scale, 1.0)
        ok = dec_err <= tol and pre_err <= tol
        elements = kvh * pages * ps * d
        rows.append(
            dict(
                kv=kv,
                pool_bytes=elements * jnp.dtype(dtype).itemsize,
                pool_elements=elements,
                decode_max_err=dec_err,
                prefill_max_err=pre_err,
                tol=tol,
                ok=ok,
            )
        )
        print(
            f"  large pool kv={kv:4s} {elements * jnp.dtype(dtype).itemsize / 2**30:.3f} GiB "
            f"({elements / 2**31:.2f} x 2^31 elements): decode err {dec_err:.2e} prefill err "
            f"{pre_err:.2e} (tol {tol:.1e}) {'ok' if ok else 'FAIL'}"
        )
        del k, v, ksc, vsc
    return rows


def checked(out, ref_out) -> dict:
    """The Triton kernel's output at a timed row against the reference's: kernel_max_abs_err and
    kernel_ok, the Mosaic rows' tolerance (bf16 products, f32 softmax)."""
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32))))
    return dict(kernel_max_abs_err=err, kernel_ok=err < 0.05)


def decode_bytes(batch, ctx, kv) -> int:
    """KV bytes one decode step reads: K and V of every visible token and KV head (+ scales)."""
    elem = 2 if kv == "bf16" else 1
    scale = 0 if kv == "bf16" else 4
    return 2 * batch * ctx * KVH * (D * elem + scale)


@jax.jit
def cudnn_decode(q, k, v, q_lens, kv_lens, pt):
    """The decode row's cuDNN op: q [B, 1, H, D] -> [B, H, D]."""
    return cudnn_attention(q, k, v, q_lens, kv_lens, pt)[:, 0]


@jax.jit
def cudnn_prefill(q, k, v, q_lens, kv_lens, pt, bias):
    """The prefill row's cuDNN op: q [B, T, H, D] -> [B, T, H, D], the causal mask in `bias`."""
    return cudnn_attention(q, k, v, q_lens, kv_lens, pt, bias)


def _decode_rate(batch, ctx, kv, copy_gbs, t) -> dict:
    gbs = decode_bytes(batch, ctx, kv) / t / 1e9
    return dict(gbs=gbs, pct_of_copy_bw=100 * gbs / copy_gbs)


def _prefill_rate(flops, t) -> dict:
    return dict(tflops=flops / t / 1e12)


def bench_decode(batches, contexts, page_sizes, interpret, deadline, copy_gbs) -> list[dict]:
    rows = []
    key = jax.random.key(1)
    kernel = jax.jit(
        lambda q, k, v, lens, pt, ks, vs: paged_attention(
            q, PagedKV(k, v, ks, vs), lens, pt, interpret=interpret
        )
    )
    ref = jax.jit(
        lambda q, k, v, lens, pt, ks, vs: prefill_reference(
            q[:, None], PagedKV(k, v, ks, vs), lens[:, None] - 1, lens, pt
        )[:, 0]
    )
    mgpu = jax.jit(
        lambda q, k, v, lens, pt, ks, vs: paged_attention_mgpu(
            q, PagedKV(k, v, ks, vs), lens, pt, interpret=interpret
        )
    )
    for batch in batches:
        for ctx in contexts:
            for ps in page_sizes:
                for kv in KV_DTYPES:
                    row = dict(kernel="decode", batch=batch, context=ctx, page_size=ps, kv=kv)
                    rows.append(row)
                    if time.monotonic() > deadline:
                        row["skipped"] = "time budget"
                        continue
                    w = ctx // ps
                    pages = batch * w
                    key, k1, k2, k3 = jax.random.split(key, 4)
                    k, v, ks, vs = random_pool(k1, 1, pages, ps, kv)
                    pt = page_table(k2, batch, w, pages)
                    q = jax.random.normal(k3, (batch, H, D), jnp.bfloat16)
                    lens = jnp.full((batch,), ctx, jnp.int32)
                    args = (q, k, v, lens, pt, ks, vs)
                    ref_out = ref(*args)
                    t_k = timeit(kernel, *args)
                    t_r = timeit(ref, *args)
                    gbs = decode_bytes(batch, ctx, kv) / t_k / 1e9
                    row.update(checked(kernel(*args), ref_out))
                    row.update(
                        kernel_us=t_k * 1e6,
                        xla_ref_us=t_r * 1e6,
                        speedup_vs_xla=t_r / t_k,
                        kernel_gbs=gbs,
                        pct_of_copy_bw=100 * gbs / copy_gbs,
                    )
                    mosaic = ""
                    if not interpret or kv == "bf16":  # interpreted it is slow: smoke checks one
                        try:  # a kernel never run on a GPU: its failure is its row's result
                            t_m, err = mosaic_call(mgpu, args, ref_out, interpret)
                            mgbs = decode_bytes(batch, ctx, kv) / t_m / 1e9
                            row.update(
                                mgpu_us=t_m * 1e6,
                                mgpu_gbs=mgbs,
                                mgpu_pct_of_copy_bw=100 * mgbs / copy_gbs,
                                mgpu_vs_triton=t_k / t_m,
                                mgpu_max_abs_err=err,
                                mgpu_ok=err < 0.05,  # bf16 products, f32 softmax
                            )
                            mosaic = (
                                f"  mosaic {t_m * 1e6:9.1f} us ({mgbs:7.1f} GB/s, x{t_k / t_m:5.2f} "
                                f"vs triton, err {err:.1e})"
                            )
                        except Exception as e:  # noqa: BLE001
                            row.update(
                                mgpu_error=f"{type(e).__name__}: {str(e)[:500]}", mgpu_ok=False
                            )
                            mosaic = f"  mosaic failed: {row['mgpu_error'][:200]}"
                    cudnn_args = None
                    if kv == "bf16":  # cuDNN's layouts, made before timing
                        cudnn_args = (q[:, None], *cudnn_pool(k, v), jnp.ones_like(lens), lens, pt)
                    cudnn = cudnn_row(
                        row,
                        cudnn_decode,
                        cudnn_args,
                        ref_out,
                        t_k,
                        functools.partial(_decode_rate, batch, ctx, kv, copy_gbs),
                        interpret,
                        kv,
                    )
                    print(
                        f"  decode B={batch:3d} ctx={ctx:5d} ps={ps} kv={kv:4s}: {t_k * 1e6:9.1f} us "
                        f"({gbs:7.1f} GB/s, {100 * gbs / copy_gbs:5.1f}% of copy) "
                        f"xla {t_r * 1e6:9.1f} us  x{t_r / t_k:5.2f}{mosaic}{cudnn}"
                    )
                    del k, v, ks, vs, args, cudnn_args
    for row in rows:  # quantized KV speedup over bf16 KV at the same shape
        if row.get("kv") != "bf16" and "kernel_us" in row:
            base = next(
                (
                    r
                    for r in rows
                    if r["kv"] == "bf16"
                    and "kernel_us" in r
                    and (r["batch"], r["context"], r["page_size"])
                    == (row["batch"], row["context"], row["page_size"])
                ),
                None,
            )
            if base is not None:
                row["speedup_vs_bf16_kv"] = base["kernel_us"] / row["kernel_us"]
    return rows


def bench_prefill(batch, chunk, contexts, interpret, deadline) -> list[dict]:
    rows = []
    key = jax.random.key(2)
    kernel = jax.jit(
        lambda q, k, v, pos, lens, pt, ks, vs: paged_prefill_attention(
            q, PagedKV(k, v, ks, vs), pos, lens, pt, interpret=interpret
        )
    )
    ref = jax.jit(
        lambda q, k, v, pos, lens, pt, ks, vs: prefill_reference(
            q, PagedKV(k, v, ks, vs), pos, lens, pt
        )
    )
    mgpu = jax.jit(
        lambda q, k, v, pos, lens, pt, ks, vs: paged_prefill_mgpu(
            q, PagedKV(k, v, ks, vs), pos, lens, pt, interpret=interpret
        )
    )
    for ctx in contexts:
        for kv in KV_DTYPES:
            ps = 16
            row = dict(kernel="prefill", batch=batch, chunk=chunk, context=ctx, page_size=ps, kv=kv)
            rows.append(row)
            if time.monotonic() > deadline:
                row["skipped"] = "time budget"
                continue
            w = ctx // ps
            pages = batch * w
            key, k1, k2, k3 = jax.random.split(key, 4)
            k, v, ks, vs = random_pool(k1, 1, pages, ps, kv)
            pt = page_table(k2, batch, w, pages)
            q = jax.random.normal(k3, (batch, chunk, H, D), jnp.bfloat16)
            pos = jnp.broadcast_to(jnp.arange(ctx - chunk, ctx, dtype=jnp.int32), (batch, chunk))
            lens = jnp.full((batch,), ctx, jnp.int32)
            args = (q, k, v, pos, lens, pt, ks, vs)
            ref_out = ref(*args)
            t_k = timeit(kernel, *args)
            t_r = timeit(ref, *args)
            row.update(checked(kernel(*args), ref_out))
            flops = (
                4 * batch * chunk * H * D * ctx
            )  # QK^T and PV over the visible keys (upper bound)
            row.update(
                kernel_us=t_k * 1e6,
                xla_ref_us=t_r * 1e6,
                speedup_vs_xla=t_r / t_k,
                kernel_tflops=flops / t_k / 1e12,
            )
            mosaic = ""
            if not interpret or kv == "bf16":  # interpreted it is slow: smoke checks one
                try:  # a kernel never run on a GPU: its failure is its row's result
                    t_m, err = mosaic_call(mgpu, args, ref_out, interpret)
                    row.update(
                        mgpu_us=t_m * 1e6,
                        mgpu_tflops=flops / t_m / 1e12,
                        mgpu_vs_triton=t_k / t_m,
                        mgpu_max_abs_err=err,
                        mgpu_ok=err < 0.05,  # bf16 products, f32 softmax
                    )
                    mosaic = (
                        f"  mosaic {t_m * 1e6:9.1f} us (x{t_k / t_m:5.2f} vs triton, err {err:.1e})"
                    )
                except Exception as e:  # noqa: BLE001
                    row.update(mgpu_error=f"{type(e).__name__}: {str(e)[:500]}", mgpu_ok=False)
                    mosaic = f"  mosaic failed: {row['mgpu_error'][:200]}"
            cudnn_args = None
            if kv == "bf16":  # cuDNN's layouts and mask, made before timing
                s_idx = jnp.arange(w * ps, dtype=jnp.int32)
                visible = (s_idx[None, None, :] <= pos[:, :, None]) & (
                    s_idx[None, None, :] < lens[:, None, None]
                )  # (B, T, S): the reference's mask
                bias = jnp.where(visible, 0.0, -(2.0**41)).astype(jnp.bfloat16)[:, None]
                q_lens = jnp.full((batch,), chunk, jnp.int32)
                cudnn_args = (q, *cudnn_pool(k, v), q_lens, lens, pt, bias)
            cudnn = cudnn_row(
                row,
                cudnn_prefill,
                cudnn_args,
                ref_out,
                t_k,
                functools.partial(_prefill_rate, flops),
                interpret,
                kv,
            )
            print(
                f"  prefill B={batch} T={chunk} ctx={ctx:5d} kv={kv:4s}: {t_k * 1e6:9.1f} us "
                f"({flops / t_k / 1e12:6.1f} TFLOP/s) xla {t_r * 1e6:9.1f} us  x{t_r / t_k:5.2f}"
                f"{mosaic}{cudnn}"
            )
    return rows


def targets(decode_rows, copy_gbs) -> list[dict]:
    """The issue's targets at batch 64 x context 4096 (page 16 and 32)."""
    out = []
    for r in decode_rows:
        if r["batch"] != 64 or r["context"] != 4096 or "kernel_us" not in r:
            continue
        name = f"decode B64 ctx4096 ps{r['page_size']} kv={r['kv']}"
        if r["kv"] == "bf16":
            out.append(
                dict(
                    target=f"{name}: >= 70% of copy bandwidth",
                    value=r["pct_of_copy_bw"],
                    ok=r["pct_of_copy_bw"] >= 70,
                )
            )
            out.append(
                dict(
                    target=f"{name}: >= 3x XLA reference",
                    value=r["speedup_vs_xla"],
                    ok=r["speedup_vs_xla"] >= 3,
                )
            )
        elif "speedup_vs_bf16_kv" in r:
            out.append(
                dict(
                    target=f"{name}: >= 1.6x bf16 KV",
                    value=r["speedup_vs_bf16_kv"],
                    ok=r["speedup_vs_bf16_kv"] >= 1.6,
                )
            )
    return out


def markdown(res: dict) -> str:
    lines = [f"# Paged attention kernels on {res['device']} (jax {res['jax']})", ""]
    b = res["kv_bytes_per_token"]
    lines += [
        f"KV bytes/token (Llama-3-8B, all layers): bf16 {b['bf16']:.0f}, int8 {b['int8']:.0f} "
        f"({b['int8_over_bf16']:.3f}x), fp8 {b['fp8']:.0f} ({b['fp8_over_bf16']:.3f}x)",
        f"Copy bandwidth: {res['copy_gbs']:.0f} GB/s",
        "",
        "| kernel | batch | context | page | KV | kernel us | XLA us | x XLA | GB/s | % copy | x bf16 KV |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"] + res["prefill"]:
        if "skipped" in r:
            lines.append(
                f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['page_size']} | {r['kv']} "
                f"| skipped ({r['skipped']}) | | | | | |"
            )
            continue
        gbs = f"{r['kernel_gbs']:.0f}" if "kernel_gbs" in r else f"{r['kernel_tflops']:.1f} TFLOP/s"
        pct = f"{r['pct_of_copy_bw']:.1f}" if "pct_of_copy_bw" in r else ""
        xbf = f"{r['speedup_vs_bf16_kv']:.2f}" if "speedup_vs_bf16_kv" in r else ""
        lines.append(
            f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['page_size']} | {r['kv']} "
            f"| {r['kernel_us']:.1f} | {r['xla_ref_us']:.1f} | {r['speedup_vs_xla']:.2f} "
            f"| {gbs} | {pct} | {xbf} |"
        )
    mosaic = [r for r in res["decode"] + res["prefill"] if "mgpu_us" in r]
    if mosaic:
        lines += [
            "",
            "| Mosaic GPU | batch | context | page | KV | us | GB/s or TFLOP/s | % copy "
            "| x Triton | max abs err | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in mosaic:  # decode rows are bandwidth-bound (GB/s), prefill rows compute (TFLOP/s)
        rate = f"{r['mgpu_gbs']:.0f}" if "mgpu_gbs" in r else f"{r['mgpu_tflops']:.1f} TFLOP/s"
        pct = f"{r['mgpu_pct_of_copy_bw']:.1f}" if "mgpu_pct_of_copy_bw" in r else ""
        lines.append(
            f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['page_size']} | {r['kv']} "
            f"| {r['mgpu_us']:.1f} | {rate} | {pct} | {r['mgpu_vs_triton']:.2f} "
            f"| {r['mgpu_max_abs_err']:.1e} | {'yes' if r['mgpu_ok'] else 'NO'} |"
        )
    for r in res["decode"] + res["prefill"]:
        if "mgpu_error" in r:
            lines.append(
                f"\nMosaic GPU {r['kernel']} failed at batch {r['batch']}, context {r['context']}, "
                f"page {r['page_size']}, {r['kv']} KV: {r['mgpu_error']}"
            )
    cudnn = [r for r in res["decode"] + res["prefill"] if "cudnn_us" in r or "cudnn_ok" in r]
    if cudnn:
        lines += [
            "",
            "| cuDNN | batch | context | page | KV | us | GB/s or TFLOP/s | % copy | x Triton "
            "| max abs err | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in cudnn:  # a wrong output is not timed
        us = f"{r['cudnn_us']:.1f}" if "cudnn_us" in r else "not timed"
        rate = (
            f"{r['cudnn_gbs']:.0f}"
            if "cudnn_gbs" in r
            else f"{r['cudnn_tflops']:.1f} TFLOP/s"
            if "cudnn_tflops" in r
            else ""
        )
        pct = f"{r['cudnn_pct_of_copy_bw']:.1f}" if "cudnn_pct_of_copy_bw" in r else ""
        vs = f"{r['cudnn_vs_triton']:.2f}" if "cudnn_vs_triton" in r else ""
        lines.append(
            f"| {r['kernel']} | {r['batch']} | {r['context']} | {r['page_size']} | {r['kv']} "
            f"| {us} | {rate} | {pct} | {vs} | {r['cudnn_max_abs_err']:.1e} "
            f"| {'yes' if r['cudnn_ok'] else 'NO'} |"
        )
    reasons = sorted(
        {r["cudnn_skipped"] for r in res["decode"] + res["prefill"] if "cudnn_skipped" in r}
    )
    lines += [""] + [f"cuDNN skipped: {why}" for why in reasons]
    lines += ["", "| target | value | met |", "|---|---|---|"]
    lines += [
        f"| {t['target']} | {t['value']:.2f} | {'yes' if t['ok'] else 'NO'} |"
        for t in res["targets"]
    ]
    ok = sum(r["ok"] for r in res["correctness"])
    lines += [
        "",
        f"Correctness vs reference on the device: {ok}/{len(res['correctness'])} configurations ok.",
    ]
    lines += [
        "",
        "| pool past 2^31 elements | GiB | decode err | prefill err | ok |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kv']} | {r['pool_bytes'] / 2**30:.3f} | {r['decode_max_err']:.2e} "
        f"| {r['prefill_max_err']:.2e} | {'yes' if r['ok'] else 'NO'} |"
        for r in res.get("large_pools", [])
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", "experiments/out/gpu_kernels"),
        help="directory for gpu_kernels.json / .md (default $OUT)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes in interpret mode: checks the script itself on a CPU",
    )
    parser.add_argument(
        "--budget_s",
        type=float,
        default=420.0,
        help="stop starting new timing configurations after this many seconds",
    )
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    start = time.monotonic()
    deadline = start + opts.budget_s
    on_gpu = jax.default_backend() == "gpu"
    interpret = opts.smoke or not on_gpu
    if not on_gpu and not opts.smoke:
        parser.error("no GPU: run with --smoke (interpret mode, tiny shapes)")
    res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, smoke=opts.smoke)
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"device {res['device']}, jax {res['jax']}, interpret={interpret}")

    res["kv_bytes_per_token"] = kv_bytes_per_token()
    b = res["kv_bytes_per_token"]
    print(
        f"KV bytes/token: bf16 {b['bf16']:.0f}  int8 {b['int8']:.0f} ({b['int8_over_bf16']:.3f}x)  "
        f"fp8 {b['fp8']:.0f} ({b['fp8_over_bf16']:.3f}x)"
    )
    res["copy_gbs"] = copy_bandwidth(8 << 20 if opts.smoke else 4 << 30)
    print(f"copy bandwidth: {res['copy_gbs']:.1f} GB/s")

    print("correctness vs reference:")
    res["correctness"] = check_correctness(interpret, small=opts.smoke)
    print("pools past 2^31 elements:")
    res["large_pools"] = check_large_pools(interpret, small=opts.smoke)

    print("decode timings:")
    if opts.smoke:
        res["decode"] = bench_decode([2], [64], [16], interpret, deadline, res["copy_gbs"])
        res["prefill"] = bench_prefill(1, 16, [64], interpret, deadline)
    else:
        res["decode"] = bench_decode(
            [8, 64, 256], [512, 4096, 8192], [16, 32], False, deadline, res["copy_gbs"]
        )
        print("prefill timings:")
        res["prefill"] = bench_prefill(8, 256, [512, 4096], False, deadline)
    res["targets"] = targets(res["decode"], res["copy_gbs"])
    for t in res["targets"]:
        print(f"  target {t['target']}: {t['value']:.2f} {'met' if t['ok'] else 'NOT met'}")
    res["seconds"] = time.monotonic() - start

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(res, indent=1))
    (out / "gpu_kernels.md").write_text(markdown(res))
    print(markdown(res))
    print(
        f"wrote {out / 'gpu_kernels.json'} and {out / 'gpu_kernels.md'} in {res['seconds']:.0f} s"
    )
    candidates_ok = all(
        r.get(f"{name}_ok", True)
        for r in res["decode"] + res["prefill"]
        for name in ("kernel", "mgpu", "cudnn")
    )
    return (
        0 if candidates_ok and all(r["ok"] for r in res["correctness"] + res["large_pools"]) else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
