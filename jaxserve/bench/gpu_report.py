"""What a compiled GPU program does per step, read from XLA's own output (`deviceless.GpuProgram`).

    report(program, weights, layer_trip_count) -> ProgramReport

Two texts, both XLA's:
- the optimized HLO module: every computation, the while loops with their known trip counts, the
  fusions, copies, GEMMs, custom calls (Pallas kernels, cuBLAS) and collectives;
- the thunk sequence: what the runtime launches, in order, nested in command buffers (one CUDA
  graph launch each), while loops (`WhileThunk`) and conditionals (`ConditionalThunk`).

What is counted, per step (a while body counts trip-count times):
- kernels: device work items (a kernel, a cuBLAS call, a copy, a memset, a collective), in or out
  of command buffers; `per_layer`: those in one iteration of the layer loop (the while whose trip
  count is the model's layer count);
- host_launches: what the host issues: one per command buffer, one per thunk outside any;
- outside_command_buffers: the launches not captured in a command buffer (their names);
- host_round_trips: where the host waits for the device inside a step: a `ConditionalThunk`
  outside a command buffer copies its predicate to the host and blocks; so does a while loop
  without a known trip count, every iteration (XLA's `WhileThunk` runs a known trip count without
  reading the condition); inside a command buffer both are CUDA graph conditional nodes, decided
  on the device;
- weight_bytes_materialized: bytes written by instructions whose every array operand is a weight
  (or a copy of one): a layer sliced out of its stack into a new buffer (`fused_dynamic_slice`),
  weights concatenated for a merged GEMM, an INT8/FP8 weight converted to bf16 before a cuBLAS
  GEMM. A GEMM, kernel or fusion reading a weight beside activations reads it in place and adds
  nothing. Weights are the parameters under the program's `params` argument;
- collectives: all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from jaxserve.bench.deviceless import GpuProgram
from jaxserve.bench.xla_text import (
    Instruction,
    Thunk,
    array_shapes,
    attr,
    parse_module,
    parse_thunks,
    shape_bytes,
    split_top,
    trip_count,
)

# Thunks that issue work on the device (everything else nests or orders them).
_CONTAINERS = {
    "kCommandBuffer", "kWhile", "kConditional", "kSequential", "kAsyncStart", "kAsyncDone",
    "kDynamicSliceFusion", "kWaitForStreams", "kHostExecuteStart", "kHostExecuteDone",
}  # fmt: skip
_COLLECTIVES = (
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "ragged-all-to-all", "collective-broadcast",
)  # fmt: skip
CONSTANT = "constant"  # the flag of a value computed from constants alone
# Ops that only rename or regroup buffers (no bytes written).
_VIEWS = {"bitcast", "get-tuple-element", "tuple", "parameter", "while", "conditional", "call"}


def _consumes_in_place(ins: Instruction) -> bool:
    """A GEMM, kernel or library call: reads its operands where they are."""
    if ins.opcode == "custom-call":
        return True
    if ins.opcode in ("fusion", "fusion-start"):
        kind = attr(ins.attrs, "kind")
        return kind == "kCustom"  # Triton GEMMs, dynamic-slice fusions around cuBLAS, ...
    return ins.opcode in ("dot", "convolution")


@dataclasses.dataclass
class _Walk:
    comps: dict[str, list[Instruction]]
    weight_arg: str  # the jitted function's argument holding the weights
    materialized: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    loops: list[tuple[str, int | None, int]] = dataclasses.field(default_factory=list)

    def run(self, comp: str, param_flags: list, times: int) -> list:
        """Walks `comp` executed `times` per step; param_flags: the weight flag of each of its
        parameters (a bool, or a list for a tuple parameter). Returns the root's flag."""
        flags: dict[str, object] = {}
        root = None
        for ins in self.comps.get(comp, []):
            f = self._flag(ins, flags, param_flags, times)
            flags[ins.name] = f
            root = f
        return root

    def _flag(self, ins: Instruction, flags: dict, param_flags: list, times: int):
        op = ins.opcode
        ops = [flags.get(o, False) for o in ins.operands]
        if op == "parameter":
            i = int(ins.args)
            if param_flags is None:  # the entry: jax names each parameter by its argument path
                # (kept in the metadata when the SPMD partitioner renames it)
                arg = self.weight_arg
                return ins.name.startswith(f"{arg}_") or f'op_name="{arg}[' in ins.attrs
            return param_flags[i] if i < len(param_flags) else False
        if op == "get-tuple-element":
            src = ops[0] if ops else False
            idx = int(attr(ins.attrs, "index") or 0)
            if isinstance(src, list):
                return src[idx] if idx < len(src) else False
            return src
        if op == "tuple":
            return [o if isinstance(o, list) or o in (True, CONSTANT) else False for o in ops]
        if op == "while":
            body, cond = attr(ins.attrs, "body"), attr(ins.attrs, "condition")
            n = trip_count(ins)
            self.loops.append((ins.name, n, times))
            init = ops[0] if ops and isinstance(ops[0], list) else [False]
            self.run(cond, [init], times * (n or 1))
            self.run(body, [init], times * (n or 1))
            return init  # loop-invariant weights pass through
        if op == "conditional":
            branches = re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1])
            if "true_computation" in ins.attrs:
                branches = [
                    attr(ins.attrs, "true_computation"),
                    attr(ins.attrs, "false_computation"),
                ]
            for b, arg in zip(branches, ops[1:]):
                if b in self.comps:
                    self.run(b, [arg], times)
            return False
        if (
            op == "call"
            or op.endswith("-start")
            and attr(ins.attrs, "calls")
            and op != "fusion-start"
        ):
            called = attr(ins.attrs, "to_apply") or attr(ins.attrs, "calls")
            if called in self.comps:
                self.run(called, list(ops), times)
            return False
        base = op.removesuffix("-start").removesuffix("-done")
        if base in _COLLECTIVES and not op.endswith("-done"):
            self.collectives[base] += times
        if op in ("fusion", "fusion-start"):  # a collective fused into a kernel (one-shot)
            for kind in self._fused_collectives(attr(ins.attrs, "calls")):
                self.collectives[kind] += times
        if op.endswith("-done"):
            return ops[0] if ops and ops[0] in (True, CONSTANT) else False
        # The operands that decide are arrays (a scalar is a loop index or an offset): all of them
        # weights or constants (an iota, a table of layer indices), at least one a weight.
        arrays = [flags.get(o, False) for o in ins.operands if self._rank(o) > 0]
        if any(f is False or isinstance(f, list) for f in arrays):
            return False
        if not any(f is True for f in arrays):
            return CONSTANT  # computed from constants alone (or from nothing: an iota)
        if op in _VIEWS or _consumes_in_place(ins):
            return op in _VIEWS
        out = ins.shape
        if op in ("fusion-start", "copy-start"):  # ((operands), result, context) / (dst, src, ctx)
            parts = split_top(ins.shape[1:-1])
            out = parts[1] if op == "fusion-start" else parts[0]
        self.materialized[ins.name] += shape_bytes(out) * times
        return True

    def _fused_collectives(self, comp: str | None) -> list[str]:
        return [
            i.opcode.removesuffix("-start")
            for i in self.comps.get(comp, [])
            if i.opcode.removesuffix("-start") in _COLLECTIVES
        ]

    def _rank(self, name: str) -> int:
        """The largest rank among the arrays of an instruction's result (0 for a scalar)."""
        if not hasattr(self, "_shape_cache"):
            self._shape_cache = {i.name: i.shape for c in self.comps.values() for i in c}
        return max((len(d) for _, d in array_shapes(self._shape_cache.get(name, ""))), default=0)


@dataclasses.dataclass
class ProgramReport:
    """One program's per-step counts (see the module docstring)."""

    name: str
    compile_s: float
    kernels: int  # device work items per step
    per_layer: int | None  # in one iteration of the layer loop (None: no layer loop found)
    host_launches: int
    outside_command_buffers: dict[str, int]  # launch name -> per step
    host_round_trips: dict[str, int]  # 'conditional <hlo name>' / 'while <hlo name>' -> per step
    weight_bytes_materialized: int
    materialized: dict[str, int]  # HLO instruction -> bytes per step
    collectives: dict[str, int]  # kind -> per step
    loops: list[tuple[str, int | None]]  # (HLO while, trip count)
    kernel_names: dict[str, int]  # per step, by kind of launch (a kernel's name, kCublasLtMatmul)

    def row(self) -> dict:
        """The report as one flat dict (the inspector's table and JSON lines)."""
        return {
            "program": self.name,
            "compile_s": round(self.compile_s, 2),
            "kernels/step": self.kernels,
            "kernels/layer": self.per_layer,
            "host launches": self.host_launches,
            "outside graphs": sum(self.outside_command_buffers.values()),
            "host round trips": sum(self.host_round_trips.values()),
            "weight MB copied": round(self.weight_bytes_materialized / 2**20, 1),
            "collectives": sum(self.collectives.values()),
        }


def _launch_name(t: Thunk) -> str:
    if t.kind in ("kCustomKernel", "kKernel"):
        return re.sub(r"(_\d+)+$|\.\d+$", "", t.text.split()[0]) if t.text else t.kind
    return t.kind


def report(
    program: GpuProgram, layer_trip_count: int | None = None, weight_arg: str = "params"
) -> ProgramReport:
    """layer_trip_count: the model's number of layers (the while loop with that trip count is the
    layer loop); weight_arg: the name of the program's argument holding the weights (jax names
    the entry parameters by argument path: `params__layers____wq__`)."""
    comps, entry = parse_module(program.hlo)
    walk = _Walk(comps, weight_arg)
    walk.run(entry, None, 1)
    by_name = {i.name: i for c in comps.values() for i in c}

    kernels = collections.Counter()
    outside = collections.Counter()
    trips = collections.Counter()
    counts = {"kernels": 0, "host": 0, "layer": None}

    def visit(thunks: list[Thunk], times: int, in_graph: bool, in_layer: bool) -> int:
        """Counts device work under `thunks` (executed `times` per step) -> work per execution."""
        work = 0
        for t in thunks:
            hlo_name = program.thunk_names.get(t.id, "")
            if t.kind == "kCommandBuffer":
                if not in_graph:
                    counts["host"] += times
                work += visit(t.children, times, True, in_layer)
            elif t.kind == "kWhile":
                n = trip_count(by_name[hlo_name]) if hlo_name in by_name else None
                if n is None and not in_graph:
                    trips[f"while {hlo_name}"] += times
                body = [c for c in t.children if c.role == "body"]
                cond = [c for c in t.children if c.role == "condition"]
                layer = layer_trip_count is not None and n == layer_trip_count
                if n is None:  # the condition runs every iteration, and once more
                    work += visit(cond, times, in_graph, in_layer)
                per_iter = visit(body, times * (n or 1), in_graph, in_layer or layer)
                if layer and counts["layer"] is None:
                    counts["layer"] = per_iter
                work += per_iter * (n or 1)
            elif t.kind == "kConditional":
                if not in_graph:
                    trips[f"conditional {hlo_name}"] += times
                # each branch counted as if taken (an upper bound of the launches)
                work += visit(t.children, times, in_graph, in_layer)
            elif t.kind in _CONTAINERS:
                work += visit(t.children, times, in_graph, in_layer)
            else:
                work += 1
                counts["kernels"] += times
                kernels[_launch_name(t)] += times
                if not in_graph:
                    counts["host"] += times
                    outside[_launch_name(t)] += times
        return work

    visit(parse_thunks(program.thunks), 1, False, False)
    return ProgramReport(
        name=program.name,
        compile_s=program.compile_s,
        kernels=counts["kernels"],
        per_layer=counts["layer"],
        host_launches=counts["host"],
        outside_command_buffers=dict(outside),
        host_round_trips=dict(trips),
        weight_bytes_materialized=sum(walk.materialized.values()),
        materialized=dict(walk.materialized),
        collectives=dict(walk.collectives),
        loops=[(n, c) for n, c, _ in walk.loops],
        kernel_names=dict(kernels),
    )
