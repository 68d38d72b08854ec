"""`gpu_report` on hand-written XLA texts, each count computable by hand: the optimized HLO (weights
copied out of a stack in a loop, read in place by a GEMM, computed from constants) and the thunk
sequence (command buffers, a while loop, conditionals in and out of graphs)."""

from jaxserve.bench import gpu_report
from jaxserve.bench.deviceless import GpuProgram

# A layer loop of 4 trips: w (a [4, 8, 16] bf16 stack, 1 KiB a layer) is copied out of its stack
# (an async fusion of a dynamic slice), then a GEMM fusion reads the copy beside the
# activations; v is read in place by a custom call; c is an iota (a constant) sliced by the loop.
HLO = """HloModule jit_step, is_scheduled=true

%fused_slice (p0: bf16[4,8,16], p1: s32[]) -> bf16[1,8,16] {
  %p0 = bf16[4,8,16]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %ds = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %p1, %p1), dynamic_slice_sizes={1,8,16}
}

%fused_ar (q0: f32[2,16]) -> f32[2,16] {
  %q0 = f32[2,16]{1,0} parameter(0)
  ROOT %ar = f32[2,16]{1,0} all-reduce(%q0), to_apply=%add
}

%body (arg: (s32[], f32[2,8], bf16[4,8,16], bf16[4,8,16], s32[4])) -> (s32[], f32[2,8], bf16[4,8,16], bf16[4,8,16], s32[4]) {
  %arg = (s32[], f32[2,8]{1,0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}, s32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%arg), index=0
  %x = f32[2,8]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[4,8,16]{2,1,0} get-tuple-element(%arg), index=2
  %v = bf16[4,8,16]{2,1,0} get-tuple-element(%arg), index=3
  %c = s32[4]{0} get-tuple-element(%arg), index=4
  %fusion-start = ((bf16[4,8,16]{2,1,0}, s32[]), bf16[1,8,16]{2,1,0}, u32[]) fusion-start(%w, %i), kind=kLoop, calls=%fused_slice
  %fusion-done = bf16[1,8,16]{2,1,0} fusion-done(%fusion-start)
  %idx = s32[1]{0} fusion(%c, %i), kind=kLoop, calls=%fused_slice
  %gemm = f32[2,16]{1,0} fusion(%x, %fusion-done), kind=kCustom, calls=%fused_slice
  %cc = (f32[2,16]{1,0}, s8[64]{0}) custom-call(%x, %v, %idx), custom_call_target="__cublas$lt$matmul"
  %red = f32[2,16]{1,0} fusion(%gemm), kind=kCustom, calls=%fused_ar
  %x2 = f32[2,8]{1,0} fusion(%red, /*index=5*/%x), kind=kLoop, calls=%fused_slice
  ROOT %t = (s32[], f32[2,8]{1,0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}, s32[4]{0}) tuple(%i, %x2, %w, %v, %c)
}

%cond (carg: (s32[], f32[2,8], bf16[4,8,16], bf16[4,8,16], s32[4])) -> pred[] {
  %carg = (s32[], f32[2,8]{1,0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}, s32[4]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (params__w__.1: bf16[4,8,16], param.7: bf16[4,8,16], state_x.1: f32[2,8]) -> f32[2,8] {
  %params__w__.1 = bf16[4,8,16]{2,1,0} parameter(0)
  %param.7 = bf16[4,8,16]{2,1,0} parameter(1), metadata={op_name="params['v']"}
  %state_x.1 = f32[2,8]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %iota = s32[4]{0} iota(), iota_dimension=0
  %init = (s32[], f32[2,8]{1,0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}, s32[4]{0}) tuple(%zero, %state_x.1, %params__w__.1, %param.7, %iota)
  %loop = (s32[], f32[2,8]{1,0}, bf16[4,8,16]{2,1,0}, bf16[4,8,16]{2,1,0}, s32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %w_copy = bf16[4,8,16]{2,1,0} copy(%params__w__.1)
  ROOT %out = f32[2,8]{1,0} get-tuple-element(%loop), index=1
}
"""

# The runtime's view of it: a command buffer of 2 kernels; the loop (outside any graph) whose body
# has a graph of 2 launches and 2 launches outside; a conditional outside a graph whose branches
# hold 1 kernel each (one empty, printed on the label's line as XLA does); a last kernel.
THUNKS = """000: kCommandBuffer [source | next=003 (1)]
    001: kCustomKernel [source | sink] loop_add_fusion grid: [1, 1, 1] threads: [32, 1, 1]
    002: kCopy         [source | sink] kCopy
003: kWhile        [prev=000 (1) | next=010 (1)]
condition:
    004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source | next=007 (1)]
        005: kCustomKernel [source | sink] gemm_fusion_dot_1 grid: [8, 1, 1]
        006: kCustomKernel [source | sink] loop_add_fusion_2 grid: [8, 1, 1]
    007: kDynamicSliceFusion [prev=000 (1) | sink] params=2, results=2
        008: kCublasLtMatmul [source | sink] kCublasLtMatmul
    009: kCustomKernel [source | sink] loop_multiply_fusion grid: [8, 1, 1]
010: kConditional  [prev=003 (1) | next=013 (1)]
  false_branch:
    No thunks.  true_branch:
    011: kCustomKernel [source | sink] loop_select_fusion grid: [1, 1, 1]
013: kCustomKernel [prev=010 (1) | sink] wrapped_convert grid: [4, 1, 1]
"""


def program():
    names = {3: "loop", 10: "cond.1"}
    return GpuProgram("step", HLO, THUNKS, names, compile_s=1.5, compiler_options={})


def test_weight_copies_in_the_loop_count_once_per_trip():
    r = gpu_report.report(program(), layer_trip_count=4)
    # per trip the slice of w (8 x 16 bf16); once the whole w copied at the entry. Not: the GEMM
    # reading the copy, the custom call reading v (metadata names it a param), the slice of the
    # iota (a constant), the activations.
    assert r.materialized == {"fusion-start": 4 * 256, "w_copy": 4 * 8 * 16 * 2}
    assert r.weight_bytes_materialized == 4 * 256 + 1024
    assert r.loops == [("loop", 4)]
    assert r.collectives == {"all-reduce": 4}  # fused into a kernel, once a trip


def test_launches_graphs_and_host_round_trips():
    r = gpu_report.report(program(), layer_trip_count=4)
    # device work: 2 + 4 x (2 + 1 + 1) + 1 (the conditional's branch) + 1; the known trip count
    # skips the loop's condition
    assert r.kernels == 2 + 4 * 4 + 1 + 1
    assert r.per_layer == 4
    # host: the first graph, per trip the body's graph and its 2 launches outside, the branch, the
    # last kernel
    assert r.host_launches == 1 + 4 * 3 + 1 + 1
    assert r.outside_command_buffers == {
        "kCublasLtMatmul": 4,
        "loop_multiply_fusion": 4,
        "loop_select_fusion": 1,
        "wrapped_convert": 1,
    }
    assert r.host_round_trips == {"conditional cond.1": 1}
    assert r.row()["host round trips"] == 1


def test_a_loop_without_a_known_trip_count_waits_on_the_host_every_trip():
    hlo = HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', "")
    p = GpuProgram("step", hlo, THUNKS, {3: "loop", 10: "cond.1"}, 1.0, {})
    r = gpu_report.report(p)
    assert r.host_round_trips["while loop"] == 1 and r.per_layer is None
