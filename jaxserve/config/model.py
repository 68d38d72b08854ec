"""`ModelConfig`: a decoder-only network's architecture (Llama 2/3/3.1, Mistral, Qwen2/3, SmolLM2,
Gemma 2/3, Phi-3, and the mixture-of-experts families), as ONE layer plus a few switches.

It is hashable, so jitted functions take it as a static argument; everything that varies per
request lives in arrays. `ModelConfig.from_hf(config.json)` reads a Hugging Face config; named
presets (`ModelConfig.preset(name)`, `PRESETS`) give real-scale shapes for the `dummy` load
format. Validates itself in `__post_init__` and raises `ValueError` naming the bad field: every
size an integer in [1, MAX_SIZES[field]] (so no config can ask for terabytes), rope_theta and
rms_norm_eps positive and finite, token ids non-negative; `from_hf` names the config.json field.
Import it from `jaxserve.config`, beside `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxserve.config.hf import fields_from_hf
from jaxserve.config.model_fields import (
    LAYER_TYPES,
    MAX_EXPERTS,
    MAX_SIZES,
    MLP_ACTIVATIONS,
    MOE_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    RopeScaling,
    _base_inv_freq,
    _is_int,
    check_positive_number,
    check_size,
)
from jaxserve.config.presets import PRESET_FIELDS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v projections.
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = ""
    # --- mixture-of-experts (Mixtral, Qwen3-MoE; `jaxserve/layers/moe.py`) ---
    # num_experts 0: every layer has the dense MLP. Otherwise layer l is sparse (router + experts
    # of width moe_intermediate_size) unless l is in mlp_only_layers or (l + 1) %
    # decoder_sparse_step != 0 (HF Qwen3-MoE's rule); dense layers use intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: top-k experts per token
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k probabilities (Mixtral: always)
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    # --- end mixture-of-experts ---
    # --- dense-family switches (Qwen3, Gemma 2/3, Phi-3, sliding windows; issue 26) ---
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
    norm_offset: float = 0.0  # Gemma: every RMSNorm scales by (norm_offset + weight)
    sandwich_norms: bool = False  # Gemma 2/3: post_attn_norm / post_mlp_norm on each block's output
    mlp_activation: str = "silu"  # of the gate: 'silu' (SwiGLU) | 'gelu_tanh' (Gemma's GeGLU)
    scale_embeddings: bool = False  # Gemma: embeddings * sqrt(hidden_size), in the activation dtype
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its ** -0.5, not Dh's
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    # Sliding-window attention: on a sliding layer a query at t sees keys p with t - p < window.
    sliding_window: int | None = None
    # Per layer 'sliding_attention' | 'full_attention' (HF's names); None: every layer slides
    # when sliding_window is set (Mistral, Phi-3).
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding layers, unscaled
    # --- end dense-family switches ---

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"expected one of {SUPPORTED_ARCHITECTURES}"
            )
        for field, limit in MAX_SIZES.items():
            check_size(f"ModelConfig.{field}", getattr(self, field), limit)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even (RoPE pairs), got {self.head_dim}")
        for field in ("rope_theta", "rms_norm_eps"):
            check_positive_number(f"ModelConfig.{field}", getattr(self, field))
        bos = (self.bos_token_id,) if self.bos_token_id is not None else ()
        for t in bos + tuple(self.eos_token_ids):
            if not _is_int(t) or t < 0:
                raise ValueError(f"ModelConfig token ids must be non-negative integers, got {t!r}")
        self._check_moe()
        self._check_dense_families()

    # --- dense-family switches ---
    def _check_dense_families(self) -> None:
        if isinstance(self.layer_types, list):  # from JSON (a saved checkpoint's config)
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_layers
            or not all(t in LAYER_TYPES for t in self.layer_types)
        ):
            raise ValueError(
                f"ModelConfig.layer_types must list one of {LAYER_TYPES} per layer "
                f"({self.num_layers}), got {self.layer_types!r}"
            )
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.mlp_activation must be one of {MLP_ACTIVATIONS}, got "
                f"{self.mlp_activation!r}"
            )
        if self.sliding_window is not None:
            check_size("ModelConfig.sliding_window", self.sliding_window, 2**31 - 1)
        for field in (
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
            "rope_local_theta",
        ):
            if getattr(self, field) is not None:
                check_positive_number(f"ModelConfig.{field}", getattr(self, field))
        if not (np.isfinite(self.norm_offset) and self.norm_offset >= 0):
            raise ValueError(f"ModelConfig.norm_offset must be >= 0, got {self.norm_offset!r}")
        if self.rope_scaling is not None:
            self.rope_scaling.divisors(self.head_dim // 2)  # checks the factors' count

    def layer_windows(self) -> np.ndarray:
        """i32[L]: each layer's sliding window, 0 = global attention."""
        if self.sliding_window is None:
            return np.zeros(self.num_layers, np.int32)
        types = self.layer_types or ("sliding_attention",) * self.num_layers
        return np.asarray(
            [self.sliding_window if t == "sliding_attention" else 0 for t in types], np.int32
        )

    @property
    def uses_sliding_window(self) -> bool:
        """Whether any layer attends within a window (else attention gets no window at all)."""
        return bool(self.layer_windows().any())

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' scale when it is not 1 / sqrt(head_dim) (Gemma), else None."""
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    def layer_inv_freq(self) -> np.ndarray:
        """f32[L, Dh / 2]: each layer's RoPE inverse frequencies (Gemma 3's sliding layers use
        rope_local_theta, unscaled; every other layer `inv_freq()`). Scanned with the layers."""
        table = np.broadcast_to(self.inv_freq(), (self.num_layers, self.head_dim // 2)).copy()
        if self.rope_local_theta is not None:
            local = _base_inv_freq(self.rope_local_theta, self.head_dim).astype(np.float32)
            table[self.layer_windows() > 0] = local
        return table

    @property
    def rope_long_from(self) -> int | None:
        """LongRoPE: the first position roped with the long factors (`inv_freq(long=True)`)."""
        rs = self.rope_scaling
        return rs.original_max_position_embeddings if rs and rs.rope_type == "longrope" else None

    @property
    def rope_attention_factor(self) -> float:
        """LongRoPE's cos/sin scale (1.0 otherwise)."""
        rs = self.rope_scaling
        return rs.attention_factor if rs and rs.rope_type == "longrope" else 1.0

    # --- end dense-family switches ---

    # --- mixture-of-experts ---
    def _check_moe(self) -> None:
        if self.num_experts == 0:
            if self.architecture in MOE_ARCHITECTURES:
                raise ValueError(f"architecture {self.architecture!r} needs num_experts > 0")
            return
        check_size("ModelConfig.num_experts", self.num_experts, MAX_EXPERTS)
        check_size("ModelConfig.num_experts_per_tok", self.num_experts_per_tok, self.num_experts)
        check_size(
            "ModelConfig.moe_intermediate_size",
            self.moe_intermediate_size,
            MAX_SIZES["intermediate_size"],
        )
        check_size("ModelConfig.decoder_sparse_step", self.decoder_sparse_step, self.num_layers)
        if not isinstance(self.mlp_only_layers, tuple) or not all(
            _is_int(i) and 0 <= i < self.num_layers for i in self.mlp_only_layers
        ):
            raise ValueError(
                f"ModelConfig.mlp_only_layers must be a tuple of layer indices in "
                f"[0, {self.num_layers}), got {self.mlp_only_layers!r}"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The sparse (mixture-of-experts) layers, ascending; () for a dense model."""
        if self.num_experts == 0:
            return ()
        return tuple(
            i
            for i in range(self.num_layers)
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with the dense MLP (w_gate/w_up/w_down), ascending."""
        sparse = set(self.moe_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)

    # --- end mixture-of-experts ---

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def inv_freq(self, long: bool = False) -> np.ndarray:
        """RoPE inverse frequencies, f32[head_dim // 2], with rope_scaling applied if configured
        (`long`: LongRoPE's table for positions from `rope_long_from` on)."""
        d = self.head_dim
        inv = _base_inv_freq(self.rope_theta, d)
        rs = self.rope_scaling
        divisors = rs.divisors(d // 2, long) if rs is not None else None
        if divisors is not None:
            inv = inv / divisors
        elif rs is not None and rs.rope_type == "linear":
            inv = inv / rs.factor
        elif rs is not None:
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * np.pi / inv
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor
            )
            scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
            mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
            inv = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
        return inv.astype(np.float32)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict (`hf.py`).

        A missing, non-numeric, non-positive or absurdly large field raises ValueError naming
        the config.json field (`loading.hf.load_hf_config` adds the file's path).
        """
        return cls(**fields_from_hf(hf, name))

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The named preset (`PRESETS`); ValueError naming the known ones for another name."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]


# name -> config: the presets' fields (presets.py) as ModelConfigs, each checked once here
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**f) for name, f in PRESET_FIELDS.items()}
