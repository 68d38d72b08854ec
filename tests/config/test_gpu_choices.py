"""`jaxserve.config.gpu_choices`: the GPU kernel table (config/gpu_kernel_choices.toml) that
`resolve` reads its GPU choices from: the shipped file is today's choices exactly, and every file
the engine could not run is refused with the file and the line of the row at fault."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.config import gpu_choices as gc
from jaxserve.resolve import resolve

TINY = ModelConfig.preset("tiny")
KINDS = {  # device kinds as jax reports them -> the table's chip
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100",
    "NVIDIA H200": "h200",
    "NVIDIA GH200 480GB": "default",
    "NVIDIA A100-SXM4-80GB": "default",
    "cpu": "default",
    None: "default",
}


def table(chip="default", **changes) -> list[gc.Choice]:
    """A valid table of one chip (today's choices), rows replaced by index: {i: {field: value}}."""
    rows = [
        gc.Choice(chip, "decode_attention", "pallas", False, "s"),
        gc.Choice(chip, "prefill_attention", "pallas", False, "s"),
        gc.Choice(chip, "int4_matmul", "pallas", False, "s", 1, 16),
        gc.Choice(chip, "int4_matmul", "xla", False, "s", 17, 64),
        gc.Choice(chip, "int4_matmul", "xla", False, "s", 65),
        gc.Choice(chip, "w8_matmul", "pallas", False, "s", 1, 16),
        gc.Choice(chip, "w8_matmul", "pallas", False, "s", 17, 64),
        gc.Choice(chip, "w8_matmul", "xla", False, "s", 65),
    ]
    for key, fields in changes.items():
        i = int(key.removeprefix("r"))
        rows[i] = dataclasses.replace(rows[i], **fields)
    return rows


def row_line(text: str, i: int) -> int:
    """The line of the i-th [[choice]] header."""
    return [n + 1 for n, s in enumerate(text.splitlines()) if s == "[[choice]]"][i]


def test_the_shipped_table_is_todays_choices():
    """Every chip: the Triton kernels for attention, the Triton INT4 kernel up to 16 rows and the
    W8A16 kernel up to 64 (the weights' defaults, what an explicit impl runs), none measured yet,
    each naming its source; the file is what `to_toml` writes of it."""
    from jaxserve.quant import int4, int8

    choices = gc.load()
    rows = (("int4_matmul", int4.PALLAS_MAX_ROWS), ("w8_matmul", int8.PALLAS_MAX_ROWS))
    assert rows == (("int4_matmul", 16), ("w8_matmul", 64))
    for chip in ("h200", "h100", "default"):
        assert gc.for_chip(chip, choices) == gc.ChipChoices(chip, "pallas", "pallas", rows)
    assert {c.chip for c in choices} == {"h200", "h100", "default"}
    assert not any(c.measured for c in choices)
    assert all("JOURNAL.md" in c.source for c in choices)
    assert gc.to_toml(choices) == gc.SHIPPED.read_text()


@pytest.mark.parametrize("kind", list(KINDS))
def test_chips_by_device_kind(kind):
    assert gc.chip_of(kind, gc.load()) == KINDS[kind]


@pytest.mark.parametrize("kind", list(KINDS))
def test_resolve_picks_todays_choices_on_every_gpu(kind):
    r = resolve(EngineConfig().for_model(TINY), TINY, "gpu", device_kind=kind)
    assert (r.model.attention, r.quant_matmul) == ("pallas", "pallas")
    assert r.quant_kernel_rows == (("int4_matmul", 16), ("w8_matmul", 64))


def test_resolve_reads_its_chip_and_explicit_settings_win(monkeypatch):
    """A table that moves the H200 to the Mosaic kernels: an H200 engine takes them, with its row
    limits; an H100 keeps its rows; an explicit setting wins (its kernel on the weights' default
    rows); the CPU never reads the table."""
    h200 = table(
        "h200",
        r0={"candidate": "mgpu"},
        r1={"candidate": "mgpu"},
        r2={"candidate": "mgpu", "max_rows": 64},
        r3={"min_rows": 65, "max_rows": None, "candidate": "xla"},
        r5={"candidate": "mgpu"},
        r6={"candidate": "xla"},
    )
    del h200[4]
    choices = gc.parse(gc.to_toml((*h200, *table("h100"), *table())))
    monkeypatch.setattr(gc, "_shipped", lambda: choices)

    def resolved(backend="gpu", kind="NVIDIA H200", **settings):
        config = EngineConfig(**settings).for_model(TINY)
        return resolve(config, TINY, backend, device_kind=kind)

    r = resolved()
    assert (r.model.attention, r.quant_matmul) == ("mgpu", "mgpu")
    assert r.quant_kernel_rows == (("int4_matmul", 64), ("w8_matmul", 16))
    r = resolved(kind="NVIDIA H100 80GB HBM3")
    assert (r.model.attention, r.quant_matmul) == ("pallas", "pallas")
    r = resolved(attention_impl="reference", quant_matmul_impl="pallas")
    assert (r.model.attention, r.quant_matmul, r.quant_kernel_rows) == ("reference", "pallas", ())
    r = resolved("cpu", kind=None)
    assert (r.model.attention, r.quant_matmul, r.quant_kernel_rows) == ("ragged", "xla", ())


def test_a_table_of_xla_only_matmuls():
    """'xla' on every bucket of both ops: no kernel (impl 'xla'), row limits 0."""
    rows = table(r2={"candidate": "xla"}, r5={"candidate": "xla"}, r6={"candidate": "xla"})
    got = gc.for_chip("default", gc.parse(gc.to_toml(rows)))
    assert got.quant_matmul == "xla"
    assert got.kernel_rows == (("int4_matmul", 0), ("w8_matmul", 0))


BAD_ROWS = [  # ({row index: changes}, what the error says, the row it names (None: the chip))
    ({0: {"candidate": "triton"}}, "unknown candidate 'triton' for decode_attention", 0),
    ({2: {"candidate": "reference"}}, "unknown candidate 'reference' for int4_matmul", 2),
    ({0: {"op": "attention"}}, "unknown op 'attention'", 0),
    ({0: {"source": ""}}, "source must be a non-empty string", 0),
    ({1: {"candidate": "mgpu"}}, "the engine runs one attention implementation", 1),
    ({0: {"min_rows": 1}}, "decode_attention takes no rows bucket", 0),
    ({2: {"min_rows": None}}, "int4_matmul needs min_rows >= 1", 2),
    ({3: {"max_rows": 8}}, "int4_matmul needs min_rows >= 1 and max_rows >= min_rows", 3),
    ({3: {"min_rows": 10}}, "rows from 10 overlap the row at line", 3),
    ({3: {"min_rows": 20}}, "no row covers 17 to 19 rows", 3),
    ({4: {"max_rows": 128}}, "no row past 128", 4),
    ({7: {"candidate": "pallas"}}, "the open-ended bucket must be 'xla'", 7),
    ({3: {"candidate": "mgpu"}}, "'mgpu' after 'pallas'", 3),
    ({5: {"candidate": "xla"}}, "'pallas' after 'xla'", 6),
    (
        {5: {"candidate": "mgpu"}, 6: {"candidate": "mgpu"}},
        "int4_matmul runs 'pallas' and w8",
        None,
    ),
]


@pytest.mark.parametrize("changes,error,at", BAD_ROWS)
def test_a_row_the_engine_cannot_run_is_named(changes, error, at):
    text = gc.to_toml(table(**{f"r{i}": c for i, c in changes.items()}))
    with pytest.raises(ValueError, match="t.toml") as e:
        gc.parse(text, "t.toml")
    assert error in str(e.value), str(e.value)
    if at is not None:
        assert str(e.value).startswith(f"t.toml:{row_line(text, at)}: "), e.value


def test_a_longer_kernel_bucket_is_a_higher_row_limit():
    rows = table(r3={"candidate": "pallas"})
    got = gc.for_chip("default", gc.parse(gc.to_toml(rows)))
    assert got.kernel_rows == (("int4_matmul", 64), ("w8_matmul", 64))


@pytest.mark.parametrize(
    "edit,error",
    [
        (lambda t: t.replace('candidate = "pallas"', 'candiate = "pallas"', 1), "unknown field"),
        (lambda t: t.replace('source = "s"\n', "", 1), "missing field(s) ['source']"),
        (lambda t: t.replace("measured = false", 'measured = "no"', 1), "measured must be true"),
        (lambda t: t.replace("max_rows = 16", "max_rows = 16.0", 1), "needs min_rows >= 1"),
        (lambda t: t + "[other]\nx = 1\n", "expected [[choice]] rows only"),
        (lambda t: t + "[[choice\n", "not TOML"),
        (lambda t: t.replace('"default"', '"h100"'), "no rows for chip 'default'"),
        (lambda t: t + gc.to_toml(table("h100")[1:]).replace(gc.HEADER, ""), "needs one"),
        (lambda t: t + gc.to_toml(table()[:1]).replace(gc.HEADER, ""), "has 2"),
    ],
)
def test_a_malformed_file_is_named(tmp_path, edit, error):
    path = tmp_path / "choices.toml"
    path.write_text(edit(gc.to_toml(table())))
    with pytest.raises(ValueError, match=re.escape(str(path))) as e:
        gc.load(path)
    assert error in str(e.value), str(e.value)
