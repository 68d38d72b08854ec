"""`xla_text`: XLA's printed HLO instructions parse (tuple shapes, the /*index=N*/ comments XLA
puts before every fifth operand), and shapes give their bytes."""

from test_gpu_report import HLO

from jaxserve.bench import xla_text


def test_instructions_parse_with_tuple_shapes_and_index_comments():
    ins = xla_text.parse_instruction(
        "  %x2 = f32[2,8]{1,0} fusion(%red, /*index=5*/%x), kind=kLoop, calls=%fused_slice"
    )
    assert (ins.name, ins.opcode, ins.operands) == ("x2", "fusion", ["red", "x"])
    line = next(x for x in HLO.splitlines() if "= ((bf16" in x)
    start = xla_text.parse_instruction(line)
    assert start.opcode == "fusion-start" and start.shape.startswith("((bf16[4,8,16]")
    assert xla_text.shape_bytes("(bf16[1,8,16]{2,1,0}, s32[])") == 8 * 16 * 2 + 4
