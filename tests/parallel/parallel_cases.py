"""Multi-device cases, run in a subprocess with N host CPU devices (`run_cases` in
parallel_testing.py): `python parallel_cases.py N CASE...` prints one JSON object with each
case's result (or its error), so one jax start-up serves many cases.

Every case compares a sharded run with the one-device run of the same model in the same process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

# N host CPU devices, and XLA's CPU backend at LLVM -O0: every case compares programs compiled
# alike (sharded and one-device, in this process), and compiling is most of each case's time
# (-O0 cuts it by about a third; the programs' HLO, sharding and collectives are unchanged).
XLA_FLAGS = "--xla_force_host_platform_device_count={} --xla_backend_optimization_level=0"

if __name__ == "__main__":  # before jax is imported
    os.environ["XLA_FLAGS"] = XLA_FLAGS.format(sys.argv[1])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402
from jaxserve.layers import kv_cache as kvc  # noqa: E402
from jaxserve.layers.attention import AttentionMetadata  # noqa: E402
from jaxserve.loading import hf  # noqa: E402
from jaxserve.models import llama  # noqa: E402
from jaxserve.parallel import partition  # noqa: E402
from jaxserve.parallel.mesh import make_mesh  # noqa: E402
from jaxserve.resolve import REFERENCE_IMPL, ModelImpl  # noqa: E402
from pallas_kernels.lowering import kernel_launches  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "golden")
FAMILIES = ("llama", "mistral", "qwen2")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen3_moe_sparse2")  # 8, 16 and 4 experts
PROMPTS = [[3, 17, 99, 5, 42, 8, 1], [250, 7], [11, 12, 13, 14, 15] * 5, [9] * 20, [4, 4, 5]]


def _logits(params, config, tokens, mesh, impl=REFERENCE_IMPL, jaxpr=False):
    """Whole-window forward logits f32[B, T, V] over a paged cache, on `mesh` (None: 1 device);
    with jaxpr=True the forward's jaxpr instead."""
    b, t = tokens.shape
    ps = 4
    meta = AttentionMetadata.contiguous([t] * b, t, ps)
    n_pages = b * -(-t // ps)

    def run(params, tokens, meta):
        cache = kvc.init(
            config.num_layers,
            config.num_kv_heads,
            n_pages,
            ps,
            config.head_dim,
            "auto",
            jnp.float32,
        )
        hidden, _ = llama.forward(params, tokens, meta, cache, config, impl)
        return llama.compute_logits(params, hidden, config)

    if jaxpr:
        with jax.set_mesh(mesh):
            return jax.make_jaxpr(run)(params, tokens, meta).jaxpr
    if mesh is None:
        return np.asarray(jax.jit(run)(params, tokens, meta))
    with jax.set_mesh(mesh):
        return np.asarray(jax.jit(run)(params, tokens, meta))


_REF_LOGITS: dict = {}  # one-device logits per family


def case_logits(t: int, families=FAMILIES, moe_matmul: str = "ragged_dot") -> dict:
    """Max |sharded - one-device| f32 logits of each tiny golden family at tensor parallel t
    (the sharded run's MoE layers on `moe_matmul`, the one-device run's on 'ragged_dot')."""
    out = {}
    for fam in families:
        config, params = hf.load_hf_dir(os.path.join(GOLDEN, fam), "float32")
        tokens = jnp.asarray(np.load(os.path.join(GOLDEN, fam, "logits.npz"))["tokens"])
        if fam not in _REF_LOGITS:  # the same one-device run for every t
            _REF_LOGITS[fam] = _logits(params, config, tokens, None)
        ref = _REF_LOGITS[fam]
        mesh = make_mesh(t, 1)
        p2, c2 = partition.replicate_kv_heads(params, config, t)
        p2 = partition.shard_params(p2, c2, mesh)
        got = _logits(p2, c2, tokens, mesh, ModelImpl(moe_matmul=moe_matmul))
        out[fam] = float(np.max(np.abs(got - ref)))
    return out


def case_quantized_experts(t: int) -> dict:
    """The GPU's 'kernel' path under expert parallelism: INT4 expert stacks (the Triton kernel,
    interpreted) split over E at TP t, each device's tiles reading its experts in their stack:
    max |sharded - one-device| f32 logits, the one-device run dequantizing them for ragged_dot;
    and the tiled launches one sharded forward makes (3 a MoE layer)."""
    from jaxserve.quant import MOE_EXPERT_WEIGHTS, rtn, with_matmul_impl

    out = {}
    for fam in ("mixtral", "qwen3_moe"):
        config, params = hf.load_hf_dir(os.path.join(GOLDEN, fam), "float32")
        tokens = jnp.asarray(np.load(os.path.join(GOLDEN, fam, "logits.npz"))["tokens"])
        layers = params["layers"]
        experts = {n: rtn.quantize_int4_rtn(layers[n], 32) for n in MOE_EXPERT_WEIGHTS}
        experts = with_matmul_impl(experts, "pallas_interpret")
        params = {**params, "layers": {**params["layers"], **experts}}
        ref = _logits(params, config, tokens, None, ModelImpl(moe_matmul="ragged_dot"))
        mesh = make_mesh(t, 1)
        p2, c2 = partition.replicate_kv_heads(params, config, t)
        p2 = partition.shard_params(p2, c2, mesh)
        impl = ModelImpl(moe_matmul="kernel")
        got = _logits(p2, c2, tokens, mesh, impl)
        launches = kernel_launches(_logits(p2, c2, tokens, mesh, impl, jaxpr=True), "int4_matmul_t")
        out[fam] = {"diff": float(np.max(np.abs(got - ref))), "launches": launches}
    return out


def _greedy(llm, prompts, max_tokens=10):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


GREEDY_PROMPTS = PROMPTS + [PROMPTS[3][::-1], PROMPTS[0][::-1]]  # [9] * 20 twice: a prefix hit
_REFERENCE: dict = {}  # one-device greedy tokens per model (and quantization)
# Settings that never change greedy tokens (f32: preemption, prefix caching and the pool size give
# the same tokens, tests/runner and tests/core check that), so one reference serves them all.
_SAME_TOKENS = ("tensor_parallel_size", "data_parallel_size", "num_pages", "enable_prefix_caching")


def case_greedy(model: str, **settings) -> dict:
    """Greedy tokens of the engine under `settings` (tensor/data parallel sizes, pages, prefix
    caching) against the one-device engine's."""
    base = dict(dtype="float32", num_slots=4, max_model_len=64, page_size=8)
    if not os.path.isdir(model):
        base["load_format"] = "dummy"
    one = {k: v for k, v in settings.items() if k not in _SAME_TOKENS}
    key = (model, tuple(sorted(one.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _greedy(LLM(model, **base, **one), GREEDY_PROMPTS)
    llm = LLM(model, **base, **settings)
    got = _greedy(llm, GREEDY_PROMPTS)
    stats = llm.engine.stats()
    return {
        "equal": got == _REFERENCE[key],
        "num_preemptions": stats["num_preemptions"],
        "num_cached_prefill_tokens": stats["num_cached_prefill_tokens"],
    }


def case_never_fit_dp2() -> dict:
    """A request needing more pages than one data shard holds (but fewer than the whole pool)
    fails alone with a clear error: it would otherwise wait (or preempt) forever on its shard."""
    llm = LLM(
        "tiny",
        load_format="dummy",
        dtype="float32",
        num_slots=4,
        max_model_len=64,
        page_size=4,
        num_pages=20,
        data_parallel_size=2,
    )  # 10 pages per shard
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5] * 40}], sp, use_tqdm=False)[0]  # 12 pages
    return {"message": out.error, "finish_reason": out.outputs[0].finish_reason}


def _logprobs(llm) -> list[tuple[int, float]]:
    """(token, f32 log-prob) of every prompt token's and each sampled token's top 5, in order:
    greedy requests asking for both (prompt log-probs bypass the prefix cache: always computed)."""
    sp = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=1
    )
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4])]
    vals = []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        for step in [*o.prompt_logprobs[1:], *o.outputs[0].logprobs]:
            vals += sorted((t, lp.logprob) for t, lp in step.items())
    return vals


def case_warm_tp_dp(model: str, t: int, d: int) -> dict:
    """One engine at tensor parallel t x data parallel d, built with warmup=True, against an
    unwarmed one-device engine, both serving in turn: the greedy prompts (`equal`: the same
    tokens), the log-probs requests (`same_tokens`, `max_diff`: max |sharded - one device| of the
    f32 log-probs, the logits comparison of data parallelism through the engine) and 10 short
    requests on the 4 slots; `compilations`: XLA compilations of the warmed engine after its
    warm-up, through all three (must be 0). Pages of 8 and 2 prefill chunks per step keep the
    warm-up's programs few (4 page-table widths x 3 prefill variants)."""
    from jaxserve.bench.core import CompileCounter

    kw = dict(dtype="float32", num_slots=4, max_model_len=64, page_size=8)
    kw["max_num_batched_tokens"] = 128  # 2 chunks of 64
    ref = LLM(model, **kw)
    llm = LLM(model, **kw, tensor_parallel_size=t, data_parallel_size=d, warmup=True)
    with CompileCounter() as cc:
        got_tokens, got_lps = _greedy(llm, GREEDY_PROMPTS), _logprobs(llm)
        _greedy(llm, [p[:12] for p in PROMPTS] * 2, max_tokens=6)
    ref_tokens, ref_lps = _greedy(ref, GREEDY_PROMPTS), _logprobs(ref)
    return {
        "equal": got_tokens == ref_tokens,
        "same_tokens": [tok for tok, _ in ref_lps] == [tok for tok, _ in got_lps],
        "max_diff": max(abs(a[1] - b[1]) for a, b in zip(ref_lps, got_lps)),
        "compilations": cc.count,
    }


def case_staged_load(t: int) -> dict:
    """Where weights built at load (quantized at load, GGUF-native, dummy) live when a mesh is
    given: on the host's CPU device (device 0 here), not on the mesh's devices 1..t, which the
    runner then gives each only its slice. The default device is a mesh device, as a GPU's is."""
    from jaxserve.loading import load_model

    host = jax.local_devices(backend="cpu")[0]
    mesh = make_mesh(t, 1, devices=jax.devices()[1 : 1 + t])
    out = {"host": str(host)}
    jax.config.update("jax_default_device", jax.devices()[1])
    try:
        for name, kw in (
            ("int4_rtn", dict(model="tiny", load_format="dummy", quantization="int4-rtn")),
            ("int8", dict(model="tiny", load_format="dummy", quantization="int8")),
            ("dummy", dict(model="tiny", load_format="dummy")),
            ("gguf_native", dict(model=None, quantization="gguf-native")),
            ("hf_int4_rtn", dict(model=os.path.join(GOLDEN, "llama"), quantization="int4-rtn")),
        ):
            loaded = load_model(**kw, dtype="float32", tensor_parallel_size=t, mesh=mesh)
            devices = {d for x in jax.tree.leaves(loaded.params) for d in x.devices()}
            out[name] = sorted(str(d) for d in devices)
    finally:
        jax.config.update("jax_default_device", None)
    return out


def case_smollm2_gguf_native(t: int) -> dict:
    """SmolLM2-135M imported from its GGUF's Q4 blocks (9 query heads, 3 KV heads) at TP t:
    greedy tokens and log-probs against the one-device INT4 engine."""
    kw = dict(quantization="gguf-native", num_slots=2, max_model_len=64, dtype="float32")
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = ["The capital of France is", "def fib(n):"]

    def run(**extra):
        outs = LLM(None, **kw, **extra).generate(prompts, sp, use_tqdm=False)  # the default GGUF
        return [
            (
                list(o.outputs[0].token_ids),
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            )
            for o in outs
        ]

    ref, got = run(), run(tensor_parallel_size=t)
    return {
        "equal": [a[0] for a in ref] == [b[0] for b in got],
        "max_logprob_diff": max(abs(x - y) for a, b in zip(ref, got) for x, y in zip(a[1], b[1])),
    }


def case_int4_checkpoint(t: int, tmp: str = "/tmp") -> dict:
    """An INT4-RTN (group 32) checkpoint of the tiny model served at TP t and on one device."""
    import tempfile

    from jaxserve.config import PRESETS
    from jaxserve.loading import checkpoint, dummy
    from jaxserve.quant import quantize_params

    config = PRESETS["tiny"]
    params = quantize_params(
        dummy.dummy_params(config, "float32"), config, "int4-rtn", group_size=32
    )
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        recipe = {"quantization": "int4-rtn", "group_size": 32, "dtype": "float32"}
        path = checkpoint.save_checkpoint(
            os.path.join(d, "tiny-int4"), config, params, recipe=recipe
        )
        return case_greedy(str(path), tensor_parallel_size=t)


def case_load_onto_shards(t: int) -> dict:
    """Tensors read from a HF folder and from an orbax checkpoint land split on their devices
    (each device holding 1/T of every split tensor), equal to the one-device load."""
    import tempfile

    from jaxserve.loading import checkpoint, load_model

    mesh = make_mesh(t, 1)
    src = os.path.join(GOLDEN, "llama")
    ref = load_model(src, dtype="float32").params
    out = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = checkpoint.save_checkpoint(os.path.join(d, "ck"), *hf.load_hf_dir(src, "float32"))
        for kind, path in (("hf", src), ("orbax", str(ckpt))):
            got = load_model(path, dtype="float32", mesh=mesh).params
            wq = got["layers"]["wq"]
            out[kind] = {
                "equal": all(
                    np.array_equal(np.asarray(a), np.asarray(b))
                    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got))
                ),
                "wq_spec": str(wq.sharding.spec),
                "wq_shard_fraction": wq.addressable_shards[0].data.size / wq.size,
                "wo_spec": str(got["layers"]["wo"].sharding.spec),
            }
    return out


def case_param_bytes(t: int) -> dict:
    """Per-device bytes of the placed params vs total / T (norms excluded from both)."""
    config, params = hf.load_hf_dir(os.path.join(GOLDEN, "llama"), "float32")
    mesh = make_mesh(t, 1)
    placed = partition.shard_params(params, config, mesh)
    dev = jax.devices()[0]
    total = per_device = 0
    for path, x in jax.tree_util.tree_flatten_with_path(placed)[0]:
        if "norm" in jax.tree_util.keystr(path):
            continue
        total += x.nbytes
        per_device += sum(s.data.nbytes for s in x.addressable_shards if s.device == dev)
    return {"ratio": per_device / (total / t)}


def case_expert_split(t: int) -> dict:
    """Where the expert stacks of the tiny Qwen3-MoE (16 experts) land at TP t, loaded straight
    from its HF folder onto the mesh and then placed by the runner's rules: split over E."""
    from jaxserve.loading import load_model

    mesh = make_mesh(t, 1)
    src = os.path.join(GOLDEN, "qwen3_moe")
    loaded = load_model(src, dtype="float32", mesh=mesh)
    placed = partition.shard_params(loaded.params, loaded.config, mesh)
    out = {"loaded_spec": str(loaded.params["layers"]["we_gate"].sharding.spec)}
    for name in ("we_gate", "we_up", "we_down"):
        w = placed["layers"][name]
        out[name] = {
            "spec": str(w.sharding.spec),
            "fraction": w.addressable_shards[0].data.size / w.size,
        }
    return out


def case_lora(t: int, quantization: str | None = None) -> dict:
    """Greedy tokens of a batch mixing two LoRA adapters and none (two device slots) at TP t
    against one device, over float or quantized base weights (the golden Llama)."""
    import tempfile
    from pathlib import Path

    sys.path.insert(0, os.path.join(HERE, ".."))
    from lora_testing import write_adapter

    from jaxserve.lora import LoRARequest

    tmp, base = Path(tempfile.mkdtemp()), os.path.join(GOLDEN, "llama")
    adapters = [
        LoRARequest(name, i + 1, str(write_adapter(tmp / name, base, rank=r, seed=i)))
        for i, (name, r) in enumerate((("a", 4), ("b", 8)))
    ]
    choice = [(None, *adapters)[i % 3] for i in range(len(GREEDY_PROMPTS))]
    kw = dict(dtype="float32", num_slots=4, max_model_len=64, page_size=8, enable_lora=True)
    kw |= dict(max_loras=2, max_lora_rank=8, quantization=quantization)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in GREEDY_PROMPTS]

    def tokens(llm, lora):
        outs = llm.generate(ps, sp, use_tqdm=False, lora_request=lora)
        return [list(o.outputs[0].token_ids) for o in outs]

    one = tokens(LLM(base, **kw), choice)
    sharded = LLM(base, tensor_parallel_size=t, **kw)
    got, plain = tokens(sharded, choice), tokens(sharded, None)
    adapted = [i for i, c in enumerate(choice) if c is not None]
    stacks = sharded.engine.runner.params["lora"]
    shard = {  # one device's share of each factor, as a fraction of the whole
        f"{n}.{f}": stacks[n][f].addressable_shards[0].data.size / stacks[n][f].size
        for n in ("wq", "wo")
        for f in ("a", "b")
    }
    return {
        "equal": got == one,
        "adapters_change_tokens": all(got[i] != plain[i] for i in adapted),
        "shard": shard,
    }


CASES = {
    "logits_tp1": lambda: case_logits(1),  # the sharded code path on a 1-device mesh
    "logits_tp2": lambda: case_logits(2),
    "logits_tp4": lambda: case_logits(4),  # 4 heads, 2 KV heads: KV heads replicated
    "greedy_tp2": lambda: case_greedy(os.path.join(GOLDEN, "qwen2"), tensor_parallel_size=2),
    "greedy_tp4": lambda: case_greedy(os.path.join(GOLDEN, "mistral"), tensor_parallel_size=4),
    "greedy_dp2": lambda: case_greedy("tiny", data_parallel_size=2),
    # greedy tokens, log-probs and no compilation after warm-up: one warmed engine (Llama 3.1)
    "warm_tp2_dp2": lambda: case_warm_tp_dp(os.path.join(GOLDEN, "llama31"), 2, 2),
    # 5 pages of 8 tokens per shard: every request fits alone (the longest, 25 + 10 tokens, needs
    # 5 pages), but two long ones on a shard preempt one another
    "preempt_dp2": lambda: case_greedy("tiny", data_parallel_size=2, num_pages=10),
    "never_fit_dp2": case_never_fit_dp2,
    "prefix_cache_dp2": lambda: case_greedy(
        "tiny", data_parallel_size=2, enable_prefix_caching=True
    ),
    "staged_load_tp2": lambda: case_staged_load(2),
    "int4_rtn_tp2": lambda: case_int4_checkpoint(2),
    "int8_tp4": lambda: case_greedy("tiny", tensor_parallel_size=4, quantization="int8"),
    "smollm2_gguf_native_tp3": lambda: case_smollm2_gguf_native(3),
    "load_onto_shards_tp2": lambda: case_load_onto_shards(2),
    "moe_logits_tp2": lambda: case_logits(2, MOE_FAMILIES),
    # sparse2's 4 experts: 1 each; the CPU engine's 'tiled' grouped path under the shard_map
    "moe_logits_tp4": lambda: case_logits(4, MOE_FAMILIES, moe_matmul="tiled"),
    "moe_expert_split_tp2": lambda: case_expert_split(2),
    "moe_int4_kernel_tp2": lambda: case_quantized_experts(2),
    "moe_greedy_tp2": lambda: case_greedy(
        os.path.join(GOLDEN, "qwen3_moe"), tensor_parallel_size=2
    ),
    "moe_int8_greedy_tp2": lambda: case_greedy(
        os.path.join(GOLDEN, "mixtral"), tensor_parallel_size=2, quantization="int8"
    ),
    "lora_tp2": lambda: case_lora(2),
    "lora_int8_tp2": lambda: case_lora(2, "int8"),
    "lora_tp4": lambda: case_lora(4),  # 4 devices over 2 KV heads: wk / wv (and adapters) copied
    "param_bytes_tp2": lambda: case_param_bytes(2),
    "param_bytes_tp4": lambda: case_param_bytes(4),
}


def main(names: list[str]) -> None:
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            results[name] = CASES[name]()
        except Exception:  # reported per case, so one failure does not hide the others
            results[name] = {"error": traceback.format_exc(limit=8)}
        # each case's wall time on stderr (the suite's budget; shown when the subprocess fails)
        print(f"case {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[2:])
