"""`deviceless.target`: the chips the GPU program inspector compiles for, and the CUDA stack they
name. What XLA puts into CUDA graphs depends on that stack (a dynamic-slice fusion, cuBLAS reading
a layer of its stack in place, only from 12.9 on: JOURNAL.md 64a), so the shipped targets must
name the stack the engine runs on, not the 12.8 of XLA's spec files."""

import importlib.metadata

import pytest

from jaxserve.bench import deviceless


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


@pytest.mark.parametrize("name", sorted(deviceless.NAMED_TARGETS))
def test_a_shipped_target_names_the_cuda_stack_the_engine_installs(name):
    from jax_cuda12_plugin import _versions  # the gpu-compile extra (jax's CUDA 12 plugin)

    t = deviceless.target(name)
    built = _versions.cuda_runtime_build_version()  # e.g. 12090: the plugin's CUDA
    assert _version(t.cuda.toolkit)[:2] == (built // 1000, built % 1000 // 10), t.cuda
    installed = importlib.metadata.version("nvidia-cuda-runtime-cu12")  # what pip resolved
    assert _version(installed)[:2] >= _version(t.cuda.runtime)[:2], (installed, t.cuda)
    assert _version(t.cuda.driver) >= _version(t.cuda.runtime), t.cuda
    assert t.describe().startswith(t.device_kind) and "toolkit 12.9" in t.describe()


def test_a_target_file_without_a_version_is_refused(tmp_path):
    text = deviceless.target("h100").config_text
    bare = "\n".join(line for line in text.splitlines() if "runtime_version" not in line)
    path = tmp_path / "gpu.txtpb"
    path.write_text(bare)
    with pytest.raises(ValueError, match="runtime_version"):
        deviceless.target(str(path))
