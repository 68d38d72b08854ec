"""The leaves of a model config: the architecture names, the RoPE scaling dataclass, the size
bounds and the checks every config field goes through (`model.py`, `hf.py` and `presets.py` build
on these; this module imports none of them)."""

from __future__ import annotations

import dataclasses

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")
# --- dense families (issue 26): HF model_type -> architecture ---
DENSE_FAMILY_TYPES = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}
SUPPORTED_ARCHITECTURES += tuple(DENSE_FAMILY_TYPES.values())
MLP_ACTIVATIONS = ("silu", "gelu_tanh")  # SwiGLU; Gemma's GeGLU with tanh-approximated GELU
LAYER_TYPES = ("sliding_attention", "full_attention")  # HF's names
# --- end dense families ---
# --- mixture-of-experts (issue 26) ---
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")  # need num_experts > 0
MAX_EXPERTS = 2**14
# --- end mixture-of-experts ---


ROPE_TYPES = ("llama3", "linear", "longrope", "freq_factors")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `rope_type` picks which fields apply (inv = the base frequencies):

    'llama3'       HF `rope_type: llama3` (Llama 3.1): frequency-dependent, from factor,
                   low/high_freq_factor and original_max_position_embeddings
    'linear'       HF `rope_type: linear` (Gemma 3's global layers): inv / factor
    'longrope'     HF `rope_type: longrope` (Phi-3): inv / short_factor at positions below
                   original_max_position_embeddings, inv / long_factor from there on (per position:
                   what HF's cached decoding does once a sequence grows past it); cos and sin are
                   multiplied by attention_factor
    'freq_factors' GGUF `rope_freqs.weight` (llama.cpp's llama3 scaling): inv / freq_factors
    """

    factor: float = 1.0
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    original_max_position_embeddings: int | None = None  # llama3, longrope
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()  # longrope: divisors per frequency, f32[Dh / 2]
    long_factor: tuple[float, ...] = ()  # longrope
    attention_factor: float = 1.0  # longrope: cos/sin scale
    freq_factors: tuple[float, ...] = ()  # freq_factors: divisors per frequency

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}"
            )
        for field in ("short_factor", "long_factor", "freq_factors"):  # lists from JSON
            values = tuple(getattr(self, field))
            for v in values:
                check_positive_number(f"rope_scaling.{field}[]", v)
            object.__setattr__(self, field, tuple(float(v) for v in values))
        needs = {
            "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
            "freq_factors": ("freq_factors",),
        }.get(self.rope_type, ())
        for field in needs:
            if getattr(self, field) in (None, ()):
                raise ValueError(f"rope_scaling.{field} is missing (rope_type {self.rope_type!r})")
        for field in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
            if getattr(self, field) is not None:
                check_positive_number(f"rope_scaling.{field}", getattr(self, field))
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(  # the smoothing divides by their gap
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if self.rope_type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ValueError("rope_scaling.short_factor and long_factor must have the same length")
        if self.original_max_position_embeddings is not None:
            check_size(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                MAX_SIZES["max_position_embeddings"],
            )

    def divisors(self, n: int, long: bool = False) -> np.ndarray | None:
        """The per-frequency divisors f64[n] of 'longrope' / 'freq_factors' (None for the others)."""
        if self.rope_type == "longrope":
            f = self.long_factor if long else self.short_factor
        elif self.rope_type == "freq_factors":
            f = self.freq_factors
        else:
            return None
        if len(f) != n:
            raise ValueError(
                f"rope_scaling ({self.rope_type}) has {len(f)} factors per frequency, expected "
                f"head_dim / 2 = {n}"
            )
        return np.asarray(f, np.float64)


# Upper bounds far above any released model (Llama 3.1 405B: D 16384, I 53248, L 126, V 128256;
# the largest vocabularies ~262k), so a config whose sizes would allocate terabytes, or build
# millions of tensor names, fails with an error naming the field before anything is allocated.
MAX_SIZES = {
    "vocab_size": 10**7,
    "hidden_size": 2**17,
    "intermediate_size": 2**20,
    "num_layers": 10**4,
    "num_heads": 2**12,
    "num_kv_heads": 2**12,
    "head_dim": 2**12,
    "max_position_embeddings": 2**30,
}


def _base_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_size(name: str, v, limit: int) -> int:
    """`v` if it is an integer in [1, limit], else ValueError naming `name`, the value and limit."""
    if not _is_int(v):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if v <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    if v > limit:
        raise ValueError(f"{name} = {v} is implausibly large (at most {limit})")
    return int(v)


def check_positive_number(name: str, v) -> float:
    """`v` as a float if it is a finite positive number, else ValueError naming `name`."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    if not (np.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)
