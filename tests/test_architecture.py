"""The module import graph of jaxserve/, pallas_kernels/ and cpu_kernels/ has no cycles; kernels never
import jaxserve.

The graph is read from the source (ast), not by importing it, and counts every import statement,
at module top and inside functions alike (a lazy import hides a cycle, it does not remove one).
Only intra-repo imports are edges. How an import statement becomes edges:

    import a.b.c                 -> a.b.c (the longest prefix that is a module of ours)
    from a.b import c            -> a.b.c when c is a submodule, else a.b (a name in a/b/__init__)
    from . import c, from .x import y    resolved against the importing module's package

A package is its `__init__` module (`jaxserve.quant` is jaxserve/quant/__init__.py). The implicit
import of a submodule's parent packages is not an edge: every package whose `__init__` re-exports
its submodules would otherwise be a cycle, and what such an `__init__` may import is already
checked through its own edges.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "pallas_kernels", "cpu_kernels")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py under PACKAGES (a package is its __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _known(name: str, modules) -> str | None:
    """The longest prefix of dotted `name` that is one of `modules` (None if none is)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in modules:
            return prefix
    return None


def imports_of(module: str, path: Path, modules) -> list[tuple[str, int]]:
    """(imported module, line) for every intra-repo import in the file (see the module doc)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    out.append((target, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in modules else _known(base, modules)
                if target:
                    out.append((target, node.lineno))
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it} (self-imports dropped)."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        edges: dict[str, int] = {}
        for target, line in imports_of(module, path, files):
            if target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (each one a cycle)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def a_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One cycle through the component's first module: [m0, m1, ..., m0] (breadth-first)."""
    members, start = set(component), component[0]
    parent = {start: None}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v]):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if w in members and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{component} is not strongly connected")


def describe(graph, cycle: list[str]) -> str:
    files = module_files()
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        where = files[a].relative_to(ROOT)
        hops.append(f"  {a} -> {b}   ({where}:{graph[a][b]})")
    return "\n".join(hops)


def test_graph_sees_the_known_edges():
    """The parser resolves submodule, package and lazy imports (a guard against a vacuous pass)."""
    graph = import_graph()
    assert "jaxserve.quant.int4" in graph["jaxserve.quant"]  # from jaxserve.quant import int4
    assert "jaxserve.config" in graph["jaxserve.quant"]
    assert "pallas_kernels.int4_layout" in graph["pallas_kernels.int4_matmul"]
    assert "jaxserve.llm" in graph["jaxserve"]  # inside a function (the lazy `LLM`)
    assert "jaxserve.loading" in graph["jaxserve.launch.convert"]  # a package: its __init__
    assert "cpu_kernels.paged_decode_attention" in graph["jaxserve.layers.attention"]


def test_no_import_cycles():
    graph = import_graph()
    cycles = strongly_connected(graph)
    report = [
        f"modules {comp} import each other, e.g.\n{describe(graph, a_cycle(graph, comp))}"
        for comp in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_kernels_import_jax_only():
    """pallas_kernels/ and cpu_kernels/ never import jaxserve (the engine depends on the kernels,
    not back)."""
    bad = []
    for module, path in module_files().items():
        if not module.startswith(("pallas_kernels", "cpu_kernels")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] in ("jaxserve", "tests", "experiments"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


# The layers, bottom first: a module may import its own package's modules and those of the layers
# below its own, never above (`test_imports_run_down_the_layers`). A module belongs to the longest
# entry that prefixes its name; a new package must be placed here.
LAYERS = (
    # the kernels: jax only (`test_kernels_import_jax_only`). First the attention family's one
    # paged-KV argument and its references (no Pallas), which every form of it takes: the C++ CPU
    # kernels import those and nothing else of the Pallas kernels
    "pallas_kernels.attention.paged_kv",
    "pallas_kernels.attention.reference",
    "cpu_kernels",
    "pallas_kernels",
    # the settings, host only (jaxserve/config/, the package last: its re-exports): a model's
    # fields, config.json's, the presets, the model's config; a setting's checks, the settings,
    # vLLM's speculative_config, the settings in groups, the engine's config; then the choices
    # made from them
    "jaxserve.config.model_fields",
    "jaxserve.config.hf",
    "jaxserve.config.presets",
    "jaxserve.config.model",
    "jaxserve.config.checks",
    "jaxserve.config.settings",
    "jaxserve.config.speculative",
    "jaxserve.config.groups",
    "jaxserve.config.engine",
    "jaxserve.config",
    "jaxserve.resolve",
    # the host side of requests (no jax: tests/core/test_host_only.py)
    "jaxserve.lora",
    "jaxserve.inputs",
    "jaxserve.core",
    "jaxserve.testing",
    # the model on the device, its weights, and the steps that run it
    "jaxserve.layers",
    "jaxserve.models",
    "jaxserve.quant",
    "jaxserve.parallel",
    "jaxserve.loading",
    "jaxserve.eval",
    "jaxserve.runner",
    # the front doors, and what is built on them
    "jaxserve.engine_args",
    "jaxserve.llm",
    "jaxserve.entrypoints",
    "jaxserve.batch",
    "jaxserve.bench",
    "jaxserve.launch",
    "jaxserve",  # the package itself: its public names
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest entry prefixing `module`."""
    best = None
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(LAYERS[best]):
                best = i
    assert best is not None, f"{module} is in no layer: place its package in LAYERS"
    return best


def test_imports_run_down_the_layers():
    graph = import_graph()
    files = module_files()
    up = [
        f"{files[a].relative_to(ROOT)}:{line} {a} imports {b} ({LAYERS[layer_of(b)]} is above "
        f"{LAYERS[layer_of(a)]})"
        for a, edges in sorted(graph.items())
        for b, line in sorted(edges.items())
        if layer_of(b) > layer_of(a)
    ]
    assert not up, "imports running up the layers:\n" + "\n".join(up)


# No package file much over 400 lines: one past this is split along a seam, not trimmed.
MAX_LINES = 420


def test_no_package_file_is_over_max_lines():
    big = {
        str(p.relative_to(ROOT)): n
        for p in module_files().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not big, f"files over {MAX_LINES} lines (split them): {big}"


# The engine's parts read its config through the groups (`config.scheduler.num_slots`, a
# `SchedulerConfig` argument), never a flat field (`config.num_slots`): jaxserve/config/groups.py.
# the engine's parts, and the GPU program inspector that builds the runner's pieces abstractly
GROUPED_READERS = (
    "jaxserve/core",
    "jaxserve/runner",
    "jaxserve/layers",
    "jaxserve/resolve.py",
    "jaxserve/bench/gpu_programs.py",
)


def _flat_fields() -> dict[str, str]:
    """EngineConfig's flat fields -> their group."""
    from jaxserve.config import EngineConfig  # host only: no jax

    return {f.name: f.metadata["group"] for f in dataclasses.fields(EngineConfig)}


def _takes_engine_config(arg: ast.arg) -> bool:
    note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
    return "EngineConfig" in note or arg.arg == "engine_config"


def _pairs(target: ast.expr, value: ast.expr):
    """(target, value) of an assignment, element-wise for `a, b = x, y`."""
    if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
        if len(target.elts) == len(value.elts):
            return list(zip(target.elts, value.elts))
    return [(target, value)]


def _is_self_attr(node: ast.expr, attrs) -> bool:
    """Whether `node` is `self.A` for an A in `attrs`."""
    return isinstance(node, ast.Attribute) and _is_self(node.value) and node.attr in attrs


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _holds(value: ast.expr, names: set[str], attrs: set[str]) -> bool:
    """Whether `value` is a holder: one of `names`, or `self.A` for an A in `attrs`."""
    return (isinstance(value, ast.Name) and value.id in names) or _is_self_attr(value, attrs)


def _holder_names(func: ast.FunctionDef, self_attrs: set[str]) -> set[str]:
    """The names in `func` (nested functions included) that hold an EngineConfig: its parameters
    annotated EngineConfig (or named engine_config), and names assigned from one (`c = config`,
    `c, m = engine_config, model_config`, `e = self.config`)."""
    args = func.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    names = {a.arg for a in every if _takes_engine_config(a)}
    changed = True
    while changed:
        changed = False
        for t, v in _assigned_pairs(func):
            if isinstance(t, ast.Name) and _holds(v, names, self_attrs) and t.id not in names:
                names.add(t.id)
                changed = True
    return names


def _assigned_pairs(func: ast.FunctionDef):
    """(target, value) of every assignment in `func`, tuples unpacked (`_pairs`)."""
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                yield from _pairs(target, node.value)


def _functions(tree: ast.Module):
    """(function, its class or None) for each module-level function and method."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield item, node


def _holder_attrs(cls: ast.ClassDef) -> set[str]:
    """The attributes `self.A` that a class's methods set to an EngineConfig."""
    attrs: set[str] = set()
    changed = True
    while changed:
        changed = False
        for func in cls.body:
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            names = _holder_names(func, attrs)
            for t, v in _assigned_pairs(func):
                if (
                    isinstance(t, ast.Attribute)
                    and _is_self(t.value)
                    and t.attr not in attrs
                    and _holds(v, names, attrs)
                ):
                    attrs.add(t.attr)
                    changed = True
    return attrs


def flat_config_reads(sources: dict[str, str]) -> list[str]:
    """Every `<an EngineConfig>.<flat field>` read in `sources` (name -> Python source), as
    "name:line: expr (its group)". An EngineConfig is a parameter annotated so (or named
    engine_config), a name assigned from one, a `self.A` its class set to one, and `X.A` for
    any other X where some class sets `self.A` to one (`runner.config` in warmup.py)."""
    flat = _flat_fields()
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    class_attrs = {
        id(cls): _holder_attrs(cls)
        for tree in trees.values()
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
    }
    everywhere = set().union(*class_attrs.values())
    found = []
    for name, tree in trees.items():
        for func, cls in _functions(tree):
            attrs = class_attrs[id(cls)] if cls is not None else set()
            names = _holder_names(func, attrs)
            for node in ast.walk(func):
                if not isinstance(node, ast.Attribute) or node.attr not in flat:
                    continue
                r = node.value
                elsewhere = (
                    isinstance(r, ast.Attribute) and not _is_self(r.value) and r.attr in everywhere
                )
                if _holds(r, names, attrs) or elsewhere:
                    group = flat[node.attr]
                    found.append(
                        f"{name}:{node.lineno}: {ast.unparse(node)} (.{group}.{node.attr})"
                    )
    return found


def _grouped_reader_sources(root: Path = ROOT) -> dict[str, str]:
    out = {}
    for entry in GROUPED_READERS:
        path = root / entry
        for p in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            out[str(p.relative_to(root))] = p.read_text()
    return out


def test_parts_read_the_engine_config_by_group():
    """No module of core/, runner/, layers/, resolve.py or the GPU program inspector reads a flat
    EngineConfig field: each reads the group holding it (`config.scheduler.num_slots`) or takes
    the group itself. The front doors (llm.py, the entrypoints, the launchers) read the flat
    settings they were given: that is the user's surface."""
    found = flat_config_reads(_grouped_reader_sources())
    assert not found, "flat EngineConfig reads (read them through the group):\n" + "\n".join(found)


_FLAT_READS = """
class Part:
    def __init__(self, config: EngineConfig, scheduler: SchedulerConfig):
        self.config = config
        self.sched = scheduler
        self.n = config.num_slots                     # 1: an annotated parameter
        self.ok = config.scheduler.num_slots + scheduler.num_slots + self.sched.decode_steps

    def step(self):
        c = self.config
        return self.config.page_size, c.seed          # 2, 3: its attribute, an alias
def pages(model_config, engine_config):
    c, m = engine_config, model_config
    return c.max_model_len, m.num_layers, engine_config.cache.page_size   # 4: a tuple alias
def warm(runner):
    return runner.config.max_model_len, runner.config.scheduler.max_model_len   # 5: X.config
"""


def test_flat_reads_are_found():
    """The check above can fail: a planted flat read is found in each form it looks for, and the
    grouped ones beside them are not."""
    found = flat_config_reads({"part.py": _FLAT_READS})
    assert [f.split(": ", 1)[1] for f in found] == [
        "config.num_slots (.scheduler.num_slots)",
        "self.config.page_size (.cache.page_size)",
        "c.seed (.requests.seed)",
        "c.max_model_len (.scheduler.max_model_len)",
        "runner.config.max_model_len (.scheduler.max_model_len)",
    ], found
    # and the real tree holds EngineConfigs where the check looks for them
    sources = _grouped_reader_sources()
    planted = {
        name: text.replace(".scheduler.", ".")
        for name, text in sources.items()
        if name.endswith(("runner/runner.py", "core/engine.py"))
    }
    assert len(flat_config_reads(planted)) >= 2


def summary(root: Path = ROOT) -> str:
    """The import graph in numbers: modules, lines, imports, floors (the longest chain of
    imports), cycles, imports running up LAYERS, files over 400 lines."""
    global ROOT
    saved, ROOT = ROOT, Path(root)
    try:
        graph, files = import_graph(), module_files()
    finally:
        ROOT = saved
    sizes = {m: len(p.read_text().splitlines()) for m, p in files.items()}
    depth: dict[str, int] = {}

    def floor(m: str) -> int:  # acyclic (test_no_import_cycles)
        if m not in depth:
            depth[m] = 1 + max((floor(t) for t in graph[m]), default=0)
        return depth[m]

    cycles = strongly_connected(graph)
    up = sum(layer_of(b) > layer_of(a) for a, edges in graph.items() for b in edges)
    big = sorted(((n, m) for m, n in sizes.items() if n > 400), reverse=True)
    return (
        f"{len(graph)} modules, {sum(sizes.values())} lines, "
        f"{sum(map(len, graph.values()))} imports, "
        f"{'-' if cycles else max(map(floor, graph))} floors, {len(cycles)} cycles, "
        f"{up} imports up the layers, {len(big)} files over 400 lines: "
        + ", ".join(f"{m} {n}" for n, m in big)
    )


if __name__ == "__main__":  # python tests/test_architecture.py [ROOT of another checkout]
    import sys

    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT))


# What launches a kernel: a Pallas call (Triton or Mosaic GPU) or a C++ FFI call.
KERNEL_CALLS = ("pallas_call(", "plgpu.kernel(", "ffi_call(")


def _kernel_modules() -> list[Path]:
    """Every module of pallas_kernels/ and cpu_kernels/ that launches a kernel, or is an XLA form
    of one (xla.py, xla_int4_matmul.py), but the shared pieces (`*_common.py`)."""
    found = []
    for path in sorted([*ROOT.glob("pallas_kernels/**/*.py"), *ROOT.glob("cpu_kernels/*.py")]):
        text = path.read_text()
        if path.stem.endswith("_common") or path.stem == "__init__":
            continue
        if path.stem.startswith("xla") or any(call in text for call in KERNEL_CALLS):
            found.append(path)
    return found


def _defines_reference(tree: ast.Module) -> bool:
    """A top-level `reference = ...`, or a function or import named `*_reference`."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "reference" for t in node.targets):
                return True
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_reference"):
            return True
        if isinstance(node, ast.ImportFrom):
            if any((a.asname or a.name).endswith("_reference") for a in node.names):
                return True
    return False


def test_every_kernel_file_carries_its_reference():
    """The project's rule: a kernel's pure-jnp definition is at hand in the kernel's own file,
    defined there or named there (`reference = decode_reference` for the attention family, whose
    kernels share `attention/reference.py`)."""
    modules = _kernel_modules()
    names = {p.relative_to(ROOT).as_posix() for p in modules}
    # the detection sees every backend's kernels (a rule that finds nothing checks nothing)
    for expected in (
        "pallas_kernels/attention/triton_decode.py",
        "pallas_kernels/attention/mgpu_prefill.py",
        "pallas_kernels/attention/xla.py",
        "pallas_kernels/mgpu_w4_matmul.py",
        "pallas_kernels/xla_int4_matmul.py",
        "cpu_kernels/matmul.py",
    ):
        assert expected in names, (expected, sorted(names))
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in modules
        if not _defines_reference(ast.parse(p.read_text()))
    ]
    assert not missing, f"kernel files without their reference: {missing}"
