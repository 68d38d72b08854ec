"""Decode with LoRA adapters against without: SmolLM2-135M-Instruct (the default model), 32
slots, a batch of 32 greedy requests whose rows use 0, 1, 4 or 8 distinct adapters (rank 16 on
all seven projections; PEFT's initialisation: A random, B zero) on an engine with max_loras=8,
beside the same engine without LoRA. Rounds interleave the settings; the table gives each one's
median decode tokens/s and its ratio to no LoRA.

    python experiments/lora_step.py [--rounds 5] [--max_tokens 64] [--json_out FILE]

The device form (`layers/lora.py`) computes every slot's product for every row, so its cost
follows max_loras, not the adapters the batch uses; the 0-adapter row shows that floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.lora import LoRARequest
from jaxserve.lora.peft import target_dims

HF = {
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}


def write_adapter(path: Path, config, rank: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    tensors = {}
    for name, (d_in, d_out) in target_dims(config).items():
        for layer in range(config.num_layers):
            key = f"base_model.model.model.layers.{layer}.{HF[name]}"
            a = rng.normal(0, d_in**-0.5, (rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = np.zeros((d_out, rank), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(HF)}
    (path / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": [
        m.split(".")[1] for m in HF.values()]}))  # fmt: skip
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max_tokens", type=int, default=64)
    ap.add_argument("--json_out", default=None)
    args = ap.parse_args()

    kw = dict(num_slots=32, max_model_len=256, warmup=True)
    plain = LLM(**kw)
    lora = LLM(enable_lora=True, max_loras=8, max_lora_rank=16, **kw)
    tmp = Path(tempfile.mkdtemp())
    adapters = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", lora.model_config, 16, i)))
        for i in range(8)
    ]
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, 16).tolist()} for _ in range(32)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    settings = {"no LoRA": (plain, None)}
    for k in (0, 1, 4, 8):
        choice = [adapters[i % k] if k else None for i in range(32)]
        settings[f"LoRA engine, {k} adapters"] = (lora, choice)
    for llm, choice in settings.values():  # loads every adapter once before timing
        llm.generate(prompts[:8], sp, use_tqdm=False, lora_request=choice and choice[:8])
    times: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, (llm, choice) in settings.items():
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False, lora_request=choice)
            times[name].append(time.perf_counter() - t0)
    tokens = 32 * args.max_tokens
    base = statistics.median(times["no LoRA"])
    print(f"| setting | median s | decode tok/s | time vs no LoRA |  ({args.rounds} rounds)")
    print("|---|---|---|---|")
    rows = []
    for name, ts in times.items():
        m = statistics.median(ts)
        rows.append({"setting": name, "median_s": m, "tok_s": tokens / m, "ratio": m / base})
        print(f"| {name} | {m:.2f} | {tokens / m:.0f} | {m / base:.2f}x |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "times": times}, indent=1))


if __name__ == "__main__":
    main()
