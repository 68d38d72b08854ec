"""Writes the Hugging Face PEFT LoRA goldens that tests/lora/test_peft_goldens.py compares against.

Run from the repository root with the golden venv of make_goldens.py (Python 3.11, CPU torch) plus
peft:

    .venv-golden/bin/pip install peft
    .venv-golden/bin/python tests/golden/make_lora_goldens.py          # a few seconds

For each case it builds the golden base model (tests/golden/<base>), wraps it with PEFT's
`get_peft_model` and a `LoraConfig` whose A and B are both random (`init_lora_weights=False`: B is
not zero, so the adapter changes the logits), saves the adapter with PEFT's own `save_pretrained`
(adapter_config.json + adapter_model.safetensors, PEFT's tensor names) and the adapted model's f32
logits on the base golden's tokens:

  tests/golden/lora/<case>/adapter_config.json, adapter_model.safetensors, logits.npz
    llama_r4        Llama, r 4, alpha 8, all seven projections
    llama_rs8       Llama, r 8, alpha 16, rsLoRA, q/v/down only, layer 1 only (layers_to_transform)
    phi3_fused      Phi-3, r 4, alpha 4, the fused qkv_proj and gate_up_proj, o_proj, down_proj
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import peft
import torch
import transformers

GOLDEN = Path(os.path.relpath(Path(__file__).parent))  # relative: adapter_config.json names it
CASES = {
    "llama_r4": dict(
        base="llama",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "llama_rs8": dict(
        base="llama",
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        layers_to_transform=[1],
    ),
    "phi3_fused": dict(
        base="phi3",
        r=4,
        lora_alpha=4,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    ),
}


def main() -> None:
    for seed, (name, spec) in enumerate(CASES.items()):
        spec = dict(spec)
        base = GOLDEN / spec.pop("base")
        torch.manual_seed(100 + seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, **spec)
        model = peft.get_peft_model(model, config).eval()
        out = GOLDEN / "lora" / name
        model.save_pretrained(out)
        tokens = np.load(base / "logits.npz")["tokens"]
        with torch.no_grad():
            logits = model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
        np.savez(out / "logits.npz", tokens=tokens, logits=logits)
        (out / "README.md").unlink(missing_ok=True)  # PEFT's model card: not needed
        cfg = json.loads((out / "adapter_config.json").read_text())
        print(name, "base", base.name, "r", cfg["r"], "logits", logits.shape)
    print("peft", peft.__version__, "transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    main()
