"""`python -m jaxserve.launch.convert` on a tiny HF directory, then the checkpoint runs with no LLM.

The CLI runs in a subprocess: its absl flags (--output, ...) must not collide with other launchers'
flags defined in this test process.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np

from jaxserve import checkpoint
from jaxserve.loading import load_model
from jaxserve.perplexity import perplexity
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


def test_convert_bad_input_fails_with_a_message(tmp_path):
    r = _convert(f"--model={GOLDEN}", "--quantization=int4-awq", f"--output={tmp_path / 'x'}")
    assert r.returncode == 2
    assert "int4-awq calibrates on text" in r.stderr and "no tokenizer" in r.stderr
    assert not (tmp_path / "x").exists()
