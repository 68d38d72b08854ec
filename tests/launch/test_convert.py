"""`python -m jaxserve.launch.convert` on a tiny HF directory, then the checkpoint runs with no LLM.

The CLI runs in a subprocess (as a user runs it); bad input goes through the library function.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.eval.perplexity import perplexity
from jaxserve.loading import checkpoint, load_model
from jaxserve.quant import Int4Weight, quantize_params

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llama"


def _convert(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.launch.convert", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_convert_int4_rtn_then_forward_matches_in_process_quantization(tmp_path):
    out = tmp_path / "tiny-int4"
    r = _convert(
        f"--model={GOLDEN}",
        "--quantization=int4-rtn",
        "--group_size=32",
        "--dtype=float32",
        f"--output={out}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert checkpoint.is_checkpoint(out)
    recipe = checkpoint.read_recipe(out)
    assert recipe["quantization"] == "int4-rtn" and recipe["group_size"] == 32
    assert recipe["dtype"] == "float32"

    loaded = load_model(str(out))  # the loader's checkpoint branch: nothing else needed
    assert isinstance(loaded.params["layers"]["w_up"], Int4Weight)
    ref = load_model(str(GOLDEN))
    want = quantize_params(ref.params, ref.config, "int4-rtn", 32)
    ids = np.arange(1, 65) % loaded.config.vocab_size
    got = perplexity(loaded.params, loaded.config, ids, window=32, batch=2)
    exp = perplexity(want, ref.config, ids, window=32, batch=2)
    assert np.isfinite(got["ppl"])
    assert got["nll"] == exp["nll"]


def test_convert_bad_input_names_the_problem(tmp_path):
    from jaxserve.launch.convert import convert

    with pytest.raises(ValueError, match="int4-awq calibrates on text.*no tokenizer"):
        convert(str(GOLDEN), "int4-awq", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="--quantization must be one of"):
        convert(str(GOLDEN), "int4", str(tmp_path / "y"))
    with pytest.raises(ValueError, match="group_size 128 does not divide the input dim"):
        convert(str(GOLDEN), "int4-rtn", str(tmp_path / "z"), group_size=128)
    with pytest.raises(ValueError, match="--refine_steps applies to int4-gptq only"):
        convert(str(GOLDEN), "int4-rtn", str(tmp_path / "r"), group_size=32, refine_steps=8)
    with pytest.raises(ValueError, match="unknown calibration source 'wiki'"):
        convert(str(GOLDEN), "int4-gptq", str(tmp_path / "c"), calib_sources=["pydoc", "wiki"])
    with pytest.raises(ValueError, match="--act_order applies to int4-gptq only"):
        convert(str(GOLDEN), "int8", str(tmp_path / "a"), act_order=True)
    assert not any(tmp_path.iterdir())
