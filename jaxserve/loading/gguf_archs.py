"""The GGUF architectures beyond llama / qwen2, in llama.cpp's own conventions (issue 26):

    GGUF general.architecture   -> ModelConfig.architecture
    qwen3, gemma2, gemma3, phi3 -> the same name;  qwen3moe -> qwen3_moe

`family_fields(get, arch, names, num_layers, hidden, heads, head_dim)` reads the families'
metadata into ModelConfig fields; `layer_source(config, param, i, names)` names the GGUF tensor
(and, for a fused one, the rows) holding one layer of a param; `param_kind` says how a tensor's
numpy array becomes the param (`to_param`). What each family adds, as llama.cpp's
convert_hf_to_gguf.py writes it and llama.cpp reads it back:

    qwen3     blk.N.attn_q_norm.weight / attn_k_norm.weight [Dh] -> layers/q_norm, k_norm (no q/k
              row permutation: llama.cpp permutes only `llama`)
    gemma2    blk.N.post_attention_norm.weight -> post_attn_norm; ffn_norm -> mlp_norm (HF's
              pre_feedforward_layernorm); post_ffw_norm -> post_mlp_norm. Every *norm.weight is
              stored as (1 + w) (the converter adds 1): the loader subtracts config.norm_offset.
              {arch}.attention.sliding_window (default 4096), .attention.sliding_window_pattern
              (period, default 2: layer i slides unless i % period == period - 1; or a bool per
              layer, true = sliding), .attn_logit_softcapping (default 50), .final_logit_softcapping
              (default 30), .rope.freq_base_swa (sliding layers' RoPE base, default freq_base).
              The attention scale is not stored: llama.cpp takes 1/sqrt(head_dim), or
              1/sqrt(hidden / heads) for the 27B (46 layers) -- query_pre_attn_scalar follows.
              Embeddings scaled by sqrt(hidden), GELU-tanh gate, tied output.
    gemma3    gemma2's norms (+ qwen3's q/k norms, also (1 + w)); sliding window only when
              .attention.sliding_window > 0, pattern default 6, .rope.freq_base_swa default
              10000 (unscaled; `rope.scaling.*` linear applies to the global layers);
              .final_logit_softcapping optional; no attention soft-cap; 27B = 62 layers.
    phi3      blk.N.attn_qkv.weight rows [q | k | v] -> wq, wk, wv; blk.N.ffn_up.weight rows
              [gate | up] -> w_gate, w_up (split at load, like hf.fused_rows); LongRoPE from
              rope_factors_short.weight / rope_factors_long.weight (f32[Dh/2], read into the
              config), .rope.scaling.original_context_length, .rope.scaling.attn_factor;
              .attention.sliding_window > 0 slides every layer (as HF does; llama.cpp currently
              ignores Phi-3's window).
    qwen3moe  blk.N.ffn_gate_inp.weight [D, E] -> router; ffn_{gate,up,down}_exps.weight (one
              3-D tensor per layer, numpy [E, out, in]) -> we_gate / we_up / we_down [E, in, out];
              .expert_count, .expert_used_count, .expert_feed_forward_length (default
              feed_forward_length / expert_used_count, as llama.cpp). llama.cpp always
              renormalizes the top-k weights: norm_topk_prob = .expert_weights_norm (default
              true). Every llama.cpp qwen3moe layer is sparse; a layer holding ffn_gate / ffn_up
              / ffn_down instead of ffn_gate_inp is read as a dense layer (HF's mlp_only_layers),
              a jaxserve extension llama.cpp does not read.

Not read from GGUF: partial rotary (rope.dimension_count != head_dim is refused), Gemma's
query_pre_attn_scalar when it is not llama.cpp's rule (not representable in llama.cpp's files).
"""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.config.model_fields import LAYER_TYPES, MAX_EXPERTS, check_positive_number, check_size

# GGUF general.architecture -> ModelConfig.architecture, for the families of this module
ARCHS = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3"}
ARCHS["qwen3moe"] = "qwen3_moe"
GEMMA = ("gemma2", "gemma3")
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # phi3: into the config

_QK_NORMS = {"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"}
_GEMMA_NORMS = {
    "post_attn_norm": "post_attention_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}
# our layer param -> GGUF name inside blk.{i} (the llama layout; the families' below)
LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight",
    "w_up": "ffn_up.weight",
    "w_down": "ffn_down.weight",
}

# our layer param -> GGUF name inside blk.{i}, per ModelConfig.architecture (beside LAYER_NAMES)
FAMILY_NAMES = {
    "qwen3": _QK_NORMS,
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS | _QK_NORMS,
    "qwen3_moe": _QK_NORMS
    | {
        "router": "ffn_gate_inp.weight",
        "we_gate": "ffn_gate_exps.weight",
        "we_up": "ffn_up_exps.weight",
        "we_down": "ffn_down_exps.weight",
    },
}
EXPERT_STACKS = ("we_gate", "we_up", "we_down")
_PHI3_FUSED = {
    "wq": "attn_qkv",
    "wk": "attn_qkv",
    "wv": "attn_qkv",
    "w_gate": "ffn_up",
    "w_up": "ffn_up",
}


def param_kind(path: str) -> str:
    """How a GGUF tensor's numpy array becomes the param: 'linear' ([out, in] -> .T), 'experts'
    ([E, out, in] -> [E, in, out]) or 'plain' (as is: norms, biases, the embedding)."""
    name = path.removeprefix("layers/")
    if name in EXPERT_STACKS:
        return "experts"
    linears = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "router")
    if (path.startswith("layers/") and name in linears) or path == "lm_head":
        return "linear"
    return "plain"


def numpy_shape(path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The numpy shape of the GGUF tensor holding one param of logical `shape` (one layer)."""
    kind = param_kind(path)
    if kind == "linear":
        return tuple(shape[::-1])
    if kind == "experts":
        return (shape[0], shape[2], shape[1])
    return tuple(shape)


def to_param(path: str, x: np.ndarray, config: ModelConfig) -> np.ndarray:
    """A dequantized numpy-order array (rows already selected / un-permuted) -> the param."""
    if config.norm_offset and path.rsplit("/", 1)[-1].endswith("norm"):
        x = x - np.float32(config.norm_offset)  # llama.cpp stores Gemma's norms as (1 + w)
    kind = param_kind(path)
    if kind == "linear":
        return x.T
    if kind == "experts":
        return x.swapaxes(-1, -2)
    return x


def layer_source(config: ModelConfig, param: str, i: int, names) -> tuple[str, slice | None, int]:
    """(GGUF tensor name, rows of it holding the param or None, that tensor's row count or 0)
    for layer i of `param`, given the tensor names the file holds."""
    fused = _PHI3_FUSED.get(param) if config.architecture == "phi3" else None
    if fused is not None and (fused == "ffn_up" or f"blk.{i}.{fused}.weight" in names):
        c = config
        qd, kd, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        start, stop, total = {
            "wq": (0, qd, qd + 2 * kd),
            "wk": (qd, qd + kd, qd + 2 * kd),
            "wv": (qd + kd, qd + 2 * kd, qd + 2 * kd),
            "w_gate": (0, inter, 2 * inter),
            "w_up": (inter, 2 * inter, 2 * inter),
        }[param]
        return f"blk.{i}.{fused}.weight", slice(start, stop), total
    suffix = FAMILY_NAMES.get(config.architecture, {}).get(param) or LAYER_NAMES[param]
    return f"blk.{i}.{suffix}", None, 0


def layer_indices(config: ModelConfig, param: str) -> tuple[int, ...]:
    """The layers whose tensors stack into `param` (MoE: sparse or dense layers only)."""
    if param in ("router", *EXPERT_STACKS):
        return config.moe_layers
    if param in ("w_gate", "w_up", "w_down"):
        return config.dense_layers
    return tuple(range(config.num_layers))


def family_fields(
    get, arch: str, names: set, num_layers: int, hidden: int, heads: int, head_dim: int
) -> dict:
    """The ModelConfig fields of the families (keyword arguments; {} for llama / qwen2).

    `get(key, default)` reads `{arch}.{key}` (default None: required); `names` are the file's
    tensor names. Raises ValueError naming the key.
    """
    out: dict = {}
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        out["qk_norm"] = True
    if arch in GEMMA:
        out.update(_gemma_fields(get, arch, num_layers, hidden, heads, head_dim))
    elif arch == "phi3":
        window = _count(get, arch, "attention.sliding_window", 0, allow_zero=True)
        if window:
            out["sliding_window"] = window
    elif arch == "qwen3moe":
        out.update(_moe_fields(get, names, num_layers))
    return out


def _count(get, arch: str, key: str, default, allow_zero: bool = False) -> int:
    """A positive integer key (0 too with allow_zero: llama.cpp's 'none')."""
    v = get(key, default)
    if allow_zero and isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v == 0:
        return 0
    return check_size(f"GGUF metadata key {arch}.{key}", v, 2**30)


def _gemma_fields(get, arch: str, num_layers: int, hidden: int, heads: int, head_dim: int) -> dict:
    big = num_layers == (46 if arch == "gemma2" else 62)  # llama.cpp's 27B rule
    out = dict(
        norm_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        mlp_activation="gelu_tanh",
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
    )

    def cap(key, default):
        v = get(key, default)
        if v is None or (
            isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and v == 0
        ):
            return None  # llama.cpp: 0 = no soft-cap
        return check_positive_number(f"GGUF metadata key {arch}.{key}", v)

    if arch == "gemma2":
        out["attn_logit_softcap"] = cap("attn_logit_softcapping", 50.0)
        out["final_logit_softcap"] = cap("final_logit_softcapping", 30.0)
        window = _count(get, arch, "attention.sliding_window", 4096)
    else:
        out["final_logit_softcap"] = cap("final_logit_softcapping", 0)
        window = _count(get, arch, "attention.sliding_window", 0, allow_zero=True)
    theta = get("rope.freq_base", 10000.0) if arch == "gemma2" else 10000.0
    local = check_positive_number(
        f"GGUF metadata key {arch}.rope.freq_base_swa", get("rope.freq_base_swa", theta)
    )
    if arch == "gemma3" or local != theta:  # HF's Gemma 3 config always has its local base
        out["rope_local_theta"] = local
    if not window:
        return out
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):
        if len(pattern) != num_layers or not all(isinstance(p, (bool, np.bool_)) for p in pattern):
            raise ValueError(
                f"GGUF metadata key {arch}.attention.sliding_window_pattern must be a period or "
                f"one bool per layer ({num_layers}), got {pattern!r}"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = check_size(
            f"GGUF metadata key {arch}.attention.sliding_window_pattern", pattern, 2**20
        )
        sliding = [i % period < period - 1 for i in range(num_layers)]
    types = tuple(LAYER_TYPES[0] if s else LAYER_TYPES[1] for s in sliding)
    out.update(sliding_window=window, layer_types=types)
    return out


def _moe_fields(get, names: set, num_layers: int) -> dict:
    sparse = {i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names}
    if not sparse:
        raise ValueError("GGUF qwen3moe file has no blk.N.ffn_gate_inp.weight (router) tensors")
    experts = check_size(
        "GGUF metadata key qwen3moe.expert_count", get("expert_count"), MAX_EXPERTS
    )
    used = check_size(
        "GGUF metadata key qwen3moe.expert_used_count", get("expert_used_count"), experts
    )
    ff = get("feed_forward_length", 0)
    inter = get(
        "expert_feed_forward_length", ff // used if isinstance(ff, (int, np.integer)) else ff
    )
    norm = get("expert_weights_norm", True)
    if not isinstance(norm, (bool, np.bool_)):
        raise ValueError(
            f"GGUF metadata key qwen3moe.expert_weights_norm must be a bool, got {norm!r}"
        )
    # HF's form: the largest decoder_sparse_step whose sparse layers hold these, the rest dense
    step = next(
        s
        for s in range(num_layers, 0, -1)
        if sparse <= {i for i in range(num_layers) if (i + 1) % s == 0}
    )
    return dict(
        num_experts=experts,
        num_experts_per_tok=used,
        moe_intermediate_size=check_size(
            "GGUF metadata key qwen3moe.expert_feed_forward_length", inter, 2**20
        ),
        norm_topk_prob=bool(norm),
        mlp_only_layers=tuple(
            i for i in range(num_layers) if (i + 1) % step == 0 and i not in sparse
        ),
        decoder_sparse_step=step,
    )


def longrope(get, reader_tensors: dict, dequantize, context_length: int):
    """Phi-3's LongRoPE RopeScaling from rope_factors_{short,long}.weight, or None."""
    from jaxserve.config import RopeScaling

    held = [reader_tensors.get(n) for n in ROPE_FACTORS]
    if all(t is None for t in held):
        return None
    if any(t is None or len(t.shape) != 1 for t in held):
        raise ValueError(f"GGUF phi3 needs both 1-D {ROPE_FACTORS[0]} and {ROPE_FACTORS[1]}")
    short, long = (tuple(dequantize(t).astype(np.float64).tolist()) for t in held)
    key = "GGUF metadata key phi3.rope.scaling.original_context_length"
    original = get("rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"{key} is missing (phi3 LongRoPE)")
    original = check_size(key, original, 2**30)
    return RopeScaling(
        rope_type="longrope",
        factor=context_length / original,
        original_max_position_embeddings=original,
        attention_factor=check_positive_number(
            "GGUF metadata key phi3.rope.scaling.attn_factor", get("rope.scaling.attn_factor", 1.0)
        ),
        short_factor=short,
        long_factor=long,
    )
