"""`python -m jaxserve.launch.generate --enable_lora --lora_modules name=path`: a row's `lora`
field selects its adapter (the tiny golden Llama, f32): each row's tokens equal LLM.generate's
with that LoRARequest; a name the job was not given, or a `lora` that is not a name, fails that
row alone; --lora_modules without --enable_lora stops before the model loads."""

from __future__ import annotations

import json

from absl import flags
from lora_testing import write_adapter
from model_testing import GOLDEN_DIR

from jaxserve import LLM, SamplingParams
from jaxserve.launch import generate
from jaxserve.lora import LoRARequest

FLAGS = flags.FLAGS
BASE = GOLDEN_DIR / "llama"
ENGINE = ["--dtype=float32", "--num_slots=4", "--max_model_len=64", "--page_size=8"]


def run(*args) -> int:
    FLAGS.unparse_flags()
    FLAGS(["generate", "--noprogress", *args])
    try:
        return generate.main(["generate"])
    finally:
        FLAGS.unparse_flags()


def test_rows_select_their_adapter(tmp_path, capsys):
    a = write_adapter(tmp_path / "a", BASE, rank=4, seed=1)
    b = write_adapter(tmp_path / "b", BASE, rank=2, seed=2, modules=("v_proj", "down_proj"))
    prompts = [[5, 6, 7, 8], [40, 41, 42], [9, 10, 11, 12, 13]]
    rows = [
        {"id": "base", "prompt_token_ids": prompts[0]},
        {"id": "a", "prompt_token_ids": prompts[1], "lora": "a"},
        {"id": "b", "prompt_token_ids": prompts[2], "lora": "b", "max_tokens": 5},
        {"id": "a2", "prompt_token_ids": prompts[0], "lora": "a"},
        {"id": "unknown", "prompt_token_ids": prompts[0], "lora": "c"},
        {"id": "not a name", "prompt_token_ids": prompts[0], "lora": 3},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    flags_ = [f"--model={BASE}", *ENGINE, "--enable_lora", "--max_lora_rank=4"]
    flags_ += [f"--lora_modules=a={a} b={b}", "--temperature=0", "--max_tokens=6"]
    flags_ += ["--ignore_eos", "--output_token_ids", f"--input={src}", f"--output={out}"]
    assert run(*flags_) == 0  # rows that fail are written as error rows; the job succeeds
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    llm = LLM(str(BASE), enable_lora=True, max_lora_rank=4, num_slots=4, max_model_len=64,
              page_size=8, dtype="float32")  # fmt: skip
    lora = {"a": LoRARequest("a", 1, str(a)), "b": LoRARequest("b", 2, str(b))}

    def want(prompt, adapter, max_tokens=6):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        p = {"prompt_token_ids": prompt}
        return llm.generate([p], sp, use_tqdm=False, lora_request=adapter)[0].outputs[0].token_ids

    assert got["base"]["token_ids"] == want(prompts[0], None)
    assert got["a"]["token_ids"] == want(prompts[1], lora["a"])
    assert got["b"]["token_ids"] == want(prompts[2], lora["b"], 5)
    assert got["a2"]["token_ids"] == want(prompts[0], lora["a"]) != got["base"]["token_ids"]
    assert (
        "lora 'c' is not an adapter of this job (--lora_modules gave: a, b)"
        in (got["unknown"]["error"])
    )
    assert "'lora' must be an adapter's name" in got["not a name"]["error"]


def test_lora_modules_need_enable_lora(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt_token_ids": [5]}\n')
    args = [f"--model={BASE}", f"--input={src}", f"--output={tmp_path / 'o.jsonl'}"]
    assert run(*args, "--lora_modules=a=/x") == 2
    assert "--lora_modules needs --enable_lora" in capsys.readouterr().err
    assert run(*args, "--enable_lora", "--lora_modules=a") == 2
    assert "--lora_modules 'a': expected name=path" in capsys.readouterr().err
