"""`ModelConfig`: a Llama-family network's architecture (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2).

It is hashable, so jitted functions take it as a static argument; everything that varies per
request lives in arrays. `ModelConfig.from_hf(config.json)` reads a Hugging Face config; named
presets (`ModelConfig.preset(name)`, `PRESETS`) give real-scale shapes for the `dummy` load
format. Validates itself in `__post_init__` and raises `ValueError` naming the bad field. Import
it from `jaxserve.config`, beside `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"expected one of {SUPPORTED_ARCHITECTURES}"
            )
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, field) <= 0:
                raise ValueError(
                    f"ModelConfig.{field} must be positive, got {getattr(self, field)}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, f32[head_dim // 2], with llama3 scaling applied if configured."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling
        if rs is not None:
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
        """Builds a config from a Hugging Face `config.json` dict."""
        model_type = hf.get("model_type", "")
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise ValueError(
                f"unknown architecture: config.json model_type {model_type!r} "
                f"(architectures={hf.get('architectures')}); supported: {SUPPORTED_ARCHITECTURES}"
            )
        sliding = hf.get("sliding_window")
        if (
            arch == "mistral"
            and sliding is not None
            and sliding < hf.get("max_position_embeddings", 0)
        ):
            # Sliding-window attention is not implemented; serving past the window would be wrong.
            max_pos = int(sliding)
        else:
            max_pos = int(hf.get("max_position_embeddings", 4096))
        heads = int(hf["num_attention_heads"])
        rs = hf.get("rope_scaling") or (hf.get("rope_parameters") or {})
        rope_scaling = None
        rope_type = rs.get("rope_type", rs.get("type")) if rs else None
        if rope_type == "llama3":
            rope_scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        elif rope_type not in (None, "default"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only 'llama3')")
        rope_theta = hf.get(
            "rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        )
        eos = hf.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            max_position_embeddings=max_pos,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]


PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="smollm2-135m",
    ),
    "llama3.2-1b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        name="llama3.2-1b",
    ),
    "llama3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
        name="llama3-8b",
    ),
    "qwen2-7b": ModelConfig(
        architecture="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        attention_bias=True,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_ids=(151643, 151645),
        name="qwen2-7b",
    ),
    # A tiny config for unit tests: every code path, milliseconds per step on CPU.
    "tiny": ModelConfig(
        architecture="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="tiny",
    ),
}


# Model-dependent defaults, filled by `EngineConfig.for_model`.
