r"""The GPU program inspector's command line: a GPU engine's warm-up programs compiled for an H100 /
H200 on this machine (no GPU, no weights), one row per program.

    python -m jaxserve.launch.gpu_programs --model=llama3-8b --num_slots=64 --max_model_len=4096 \
        --programs=decode,sample --select='width=256' --target=h100

Needs the `gpu-compile` extra (`pip install -e '.[gpu-compile]'`). --model is a preset or a Hugging
Face folder (only its config.json is read); every engine flag applies (--quantization,
--kv_cache_dtype, --tensor_parallel_size, --data_parallel_size, ...). Columns (per step; see
`jaxserve/bench/gpu_report.py`): kernels, kernels per layer, host launches (a CUDA graph counts
one), launches outside CUDA graphs, host round trips (conditionals and while loops the host waits
on), weight bytes copied (MiB), collectives, compile seconds. A program that does not compile gets a row saying why (and the exit status is
non-zero). --json_out writes every report whole
(kernel names, the copies, the loops). --compiler_options replaces the engine's XLA options
(`Resolved.compiler_options`) with others, e.g. to compare a choice: 'k=v,k=v' or 'none'.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

from absl import app, flags

from jaxserve.bench import deviceless
from jaxserve.launch import flags as engine_flags

_TARGET = flags.DEFINE_string(
    "target", "h100", "GPU to compile for: h100, h200, or a GpuTargetConfigProto text file."
)
_PROGRAMS = flags.DEFINE_list(
    "programs",
    "decode,sample,prefill,speculative,slots",
    "Program kinds: decode, sample, prefill, speculative, slots.",
)
_SELECT = flags.DEFINE_string("select", "", "Only programs whose name contains this text.")
_LIMIT = flags.DEFINE_integer("limit", None, "Compile at most this many programs.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write each report as a JSON line here.")
_OPTIONS = flags.DEFINE_string(
    "compiler_options", None, "XLA options instead of the engine's: 'k=v,k=v', or 'none'."
)
flags.adopt_module_key_flags(engine_flags)
COLUMNS = (
    "program",
    "compile_s",
    "kernels/step",
    "kernels/layer",
    "host launches",
    "outside graphs",
    "host round trips",
    "weight MB copied",
    "collectives",
)


def _options(text: str | None) -> dict | None:
    if text is None:
        return None
    if text == "none":
        return {}
    pairs = [kv.split("=", 1) for kv in text.split(",") if kv]
    if any(len(p) != 2 for p in pairs):
        raise app.UsageError(f"--compiler_options: expected 'k=v,k=v', got {text!r}")
    return dict(pairs)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.WARNING)
    reason = deviceless.missing()
    if reason:
        sys.exit(reason)
    deviceless.prepare()
    from jaxserve.bench import gpu_programs

    config = engine_flags.engine_config()
    if config.model is None:
        config = dataclasses.replace(config, model="smollm2-135m")
    engine = gpu_programs.abstract_engine(config, _TARGET.value)
    programs = [
        p
        for p in gpu_programs.warmup_programs(engine, tuple(_PROGRAMS.value))
        if _SELECT.value in p.name
    ][: _LIMIT.value]
    e = engine.engine_config
    print(
        f"{engine.model_config.name or e.model} on {engine.target.describe()} "
        f"(TP {e.tensor_parallel_size} x DP {e.data_parallel_size}), {len(programs)} programs; "
        f"XLA options: {dict(engine.resolved.compiler_options) or 'none'}"
    )
    out = open(_JSON_OUT.value, "w") if _JSON_OUT.value else None  # noqa: SIM115
    failed = 0
    print(" | ".join(COLUMNS))
    for program in programs:
        try:
            r = gpu_programs.inspect(engine, program, _options(_OPTIONS.value))
        except Exception as e:  # noqa: BLE001 - a program that does not compile is a finding
            failed += 1
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"{program.name} | does not compile: {error}", flush=True)
            record = {"name": program.name, "error": error}
        else:
            row = r.row()
            print(" | ".join(str(row[k]) for k in COLUMNS), flush=True)
            record = dataclasses.asdict(r)
        if out:
            out.write(json.dumps(record) + "\n")
            out.flush()
    if out:
        out.close()
    if failed:
        sys.exit(f"{failed} of {len(programs)} programs did not compile")


if __name__ == "__main__":
    os.environ.setdefault(deviceless.SKIP_CHECK, "1")  # before jax starts its backends
    app.run(main)
