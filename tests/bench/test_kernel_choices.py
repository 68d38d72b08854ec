"""`jaxserve.bench.kernel_choices`: the GPU run's JSON -> a proposed GPU kernel table, on
hand-made results whose answers are computed by hand (the smoke runs' own JSON goes through it in
tests/test_gpu_scripts.py)."""

from __future__ import annotations

import json

import pytest

from jaxserve.bench import kernel_choices as kc
from jaxserve.config import gpu_choices as gc

RUN = "NVIDIA H200 (h200) run of 2026-12-08 at abc1234"


def attention(decode: dict, prefill: dict, **over) -> dict:
    """gpu_kernels.json with two decode and one prefill shape, each candidate's us given."""

    def row(kind, us, **shape):
        r = dict(kernel=kind, batch=8, context=4096, page_size=16, kv="bf16", **shape)
        r |= {f"{f}_us": us[c] for c, f in kc.ATTENTION_FIELDS.items() if c in us}
        r |= dict(kernel_ok=True, mgpu_ok=True, kernel_gbs=1000.0)
        return r | over.get(kind, {})

    rows = [row("decode", decode), row("decode", decode)]
    return dict(
        device="NVIDIA H200",
        date="2026-12-08",
        smoke=False,
        copy_gbs=4000.0,
        decode=rows,
        prefill=[row("prefill", prefill, chunk=256)],
    )


def matmuls(times: dict, **ok) -> dict:
    """gpu_quant_matmul.json: times[kind][m] = (mosaic, triton, xla) us; ok: {(kind, m): {name: False}}."""
    rows = []
    for kind, by_m in times.items():
        for m, (mosaic, triton, xla) in by_m.items():
            r = dict(kind=kind, m=m, k=4096, n=4096, ok=True, weight_bytes=8e6, bf16_us=30.0)
            r |= dict(mosaic_us=mosaic, triton_us=triton, xla_us=xla, mosaic_gbs=8e6 / mosaic / 1e3)
            rows.append(r | ok.get(f"{kind}{m}", {}))
    return dict(device="NVIDIA H200", date="2026-12-08", smoke=False, rows=rows)


def propose(kernels=None, quant=None) -> dict:
    """The proposal for the H200 from the shipped table: {(op, min_rows): Choice}."""
    samples = kc.attention_samples(kernels or {}) + kc.matmul_samples(quant or {})
    out = kc.propose(gc.load(), samples, "h200", RUN, measured=True)
    gc.parse(gc.to_toml(out))  # the engine can run it
    assert [c for c in out if c.chip != "h200"] == [c for c in gc.load() if c.chip != "h200"]
    return {(c.op, c.min_rows): c for c in out if c.chip == "h200"}


def test_the_fastest_correct_attention():
    got = propose(attention({"pallas": 10, "mgpu": 8, "reference": 30}, {"pallas": 9, "mgpu": 6}))
    for op in gc.ATTENTION_OPS:
        assert got[op, None].candidate == "mgpu" and got[op, None].measured, got[op, None]
    assert got["decode_attention", None].source == (
        f"{RUN}: time over the fastest's on 2 shapes (geomean): mgpu 1.00, pallas 1.25, "
        "reference 3.75"
    )
    # cuDNN is timed beside them but is no engine implementation; the matmuls were not run
    got = propose(
        attention({"pallas": 10, "mgpu": 8, "reference": 30, "cudnn": 1}, {"pallas": 9, "mgpu": 6})
    )
    assert got["decode_attention", None].candidate == "mgpu"
    # a candidate not timed on a measured op is not chosen for it
    got = propose(attention({"pallas": 10, "mgpu": 8, "reference": 30}, {"pallas": 9}))
    assert got["prefill_attention", None].candidate == "pallas"
    assert got["int4_matmul", 1] == next(
        c for c in gc.load() if c.chip == "h200" and c.min_rows == 1
    )


def test_a_wrong_candidate_is_never_chosen():
    res = attention({"pallas": 10, "mgpu": 8, "reference": 30}, {"pallas": 9, "mgpu": 6})
    res["decode"][1]["mgpu_ok"] = False
    got = propose(res)
    assert got["decode_attention", None].candidate == "pallas"
    assert "mgpu 1.00 (wrong output)" in got["decode_attention", None].source


def test_decode_and_prefill_share_one_attention():
    """mgpu wins decode by 1.25x, pallas prefill by 3x: one implementation serves both, the one of
    least summed ratio (pallas: 1.25 + 1 against 1 + 3), and the decode row says why."""
    got = propose(attention({"pallas": 10, "mgpu": 8, "reference": 30}, {"pallas": 9, "mgpu": 27}))
    assert {got[op, None].candidate for op in gc.ATTENTION_OPS} == {"pallas"}
    assert got["decode_attention", None].source.endswith(
        "; mgpu is fastest here, but the engine runs pallas with the rest"
    )


def test_the_matmuls_runnable_plan_of_least_time():
    """INT4: Mosaic fastest at 1-16 rows, XLA at 64; W8: Triton fastest at 1-16 and 64, Mosaic
    1.2x and 1.11x. One kernel for both ops: Mosaic costs 1 + 1 + 1.2 + 1.11, Triton 2 + 1 + 1 + 1,
    so W8 runs Mosaic too, saying so; the 65+ rows (not timed) stay as they were."""
    times = {
        "int4": {1: (5, 10, 20), 8: (5, 10, 20), 16: (5, 10, 20), 64: (30, 60, 25)},
        "int8": {1: (6, 5, 12), 16: (6, 5, 12), 64: (10, 9, 15)},
    }
    got = propose(quant=matmuls(times))
    picks = {key: c.candidate for key, c in got.items() if key[0] in gc.MATMUL_OPS}
    assert picks == {
        ("int4_matmul", 1): "mgpu",
        ("int4_matmul", 17): "xla",  # not timed at 17-32 rows: the base table's row
        ("int4_matmul", 33): "xla",
        ("int4_matmul", 65): "xla",
        ("w8_matmul", 1): "mgpu",
        ("w8_matmul", 17): "mgpu",
        ("w8_matmul", 65): "xla",
    }
    assert got["int4_matmul", 1].source.startswith(f"{RUN}: time over the fastest's on 3 shapes")
    assert "pallas is fastest here, but the engine runs mgpu" in got["w8_matmul", 1].source
    assert not got["w8_matmul", 65].measured and got["w8_matmul", 65].source.startswith("not timed")
    h200 = gc.for_chip("h200", tuple(got.values()))
    assert (h200.quant_matmul, h200.kernel_rows) == (
        "mgpu",
        (("int4_matmul", 16), ("w8_matmul", 64)),
    )
    # Mosaic's INT4 output wrong at 8 rows: out of that bucket, so Triton everywhere (INT4 1-16:
    # 2.0 + 1; W8 1 + 1, against Mosaic's only way out, XLA at INT4 1-16: 4 + 1 + 1.2 + 1.11)
    got = propose(quant=matmuls(times, int48={"mosaic_ok": False}))
    assert got["int4_matmul", 1].candidate == got["w8_matmul", 17].candidate == "pallas"


def test_a_kernel_may_win_the_17_32_row_bucket_alone():
    """Triton fastest up to 32 rows and XLA's path at 64: the INT4 kernel runs up to 32 rows (its
    16-row blocks, `int4_plan.plan`), XLA's path above; W8 keeps its kernel to 64 rows."""
    times = {
        "int4": {1: (50, 10, 20), 16: (50, 10, 20), 32: (50, 15, 20), 64: (50, 40, 25)},
        "int8": {1: (60, 5, 12), 64: (60, 9, 15)},
    }
    got = propose(quant=matmuls(times))
    picks = {key: c.candidate for key, c in got.items() if key[0] == "int4_matmul"}
    assert picks == {
        ("int4_matmul", 1): "pallas",
        ("int4_matmul", 17): "pallas",
        ("int4_matmul", 33): "xla",
        ("int4_matmul", 65): "xla",
    }
    h200 = gc.for_chip("h200", tuple(got.values()))
    assert h200.kernel_rows == (("int4_matmul", 32), ("w8_matmul", 64))


def test_smoke_runs_are_not_measurements():
    res = attention({"pallas": 10, "mgpu": 8, "reference": 30}, {"pallas": 9, "mgpu": 6})
    samples = kc.attention_samples(res)
    out = kc.propose(gc.load(), samples, "default", "cpu run (smoke)", measured=False)
    assert not any(c.measured for c in out)
    assert {c.candidate for c in out if c.chip == "default" and c.op in gc.ATTENTION_OPS} == {
        "mgpu"
    }


def test_a_new_chip_starts_from_the_default_rows():
    samples = kc.attention_samples(attention({"pallas": 10, "mgpu": 8}, {"pallas": 9, "mgpu": 6}))
    out = kc.propose(gc.load(), samples, "b200", "NVIDIA B200 run", measured=True)
    b200 = [c for c in out if c.chip == "b200"]
    assert out[: len(out) - len(b200)] == gc.load() and len(b200) == 9
    assert gc.chip_of("NVIDIA B200", out) == "b200"
    assert b200[2].source.startswith("no b200 rows before NVIDIA B200 run: any other GPU")


def test_the_command(tmp_path, capsys):
    """OUT_DIR as gpu_checks.sh leaves it: the table on stdout, the RESULTS table to --table."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "w8").mkdir()
    res = attention({"pallas": 10, "mgpu": 8, "reference": 30, "cudnn": 7}, {"pallas": 9})
    (tmp_path / "kernels" / "gpu_kernels.json").write_text(json.dumps(res))
    quant = matmuls({"int4": {8: (5, 10, 20)}})
    (tmp_path / "w8" / "gpu_quant_matmul.json").write_text(json.dumps(quant))
    md = tmp_path / "table.md"
    assert kc.main([str(tmp_path), "--commit", "abc1234", "--table", str(md)]) == 0
    text = capsys.readouterr().out
    got = gc.parse(text)
    out = tmp_path / "choices.toml"  # --out: written after the base is read (it may be the base)
    kc.main([str(tmp_path), "--commit", "abc1234", "--out", str(out)])
    assert out.read_text() == text
    assert (
        kc.main([str(tmp_path), "--commit", "abc1234", "--base", str(out), "--out", str(out)]) == 0
    )
    assert gc.load(out) == got
    h200 = {(c.op, c.min_rows): c for c in got if c.chip == "h200"}
    assert h200["decode_attention", None].source.startswith(
        "NVIDIA H200 (h200) run of 2026-12-08 at abc1234: "
    )
    lines = md.read_text().splitlines()
    assert (
        "| decode_attention | B8 ctx4096 ps16 bf16 KV | cudnn | 7.0 | 1429 | 35.7 |  | 1.00 | yes |"
        in lines
    )
    assert "| int4_matmul | int4 M8 4096x4096 | mgpu | 5.0 | 1600 | 40.0 |  | 1.00 | yes |" in lines
    quant["device"] = "NVIDIA H100 80GB HBM3"
    (tmp_path / "w8" / "gpu_quant_matmul.json").write_text(json.dumps(quant))
    with pytest.raises(ValueError, match="different devices"):
        kc.main([str(tmp_path)])
    with pytest.raises(ValueError, match="no gpu_kernels.json or gpu_quant_matmul.json"):
        kc.main([str(tmp_path / "kernels" / "nothing")])
