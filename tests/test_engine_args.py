"""One build path (`engine_args.build_engine`): every front door takes the same arguments with the
same defaults, and the runner and engine take only what it finished (a config filled for the
model, the mesh of its parallel sizes), deriving neither."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine_args import build_engine
from jaxserve.launch import bench, serve
from jaxserve.launch import flags as engine_flags

# Non-default values for a tiny dummy engine, some in vLLM's spellings (max_num_seqs, block_size,
# dtype "float", speculative_config), as a user passes them to LLM(...) or AsyncLLM(...)
SETTINGS = dict(
    load_format="dummy",
    dtype="float",
    max_num_seqs=3,
    block_size=16,
    max_model_len=64,
    seed=7,
    max_logprobs=5,
    enable_prefix_caching=False,
    speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
)
# the same as launch flags
FLAGS = [
    "--model=tiny",
    "--load_format=dummy",
    "--dtype=float32",
    "--num_slots=3",
    "--page_size=16",
    "--max_model_len=64",
    "--seed=7",
    "--max_logprobs=5",
    "--noenable_prefix_caching",
    '--speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
]


def test_every_front_door_builds_the_same_engine(parsed):
    """LLM(...) and AsyncLLM(...) both call build_engine with what the user passed; the launchers
    (generate, bench, serve) pass their flags to LLM. The same settings in either spelling give
    the same filled config, and so do none (the defaults). The launchers' own defaults: serve
    warms up (--nowarmup skips it), bench takes its workload's slot count (--num_slots wins)."""
    from jaxserve.entrypoints.async_llm import AsyncLLM
    from jaxserve.llm import LLM

    llm = LLM("tiny", **SETTINGS)
    allm = AsyncLLM("tiny", **SETTINGS)
    try:
        assert allm.engine_config == llm.engine_config
    finally:
        allm.shutdown()
    from_flags = build_engine(**engine_flags.llm_kwargs(parsed(*FLAGS)))
    assert from_flags.engine_config == llm.engine_config
    c = llm.engine_config
    assert (c.num_slots, c.page_size, c.dtype, c.num_speculative_tokens) == (3, 16, "float32", 2)
    assert c.is_filled and c.prefill_chunk_size == 64 and c.max_logprobs == 5

    defaults = build_engine("tiny", load_format="dummy").engine_config
    assert defaults == EngineConfig(model="tiny", load_format="dummy").for_model(
        ModelConfig.preset("tiny")
    )
    assert build_engine(**engine_flags.llm_kwargs(parsed("--model=tiny", "--load_format=dummy")))
    fv = parsed("--model=tiny", "--load_format=dummy")
    assert serve.engine_kwargs(fv) == {"model": "tiny", "load_format": "dummy", "warmup": True}
    assert serve.engine_kwargs(parsed("--nowarmup"))["warmup"] is False
    assert bench.engine_kwargs(fv, "longtail-small")["num_slots"] == 32
    assert bench.engine_kwargs(parsed("--num_slots=5"), "longtail-small")["num_slots"] == 5


def test_the_runner_and_engine_take_only_finished_objects():
    from jaxserve.core.engine import LLMEngine
    from jaxserve.loading.dummy import dummy_params
    from jaxserve.parallel.mesh import make_mesh
    from jaxserve.runner.blueprint import blueprint
    from jaxserve.testing.fake_runner import FakeRunner

    mc = ModelConfig.preset("tiny")
    params = dummy_params(mc, "float32")
    unfilled = EngineConfig(num_slots=2, max_model_len=64, page_size=16, dtype="float32")
    with pytest.raises(ValueError, match=r"filled for the model: engine_config.for_model"):
        blueprint(params, mc, unfilled, 8)
    with pytest.raises(ValueError, match=r"filled for the model: config.for_model"):
        LLMEngine(FakeRunner(2, 8, 16, 1), mc, unfilled, 8)
    tp2 = dataclasses.replace(unfilled, tensor_parallel_size=2).for_model(mc)
    with pytest.raises(ValueError, match="needs a mesh of 2 devices"):
        blueprint(params, mc, tp2, 8)
    with pytest.raises(ValueError, match=r"mesh's \(data, model\) sizes \(1, 1\)"):
        blueprint(params, mc, tp2, 8, mesh=make_mesh(1, 1))


def test_every_setting_reaches_every_front_door_with_one_default(parsed):
    """Walks EngineConfig's fields: each is a launch flag, unset unless given (the engine's
    default applies); LLM and AsyncLLM take every field by name, each at its default giving the
    engine of no settings at all; with no flag set generate passes nothing, and serve and bench
    only their one named default each (see test_every_front_door_builds_the_same_engine)."""
    from jaxserve.bench.workloads import SPECS
    from jaxserve.entrypoints.async_llm import AsyncLLM

    fields = dataclasses.fields(EngineConfig)
    for f in fields:
        assert f.name in engine_flags.FLAG_NAMES and engine_flags.FLAGS[f.name].default is None
    nothing = parsed()
    assert engine_flags.llm_kwargs(nothing) == {}  # generate's LLM(**llm_kwargs())
    assert serve.engine_kwargs(nothing) == {"warmup": True}
    for workload, spec in SPECS.items():
        assert bench.engine_kwargs(nothing, workload) == {"num_slots": spec.num_slots}
    every = {f.name: f.default for f in fields} | {"model": "tiny", "load_format": "dummy"}
    want = build_engine("tiny", load_format="dummy").engine_config
    assert build_engine(**every).engine_config == want
    allm = AsyncLLM(**every)
    try:
        assert allm.engine_config == want
    finally:
        allm.shutdown()
