"""Frozen configuration dataclasses: the model's architecture and the engine's sizes.

`ModelConfig` describes a Llama-family network (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2). It is hashable,
so jitted functions take it as a static argument; everything that varies per request lives in arrays.
Named presets (`ModelConfig.preset(name)`) give real-scale shapes for the `dummy` load format.

`EngineConfig` sizes the engine: slots, pages, dtypes, which attention implementation runs.
Both validate themselves in `__post_init__` and raise `ValueError` naming the bad field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_IMPLS = ("auto", "ragged", "reference", "pallas", "pallas_interpret")


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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the serving engine. Everything here is fixed for the engine's lifetime.

    num_pages: KV pages in the pool. If None, derived from kv_cache_memory (bytes) when given,
      else enough for every slot to reach max_model_len.
    attention_impl: 'auto' = Pallas kernels on GPU, 'ragged' elsewhere (XLA decode attention over
      the step's live pages, cost following the live tokens; prefill chunks use the reference);
      'reference' = the jnp gather reference for everything; 'pallas_interpret' runs the Pallas
      kernels in interpret mode (CPU tests).
    """

    num_slots: int = 32
    max_model_len: int = 2048
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    attention_impl: str = "auto"
    max_num_batched_tokens: int = 512  # per-step token budget for prefill chunks
    prefill_chunk_size: int = 256  # fixed prefill chunk length (power of two)
    decode_steps: int = 1  # decode steps per host round trip
    batching: str = "continuous"  # or "static"
    async_scheduling: bool = True  # plan and dispatch step N+1 before reading step N's tokens
    enable_prefix_caching: bool = False  # reuse cached full KV pages of identical token prefixes
    # Decode row buckets: a decode step computes only the first B slots, B the smallest bucket
    # holding every occupied slot (the scheduler packs requests into the lowest slots). "auto" =
    # powers of two from 8 up to num_slots on CPU, where a step's matmuls cost in proportion to
    # its rows; (num_slots,) elsewhere (a GPU decode step streams the weights whatever the rows).
    slot_buckets: tuple[int, ...] | str = "auto"
    # A step with decode rows and one prefill chunk among a prompt's first two runs both in one
    # forward pass (`runner._mixed`): the layer weights are read once and the matmuls get more
    # rows. Only with decode_steps 1 and the full row bucket (a bounded set of extra programs).
    # Off by default: on the 2-core CPU the gain was within noise (the step alone 0.99x-1.28x,
    # SmolLM2's benchmark 0.96x and 1.05x in two A/B pairs; RESULTS.md section 18); not measured
    # on a GPU.
    fuse_prefill: bool = False

    def __post_init__(self):
        def pos(field):
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"EngineConfig.{field} must be a positive int, got {v!r}")

        for f in (
            "num_slots",
            "max_model_len",
            "page_size",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "decode_steps",
        ):
            pos(f)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"EngineConfig.page_size must be a power of two, got {self.page_size}")
        if self.prefill_chunk_size & (self.prefill_chunk_size - 1):
            raise ValueError(
                f"EngineConfig.prefill_chunk_size must be a power of two, got {self.prefill_chunk_size}"
            )
        if self.num_pages is not None:
            pos("num_pages")
        if self.kv_cache_memory is not None:
            pos("kv_cache_memory")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"EngineConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}"
            )
        for f in ("async_scheduling", "enable_prefix_caching", "fuse_prefill"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"EngineConfig.{f} must be a bool, got {getattr(self, f)!r}")
        if self.slot_buckets != "auto":
            b = self.slot_buckets
            if (
                not isinstance(b, (tuple, list))
                or not b
                or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in b)
                or list(b) != sorted(set(b))
                or b[-1] != self.num_slots
            ):
                raise ValueError(
                    "EngineConfig.slot_buckets must be 'auto' or increasing positive ints ending "
                    f"at num_slots={self.num_slots}, got {b!r}"
                )
            object.__setattr__(self, "slot_buckets", tuple(b))
        if self.batching not in ("continuous", "static"):
            raise ValueError(
                f"EngineConfig.batching must be 'continuous' or 'static', got {self.batching!r}"
            )

    def resolved_slot_buckets(self, backend: str) -> tuple[int, ...]:
        """The decode row buckets on `backend` ('cpu', 'gpu', ...): see `slot_buckets`."""
        if self.slot_buckets != "auto":
            return self.slot_buckets
        if backend != "cpu":
            return (self.num_slots,)
        return tuple(b for b in (8, 16, 32, 64, 128, 256, 512) if b < self.num_slots) + (
            self.num_slots,
        )

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)
