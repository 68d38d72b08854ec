"""A Hugging Face `config.json` -> `ModelConfig`'s fields (`ModelConfig.from_hf(hf)` is
`ModelConfig(**fields_from_hf(hf))`).

One function per concern: the shared Llama fields (`fields_from_hf`), RoPE scaling (llama3,
linear, longrope), the dense families' switches (`_hf_family_fields`: Qwen3, Gemma 2/3, Phi-3,
sliding windows) and the mixture-of-experts fields (`_hf_moe_fields`: Mixtral, Qwen3-MoE). Every
value is checked as it is read: a missing, non-numeric, non-positive or absurdly large field raises
ValueError naming the config.json field (`loading/hf.load_hf_config` adds the file's path).
"""

from __future__ import annotations

from typing import Any

from jaxserve.config.model_fields import (
    DENSE_FAMILY_TYPES,
    LAYER_TYPES,
    MAX_EXPERTS,
    MAX_SIZES,
    MLP_ACTIVATIONS,
    SUPPORTED_ARCHITECTURES,
    RopeScaling,
    _is_int,
    check_positive_number,
    check_size,
)


def fields_from_hf(hf: dict[str, Any], name: str = "") -> dict[str, Any]:
    """The `ModelConfig` fields of a Hugging Face `config.json` dict, as keyword arguments.

    A missing, non-numeric, non-positive or absurdly large field raises ValueError naming
    the config.json field (`loading.hf.load_hf_config` adds the file's path).
    """
    if not isinstance(hf, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
    model_type = hf.get("model_type", "")
    arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
    arch = arch or {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}.get(model_type)  # MoE
    arch = arch or DENSE_FAMILY_TYPES.get(model_type)
    if arch is None:
        raise ValueError(
            f"unknown architecture: config.json model_type {model_type!r} "
            f"(architectures={hf.get('architectures')}); supported: {SUPPORTED_ARCHITECTURES}"
        )
    heads = _hf_size(hf, "num_attention_heads", "num_heads")
    hidden = _hf_size(hf, "hidden_size", "hidden_size")
    max_pos = _hf_size(hf, "max_position_embeddings", "max_position_embeddings", 4096)
    if arch == "gemma3":
        hf = _gemma3_rope_legacy(hf)
    rs = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
    if not isinstance(rs, dict):
        raise ValueError(f"config.json field 'rope_scaling' must be an object, got {rs!r}")
    rope_scaling = None
    rope_type = rs.get("rope_type", rs.get("type")) if rs else None
    if rope_type == "llama3":
        rope_scaling = RopeScaling(
            factor=_hf_number(rs, "factor", prefix="rope_scaling."),
            low_freq_factor=_hf_number(rs, "low_freq_factor", prefix="rope_scaling."),
            high_freq_factor=_hf_number(rs, "high_freq_factor", prefix="rope_scaling."),
            original_max_position_embeddings=_hf_size(
                rs,
                "original_max_position_embeddings",
                "max_position_embeddings",
                prefix="rope_scaling.",
            ),
        )
    elif rope_type == "linear":
        rope_scaling = RopeScaling(
            factor=_hf_number(rs, "factor", prefix="rope_scaling."), rope_type="linear"
        )
    elif rope_type in ("longrope", "su") or (arch == "phi3" and rope_type == "yarn"):
        rope_scaling = _hf_longrope(hf, rs, max_pos)  # HF's Phi3Config maps su/yarn to it
    elif rope_type not in (None, "default"):
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported "
            f"(only 'llama3', 'linear', 'longrope')"
        )
    if rs and rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json field 'partial_rotary_factor' != 1 is not supported")
    default_theta = 1000000.0 if arch == "gemma3" else 10000.0  # HF Gemma3's default
    if "rope_theta" in hf:
        rope_theta = _hf_number(hf, "rope_theta")
    else:
        params = hf.get("rope_parameters") or {}
        rope_theta = _hf_number(params, "rope_theta", default_theta, prefix="rope_parameters.")
    eos = hf.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    bos = hf.get("bos_token_id")
    for key, ids in (
        ("eos_token_id", eos_ids),
        ("bos_token_id", (bos,) if bos is not None else ()),
    ):
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(
                f"config.json field {key!r} must be a non-negative integer (or a list of "
                f"them), got {hf.get(key)!r}"
            )
    head_dim = hf.get("head_dim")
    num_layers = _hf_size(hf, "num_hidden_layers", "num_layers")
    return dict(
        architecture=arch,
        vocab_size=_hf_size(hf, "vocab_size", "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_hf_size(hf, "intermediate_size", "intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_hf_size(hf, "num_key_value_heads", "num_kv_heads", heads),
        head_dim=_hf_size(hf, "head_dim", "head_dim") if head_dim else hidden // heads,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=_hf_number(hf, "rms_norm_eps", 1e-5),
        # HF's Gemma configs tie by default (their config.json files leave the key out).
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in ("gemma2", "gemma3"))),
        attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        max_position_embeddings=max_pos,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        name=name,
        **_hf_moe_fields(hf, arch),  # mixture-of-experts (num_experts 0 for dense families)
        **_hf_family_fields(hf, arch, num_layers),  # Qwen3 / Gemma / Phi-3 switches, windows
    )


_REQUIRED = object()


def _hf_value(hf: dict, key: str, default, prefix: str):
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is _REQUIRED:
        raise ValueError(f"config.json field {prefix + key!r} is missing")
    return default


def _hf_size(hf: dict, key: str, field: str, default=_REQUIRED, prefix: str = "") -> int:
    """An integer config.json field, bounded like the ModelConfig `field` it fills.

    An integral float (64.0) is accepted, as json writers sometimes emit them.
    """
    v = _hf_value(hf, key, default, prefix)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return check_size(f"config.json field {prefix + key!r}", v, MAX_SIZES[field])


def _hf_number(hf: dict, key: str, default=_REQUIRED, prefix: str = "") -> float:
    v = _hf_value(hf, key, default, prefix)
    return check_positive_number(f"config.json field {prefix + key!r}", v)


# --- dense families ---
def _hf_family_fields(hf: dict, arch: str, num_layers: int) -> dict:
    """The dense-family switches and the sliding window, from config.json (HF's rules)."""
    gemma = arch in ("gemma2", "gemma3")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    activation = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act)
    activation = activation or ({"gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}.get(act))
    if activation is None:
        raise ValueError(f"config.json activation {act!r} is not supported ({MLP_ACTIVATIONS})")
    out = dict(mlp_activation=activation, qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"))
    if gemma:
        if hf.get("use_bidirectional_attention"):
            raise ValueError("config.json field 'use_bidirectional_attention' is not supported")
        caps = (50.0, 30.0) if arch == "gemma2" else (None, None)  # HF's config defaults
        # HF's Gemma3Attention keeps attn_logit_softcapping but never applies it (the released
        # Gemma 3 configs set it to null): as there, it is ignored for gemma3.
        attn_cap = hf.get("attn_logit_softcapping", caps[0]) if arch == "gemma2" else None
        final_cap = hf.get("final_logit_softcapping", caps[1])
        out.update(
            norm_offset=1.0,
            sandwich_norms=True,
            scale_embeddings=True,
            query_pre_attn_scalar=_hf_number(hf, "query_pre_attn_scalar", 256.0),
            attn_logit_softcap=None
            if attn_cap is None
            else _hf_number(hf, "attn_logit_softcapping"),
            final_logit_softcap=None
            if final_cap is None
            else _hf_number(hf, "final_logit_softcapping"),
        )
    if arch == "gemma3":
        out["rope_local_theta"] = _hf_number(hf, "rope_local_base_freq", 10000.0)
    # Sliding window: Qwen2/3 only with use_sliding_window (HF sets the window to None otherwise).
    window = hf.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return out
    window = _hf_size(hf, "sliding_window", "max_position_embeddings")
    types = hf.get("layer_types")
    if types is None and arch == "gemma2":
        types = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
    elif types is None and arch == "gemma3":
        pattern = _hf_size(hf, "sliding_window_pattern", "num_layers", 6)
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    elif types is None and arch in ("qwen2", "qwen3"):
        first = _hf_size(hf, "max_window_layers", "num_layers", num_layers) if num_layers else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is not None and (
        not isinstance(types, list)
        or len(types) != num_layers
        or not all(t in LAYER_TYPES for t in types)
    ):
        raise ValueError(
            f"config.json field 'layer_types' must list one of {LAYER_TYPES} for each of the "
            f"{num_layers} layers, got {types!r}"
        )
    out.update(sliding_window=window, layer_types=None if types is None else tuple(types))
    return out


def _gemma3_rope_legacy(hf: dict) -> dict:
    """Gemma 3's per-layer-type rope_parameters (transformers 5: {"full_attention": {...},
    "sliding_attention": {...}}) as the Hub's flat keys: rope_theta, rope_scaling (global
    layers) and rope_local_base_freq (sliding layers, which must be unscaled)."""
    rp = hf.get("rope_parameters")
    if not (isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp)):
        return hf
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if not isinstance(full, dict) or not isinstance(local, dict):
        raise ValueError(f"config.json field 'rope_parameters' must hold objects, got {rp!r}")
    if local.get("rope_type", "default") != "default":
        raise ValueError("rope_parameters.sliding_attention: only the default RoPE is supported")
    hf = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    if "rope_theta" in full:
        hf["rope_theta"] = full["rope_theta"]
    if "rope_theta" in local:
        hf["rope_local_base_freq"] = local["rope_theta"]
    if full.get("rope_type", "default") != "default":
        hf["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    return hf


def _hf_longrope(hf: dict, rs: dict, max_pos: int) -> RopeScaling:
    """Phi-3's LongRoPE, as HF computes it (`_compute_longrope_parameters`): the top-level
    original_max_position_embeddings wins over rope_scaling's; factor defaults to
    max_position_embeddings / original, attention_factor to sqrt(1 + ln factor / ln original)."""
    import math

    factors = {}
    for key in ("short_factor", "long_factor"):
        f = rs.get(key)
        if not isinstance(f, list) or not f:
            raise ValueError(f"config.json field 'rope_scaling.{key}' must be a list of numbers")
        factors[key] = tuple(
            check_positive_number(f"config.json field 'rope_scaling.{key}[]'", v) for v in f
        )
    src, prefix = (hf, "") if hf.get("original_max_position_embeddings") else (rs, "rope_scaling.")
    original = _hf_size(
        src, "original_max_position_embeddings", "max_position_embeddings", max_pos, prefix=prefix
    )
    factor = rs.get("factor") or max_pos / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        rope_type="longrope",
        factor=check_positive_number("config.json field 'rope_scaling.factor'", factor),
        original_max_position_embeddings=original,
        attention_factor=check_positive_number(
            "config.json field 'rope_scaling.attention_factor'", attention
        ),
        **factors,
    )


# --- end dense families ---


# --- mixture-of-experts ---
def _hf_moe_fields(hf: dict, arch: str) -> dict:
    """The ModelConfig MoE fields from a Mixtral / Qwen3-MoE config.json ({} for dense families)."""
    if arch == "mixtral":  # intermediate_size is each expert's; no dense layers
        return dict(
            num_experts=_hf_count(hf, "num_local_experts"),
            num_experts_per_tok=_hf_count(hf, "num_experts_per_tok"),
            moe_intermediate_size=_hf_size(hf, "intermediate_size", "intermediate_size"),
            norm_topk_prob=True,
        )
    if arch != "qwen3_moe":
        return {}
    if hf.get("use_sliding_window"):
        raise ValueError(
            "config.json field 'use_sliding_window' is true: not supported for qwen3_moe"
        )
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(_is_int(i) and i >= 0 for i in only):
        raise ValueError(
            f"config.json field 'mlp_only_layers' must be a list of layer indices, got {only!r}"
        )
    return dict(
        num_experts=_hf_count(hf, key),
        num_experts_per_tok=_hf_count(hf, "num_experts_per_tok"),
        moe_intermediate_size=_hf_size(hf, "moe_intermediate_size", "intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # HF's Qwen3MoeConfig default
        mlp_only_layers=tuple(sorted(set(int(i) for i in only))),
        decoder_sparse_step=_hf_count(hf, "decoder_sparse_step", 1),
    )


def _hf_count(hf: dict, key: str, default=_REQUIRED) -> int:
    v = _hf_value(hf, key, default, "")
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return check_size(f"config.json field {key!r}", v, MAX_EXPERTS)


# --- end mixture-of-experts ---
