"""`ModelConfig`: a Llama-family network's architecture (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2).

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

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            check_positive_number(f"rope_scaling.{field}", getattr(self, field))
        if self.high_freq_factor <= self.low_freq_factor:  # the smoothing divides by their gap
            raise ValueError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        check_size(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            MAX_SIZES["max_position_embeddings"],
        )


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
        """Builds a config from a Hugging Face `config.json` dict.

        A missing, non-numeric, non-positive or absurdly large field raises ValueError naming
        the config.json field (`hf.load_hf_config` adds the file's path).
        """
        if not isinstance(hf, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(hf).__name__}")
        model_type = hf.get("model_type", "")
        arch = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise ValueError(
                f"unknown architecture: config.json model_type {model_type!r} "
                f"(architectures={hf.get('architectures')}); supported: {SUPPORTED_ARCHITECTURES}"
            )
        heads = _hf_size(hf, "num_attention_heads", "num_heads")
        hidden = _hf_size(hf, "hidden_size", "hidden_size")
        max_pos = _hf_size(hf, "max_position_embeddings", "max_position_embeddings", 4096)
        sliding = hf.get("sliding_window")
        if arch == "mistral" and sliding is not None:
            sliding = _hf_size(hf, "sliding_window", "max_position_embeddings")
            # Sliding-window attention is not implemented; serving past the window would be wrong.
            max_pos = min(max_pos, sliding)
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
        elif rope_type not in (None, "default"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (only 'llama3')")
        if "rope_theta" in hf:
            rope_theta = _hf_number(hf, "rope_theta")
        else:
            params = hf.get("rope_parameters") or {}
            rope_theta = _hf_number(params, "rope_theta", 10000.0, prefix="rope_parameters.")
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
        return cls(
            architecture=arch,
            vocab_size=_hf_size(hf, "vocab_size", "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_size(hf, "intermediate_size", "intermediate_size"),
            num_layers=_hf_size(hf, "num_hidden_layers", "num_layers"),
            num_heads=heads,
            num_kv_heads=_hf_size(hf, "num_key_value_heads", "num_kv_heads", heads),
            head_dim=_hf_size(hf, "head_dim", "head_dim") if head_dim else hidden // heads,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=_hf_number(hf, "rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
            max_position_embeddings=max_pos,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]


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
