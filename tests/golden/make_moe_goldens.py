"""Writes the mixture-of-experts golden files (Mixtral, Qwen3-MoE) the MoE tests compare against.

Run from the repository root with Python 3.11 and CPU torch, like `make_goldens.py`:

    .venv-hf/bin/python tests/golden/make_moe_goldens.py        # ~10 s on 2 cores

It writes, under tests/golden/ (nothing else is touched; the dense goldens stay byte-identical):

  <name>/config.json, model.safetensors, logits.npz, routing.npz, greedy.json
      Tiny random checkpoints (hidden 64, 4 heads, 2 KV heads, head_dim 16, vocab 256), saved with
      save_pretrained(safe_serialization=True) (transformers 5 writes the per-expert tensor names
      of the released checkpoints: `experts.{e}.w1/w2/w3`, `experts.{e}.gate_proj/...`), for
        mixtral            MixtralForCausalLM, 2 layers, top-2 of 8 experts
        qwen3_moe          Qwen3MoeForCausalLM, 4 layers, top-4 of 16, norm_topk_prob false,
                           mlp_only_layers [2] (layer 2 is a dense MLP of intermediate_size)
        qwen3_moe_sparse2  Qwen3MoeForCausalLM, 3 layers, top-2 of 4, norm_topk_prob true,
                           decoder_sparse_step 2 (only layer 1 is sparse)
      logits.npz: `tokens` i32[2, 12] and HF's f32 `logits` [2, 12, 256], as the dense goldens.
      routing.npz: per sparse layer l, HF's router on those 24 tokens (flattened row-major):
        `experts_{l}` i64[24, k] (descending probability), `weights_{l}` f32[24, k],
        `logits_{l}` f32[24, E].
      greedy.json: for 3 prompts, HF's 12 greedy tokens (cached decoding) and the top-2 logit
        margin at each step (tests compare up to the first near-tie).
      Matrices (the router too) use std 1/sqrt(fan_in) and norms 1 + 0.1 N(0, 1), so router logits
      are O(1): different tokens pick different experts (the script prints how many each layer
      uses: 5-16 of E on these 24 tokens).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = Path(__file__).resolve().parent

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
PROMPTS = [[3, 17, 99, 5, 42, 8, 1], [250, 7], [11, 12, 13, 14, 15, 16, 200, 31, 64]]
NEW_TOKENS = 12


def moe_models() -> dict[str, torch.nn.Module]:
    return {
        "mixtral": MixtralForCausalLM(
            MixtralConfig(
                **TINY,
                intermediate_size=96,  # each expert's
                num_hidden_layers=2,
                num_local_experts=8,
                num_experts_per_tok=2,
                rms_norm_eps=1e-5,
                sliding_window=None,
            )
        ),
        "qwen3_moe": Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **TINY,
                intermediate_size=128,  # the dense MLP of mlp_only_layers
                moe_intermediate_size=32,
                num_hidden_layers=4,
                num_experts=16,
                num_experts_per_tok=4,
                norm_topk_prob=False,
                mlp_only_layers=[2],
                decoder_sparse_step=1,
                rms_norm_eps=1e-6,
            )
        ),
        "qwen3_moe_sparse2": Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                **TINY,
                intermediate_size=96,
                moe_intermediate_size=48,
                num_hidden_layers=3,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                mlp_only_layers=[],
                decoder_sparse_step=2,
                rms_norm_eps=1e-6,
            )
        ),
    }


@torch.no_grad()
def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Matrices N(0, 1/D_in) (embeddings and routers too); norms 1 + 0.1 N(0, 1)."""
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.1 * noise)
        else:
            p.copy_(noise / p.shape[-1] ** 0.5)


def routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{layer index: its router module} for the sparse layers."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(block, "gate") and hasattr(block, "experts"):
            out[i] = block.gate
    return out


@torch.no_grad()
def greedy(model: torch.nn.Module) -> list[dict]:
    records = []
    for prompt in PROMPTS:
        out, margins = [], []
        step_input, past = torch.tensor([prompt]), None
        for _ in range(NEW_TOKENS):
            res = model(input_ids=step_input, past_key_values=past, use_cache=True)
            logits, past = res.logits[0, -1].float(), res.past_key_values
            top2 = torch.topk(logits, 2)
            out.append(int(top2.indices[0]))
            margins.append(float(top2.values[0] - top2.values[1]))
            step_input = torch.tensor([[out[-1]]])
        records.append({"prompt_token_ids": prompt, "token_ids": out, "top2_margin": margins})
    return records


@torch.no_grad()
def write_tiny(name: str, model: torch.nn.Module, seed: int) -> None:
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    gen = torch.Generator().manual_seed(seed)
    randomize(model, gen)
    model = model.float().eval()
    model.save_pretrained(out, safe_serialization=True)
    for extra in out.glob("generation_config.json"):
        extra.unlink()
    tokens = torch.randint(0, TINY["vocab_size"], (2, 12), generator=gen)
    captured = {}
    hooks = [
        gate.register_forward_hook(lambda m, i, o, l=l: captured.__setitem__(l, o))
        for l, gate in routers(model).items()
    ]
    logits = model(input_ids=tokens).logits.float().numpy()
    for h in hooks:
        h.remove()
    routing = {}
    for l, (router_logits, scores, indices) in sorted(captured.items()):
        routing[f"experts_{l}"] = indices.numpy()
        routing[f"weights_{l}"] = scores.float().numpy()
        routing[f"logits_{l}"] = router_logits.float().numpy()
    np.savez(out / "logits.npz", tokens=tokens.numpy().astype(np.int32), logits=logits)
    np.savez(out / "routing.npz", **routing)
    records = greedy(model)
    golden = {"new_tokens": NEW_TOKENS, "dtype": "float32", "prompts": records}
    (out / "greedy.json").write_text(json.dumps(golden, indent=1) + "\n")
    used = {l: np.unique(v).size for l, v in routing.items() if l.startswith("experts")}
    print(
        f"{name}: {sorted(p.name for p in out.iterdir())}, |logits| {np.abs(logits).max():.2f}, "
        f"experts used per layer {used}, min margin "
        f"{min(min(r['top2_margin']) for r in records):.4f}"
    )


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # on a shared 2-core machine, 2 threads can be far slower
    for seed, (name, model) in enumerate(moe_models().items()):
        write_tiny(name, model, 100 + seed)


if __name__ == "__main__":
    main()
