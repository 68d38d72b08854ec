"""Convert a model to a jaxserve checkpoint, quantizing its weights offline.

    python -m jaxserve.launch.convert --model path/to/hf_dir_or.gguf --quantization int4-awq \\
        --group_size 64 --output checkpoints/smollm2-awq-g64

Dataflow: load_model(--model, float32) -> [calibration tokens from --calib_sources (default the
stdlib's pydoc topics), tokenized with the model's tokenizer, for int4-awq / int4-gptq] ->
quantize_params(method, group_size, calib) -> float leaves (embeddings, norms) cast to --dtype ->
save_checkpoint(--output) with the config, the recipe (method, group size, calibration) and the
tokenizer files. Before loading, it logs what to expect from the options chosen
(`jaxserve.quant.expectations`: the measured SmolLM2 perplexity change of the closest measured
configuration, its cost, and the recipe measured within +5% when these options miss it).
`LLM(model="checkpoints/<name>")` or `--model checkpoints/<name>` then serves it.

--model, --dtype and --quantization are the shared launcher flags (`launch/flags.py`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxserve.launch import flags as shared_flags
from jaxserve.loading import load_model
from jaxserve.loading.checkpoint import save_checkpoint
from jaxserve.quant import METHODS as REGISTRY
from jaxserve.quant import calibration, expectations, quantize_params, refine

FLAGS = flags.FLAGS
log = logging.getLogger("jaxserve.convert")

METHODS = ("int4-rtn", "int4-awq", "int4-gptq", "int8", "fp8")
CALIBRATED = ("int4-awq", "int4-gptq")


def define_flags() -> None:
    """Convert's own flags, defined only when it runs as a program (so importing `convert` for
    the library function never collides with another launcher's --output)."""
    flags.DEFINE_string(
        "output", None, "Checkpoint directory to create (e.g. checkpoints/<name>); must not exist."
    )
    flags.DEFINE_integer(
        "group_size",
        128,
        "INT4 group size along the input dim: 32, 64 or 128; must divide every linear's input dim "
        "(SmolLM2's 576-wide inputs need 64 or 32). Ignored for int8/fp8 (per output channel).",
    )
    flags.DEFINE_integer(
        "calib_tokens",
        16384,
        "Calibration tokens for int4-awq / int4-gptq (from the stdlib's pydoc_data topics).",
        lower_bound=1,
    )
    flags.DEFINE_list(
        "calib_sources",
        ["pydoc"],
        "Calibration texts sharing the windows, comma-separated: pydoc (the stdlib's pydoc_data "
        "topics, the default), gnu-info (Debian's GNU info manuals under /usr/share/info).",
    )
    flags.DEFINE_integer(
        "calib_seqlen", 512, "Length of each calibration window (tokens).", lower_bound=2
    )
    flags.DEFINE_bool("act_order", False, "int4-gptq: quantize inputs by decreasing activity.")
    flags.DEFINE_integer(
        "refine_steps",
        0,
        "int4-gptq: Adam steps per layer of the block-wise refinement of the group scales/mins "
        "and norms towards the float layer's output (jaxserve.quant.refine); 0 = off.",
        lower_bound=0,
    )


def _cast_float_leaves(params: dict, dtype) -> dict:
    """Plain float arrays (embeddings, norms, biases) to dtype; quantized weights untouched."""

    def cast(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    is_q = lambda x: not isinstance(x, dict | jax.Array)
    return jax.tree_util.tree_map(cast, params, is_leaf=is_q)


def convert(
    model,
    method: str | None,
    output: str,
    group_size: int = 128,
    dtype: str = "bfloat16",
    calib_tokens: int = 16384,
    calib_seqlen: int = 512,
    act_order: bool = False,
    refine_steps: int = 0,
    calib_sources=("pydoc",),
):
    """Loads, quantizes (method None: keeps float weights) and saves; returns the output path."""
    if method is not None and method not in METHODS:
        raise ValueError(f"--quantization must be one of {METHODS}, got {method!r}")
    if Path(output).exists():
        raise ValueError(f"--output {output} already exists")
    calibration.describe_sources(calib_sources)  # an unknown source fails before the model loads
    if method is not None:  # the measured quality of these options (or "not measured"), up front
        for line in expectations.describe(
            method, group_size, act_order, refine_steps, calib_tokens, calib_seqlen, calib_sources
        ).splitlines():
            log.info("%s", line)
    loaded = load_model(model, dtype="float32")
    params = loaded.params
    recipe = {"quantization": method, "dtype": dtype, "source": loaded.source}
    if method is not None:
        calib = None
        if method.startswith("int4"):
            recipe["group_size"] = group_size
        if method in CALIBRATED:
            if loaded.tokenizer is None:
                raise ValueError(
                    f"{method} calibrates on text, but {loaded.source} has no tokenizer files"
                )
            calib = calibration.calibration_tokens(
                loaded.tokenizer, calib_tokens, calib_seqlen, sources=calib_sources
            )
            recipe["calibration"] = {
                "source": calibration.describe_sources(calib_sources),
                "windows": int(calib.shape[0]),
                "seqlen": int(calib.shape[1]),
            }
        if refine_steps and method != "int4-gptq":
            raise ValueError(f"--refine_steps applies to int4-gptq only, not {method}")
        options = {}
        if method == "int4-gptq":
            recipe.update(act_order=act_order, refine_steps=refine_steps)
            rc = refine.RefineConfig(steps=refine_steps) if refine_steps else None
            options = dict(act_order=act_order, refine_config=rc)
        elif act_order:
            raise ValueError(f"--act_order applies to int4-gptq only, not {method}")
        if method not in REGISTRY:
            raise ValueError(f"quantization method {method!r} is not registered in jaxserve.quant")
        params = quantize_params(params, loaded.config, method, group_size, calib, **options)
    params = _cast_float_leaves(params, jnp.dtype(dtype))
    return save_checkpoint(output, loaded.config, params, loaded.tokenizer, recipe)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not FLAGS.output:
        print("error: --output is required", file=sys.stderr)
        return 2
    try:
        settings = shared_flags.engine_config()  # unset: EngineConfig's defaults (bfloat16)
        path = convert(
            settings.model,
            settings.quantization,
            FLAGS.output,
            group_size=FLAGS.group_size,
            dtype=settings.dtype,
            calib_tokens=FLAGS.calib_tokens,
            calib_seqlen=FLAGS.calib_seqlen,
            act_order=FLAGS.act_order,
            refine_steps=FLAGS.refine_steps,
            calib_sources=FLAGS.calib_sources,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
