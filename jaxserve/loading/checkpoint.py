"""Converted checkpoints: params (float or quantized) + config + recipe + tokenizer, via orbax.

On disk (see checkpoints/README.md):

    <dir>/
      jaxserve_checkpoint.json   {"format", "version", "config": ModelConfig fields,
                                  "recipe": {"quantization", "group_size", "dtype", ...,
                                             "int4_layout": {"shards": {weight: S}}},
                                  "weights": {"layers/wq": {"type": "Int4Weight",
                                                            "static": {"group_size": 128, ...},
                                                            "shape": [L, K, N]}, ...}}
      params/                    orbax (StandardCheckpointer) of the params pytree in which every
                                 quantized weight is a dict of its array fields
                                 (Int4Weight -> {"packed", "scales", "mins"})
      tokenizer/                 the tokenizer's save_pretrained files (absent if it had none)

    save_checkpoint(path, config, params, tokenizer, recipe)
    load_checkpoint(path, quantization=None) -> LoadedModel(config, params, tokenizer, source)

Loading rebuilds each quantized weight from its type name and static fields (except the INT4
matmul `impl`, which the engine sets for its backend), then checks that the recipe matches the
weights (method family, group size, which weights are quantized) and that every parameter has the
shape the config implies; a mismatch raises ValueError naming the weight.

A malformed or tampered jaxserve_checkpoint.json (bad JSON, wrong field types, unknown static
fields, an invalid config) raises ModelLoadError naming it; the config is validated before
orbax restores anything. So are orbax's files: none may resolve outside the checkpoint, and no
array its metadata lists may be larger than the config's largest parameter.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.loading.hf import inside
from jaxserve.loading.loaded import LoadedModel, ModelLoadError, read_json
from jaxserve.loading.params import flat_shapes
from jaxserve.loading.tokenizer import load_tokenizer
from jaxserve.models import llama
from jaxserve.quant import QUANTIZED_TYPES, linear_weight_names

log = logging.getLogger(__name__)

FORMAT = "jaxserve-checkpoint"
VERSION = 1
META_FILE = "jaxserve_checkpoint.json"
TYPES = {cls.__name__: cls for cls in QUANTIZED_TYPES}
# Static fields the engine chooses when it is built, not the checkpoint: saved for the record but
# not restored (the INT4 matmul `impl`; checkpoints written before it became static say "auto";
# `parallel`, set by the partition rules when the weight is placed on a mesh, and `kernel_rows`,
# set with the impl, are not even saved).
RUNTIME_FIELDS = ("impl", "parallel", "kernel_rows")
# The weight type each quantization family must produce.
FAMILY_TYPE = {"int4": "Int4Weight", "int8": "Int8Weight", "fp8": "Fp8Weight"}


def is_checkpoint(path) -> bool:
    p = Path(path)
    return (p / META_FILE).is_file() and (p / "params").is_dir()


def config_to_dict(config: ModelConfig) -> dict:
    d = dataclasses.asdict(config)
    d["eos_token_ids"] = list(config.eos_token_ids)
    return d


def config_from_dict(d: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"checkpoint config has unknown field(s) {unknown}")
    d = dict(d)
    if d.get("rope_scaling") is not None:
        if not isinstance(d["rope_scaling"], dict):
            raise ValueError(f"rope_scaling must be an object, got {d['rope_scaling']!r}")
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
    # JSON has no tuples: ModelConfig's sequence fields (mlp_only_layers, ...) are tuples.
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return ModelConfig(**d)


def _split_fields(w) -> tuple[dict, dict]:
    """A quantized-weight dataclass -> ({array field: array}, {static field: value})."""
    arrays, static = {}, {}
    for f in dataclasses.fields(w):
        target = arrays if f.metadata.get("pytree_node", True) else static
        target[f.name] = getattr(w, f.name)
    return arrays, static


def _walk(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _walk(v, prefix + k + "/")
        else:
            yield prefix + k, v


def _set(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree[p]
    tree[leaf] = value


def save_checkpoint(path, config: ModelConfig, params: dict, tokenizer=None, recipe=None) -> Path:
    """Writes params, config, recipe and tokenizer under `path` (created; must not exist)."""
    path = Path(path).resolve()
    if path.exists():
        raise ValueError(f"checkpoint output {path} already exists")
    llama.check_params(params, config)
    recipe = dict(recipe or {"quantization": None})
    weights, saved = (
        {},
        jax.tree_util.tree_map(lambda x: x, params, is_leaf=lambda x: not isinstance(x, dict)),
    )
    for name, leaf in _walk(params):
        if isinstance(leaf, QUANTIZED_TYPES):
            arrays, static = _split_fields(leaf)
            static = _saved_static(static)
            weights[name] = {
                "type": type(leaf).__name__,
                "static": static,
                "shape": list(leaf.shape),
            }
            _set(saved, name, arrays)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "config": config_to_dict(config),
        "recipe": recipe,
        "weights": weights,
    }
    if int4_layout(weights) is not None:
        recipe["int4_layout"] = int4_layout(weights)
    _check_recipe(recipe, weights, params, config)
    path.mkdir(parents=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", saved)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path / "tokenizer"))
    (path / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("saved checkpoint %s (%s)", path, recipe.get("quantization"))
    return path


def _saved_static(static: dict) -> dict:
    """The static fields written for a weight: not `parallel` and `kernel_rows` (where it is placed
    and how many rows its kernel takes are the engine's choices), and not `shards` when 1 (the plain INT4 layout, left implicit as in checkpoints
    written before shards existed; `int4_layout` in the recipe records it either way)."""
    static = {k: v for k, v in static.items() if k not in ("parallel", "kernel_rows")}
    if static.get("shards") == 1:
        del static["shards"]
    return static


def int4_layout(weights: dict) -> dict | None:
    """The INT4 packing the checkpoint holds, for its recipe: {"shards": {weight: S}} (each weight's
    N columns packed as S blocks, `pallas_kernels/int4_layout.py`; 1 = the plain layout, and
    what checkpoints from before shards existed hold); None without INT4 weights."""
    shards = {
        name: spec["static"].get("shards", 1)
        for name, spec in sorted(weights.items())
        if spec["type"] == "Int4Weight"
    }
    return {"shards": shards} if shards else None


def _check_recipe(recipe: dict, weights: dict, params: dict, config: ModelConfig) -> None:
    """Raises ValueError naming the first weight the recipe does not describe."""
    if "int4_layout" in recipe and recipe["int4_layout"] != int4_layout(weights):
        raise ValueError(
            f"recipe int4_layout {recipe['int4_layout']} does not match the weights' "
            f"{int4_layout(weights)}"
        )
    method = recipe.get("quantization")
    if method is None:
        if weights:
            raise ValueError(
                f"recipe says unquantized but {sorted(weights)[0]} is a {weights[sorted(weights)[0]]['type']}"
            )
        return
    family = str(method).split("-")[0]
    want = FAMILY_TYPE.get(family)
    if want is None:
        raise ValueError(
            f"recipe quantization {method!r} is not one of the families {sorted(FAMILY_TYPE)}"
        )
    for name in linear_weight_names(params, config):
        if name not in weights:
            raise ValueError(f"recipe says {method} but weight {name} is not quantized")
        if weights[name]["type"] != want:
            raise ValueError(
                f"recipe says {method} but weight {name} is a {weights[name]['type']} (expected {want})"
            )
        g = recipe.get("group_size")
        got = weights[name]["static"].get("group_size")
        if (
            family == "int4"
            and g is not None
            and got != g
            and not recipe.get("allow_smaller_groups")
        ):
            raise ValueError(
                f"recipe group_size {g} does not match weight {name} (group_size {got})"
            )


def _read_meta(path: Path) -> dict:
    """jaxserve_checkpoint.json, its structure checked; ModelLoadError naming it otherwise."""
    meta_file = path / META_FILE
    meta = read_json(inside(path, meta_file), META_FILE)
    if not isinstance(meta, dict):
        raise ModelLoadError(meta_file, f"must hold a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ModelLoadError(
            meta_file,
            f"format {meta.get('format')!r} version {meta.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}",
        )
    for key in ("config", "recipe", "weights"):
        if not isinstance(meta.get(key), dict):
            raise ModelLoadError(meta_file, f"{key!r} must be an object, got {meta.get(key)!r}")
    for name, spec in meta["weights"].items():
        ok = (
            isinstance(spec, dict)
            and spec.get("type") in TYPES
            and isinstance(spec.get("static"), dict)
            and isinstance(spec.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in spec["shape"])
        )
        if not ok:
            raise ModelLoadError(
                meta_file,
                f"weight {name}: expected {{'type': one of {sorted(TYPES)}, 'static': {{...}}, "
                f"'shape': [int, ...]}}, got {spec!r}",
            )
    return meta


def _rebuild(name: str, spec: dict, node, meta_file: Path):
    """The quantized weight `spec` describes, from its restored arrays `node`."""
    cls = TYPES[spec["type"]]
    array_fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True)}
    static = {k: v for k, v in spec["static"].items() if k not in RUNTIME_FIELDS}
    if not isinstance(node, dict) or set(node) != array_fields or set(static) & array_fields:
        raise ModelLoadError(
            meta_file,
            f"weight {name}: a {spec['type']} has arrays {sorted(array_fields)}, params/ holds "
            f"{sorted(node) if isinstance(node, dict) else type(node).__name__} and static "
            f"fields {sorted(static)}",
        )
    try:
        w = cls(**node, **static)
        if hasattr(w, "check"):
            w.check()
    except (TypeError, ValueError) as e:
        raise ModelLoadError(meta_file, f"weight {name}: {e}") from e
    if list(w.shape) != list(spec["shape"]):
        raise ModelLoadError(
            meta_file,
            f"weight {name} has shape {tuple(w.shape)}, recipe says {tuple(spec['shape'])}",
        )
    return w


def load_checkpoint(path, quantization: str | None = None, mesh=None) -> LoadedModel:
    """-> LoadedModel(config, params, tokenizer, source). quantization, if given, must equal the
    recipe's method (so a server asked for int4-gptq never silently serves an int8 checkpoint).
    mesh: a ('data', 'model') mesh; orbax restores every array straight onto its shards (the
    partition rules' split, `parallel.partition.load_spec`)."""
    path = Path(path).resolve()
    if not is_checkpoint(path):
        raise ValueError(f"{path} is not a jaxserve checkpoint (needs {META_FILE} and params/)")
    meta_file = path / META_FILE
    meta = _read_meta(path)
    try:
        config = config_from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise ModelLoadError(meta_file, f"invalid config: {e}") from e
    recipe, weights = meta["recipe"], meta["weights"]
    if quantization is not None and quantization != recipe.get("quantization"):
        raise ValueError(
            f"requested quantization {quantization!r} but checkpoint {path} holds "
            f"{recipe.get('quantization')!r}"
        )
    for entry in (path / "params", path / "tokenizer"):
        inside(path, entry)
    with ocp.StandardCheckpointer() as ckptr:
        _check_params_dir(ckptr, path, config)  # before orbax reads or allocates anything
        target = (
            None if mesh is None else _sharded_target(ckptr, path / "params", config, weights, mesh)
        )
        params = ckptr.restore(path / "params", target)
    for name, spec in weights.items():
        node = params
        for part in name.split("/"):
            if not isinstance(node, dict) or part not in node:
                raise ModelLoadError(
                    meta_file, f"weight {name} is listed in {META_FILE} but missing from params/"
                )
            node = node[part]
        _set(params, name, _rebuild(name, spec, node, meta_file))
    try:
        llama.check_params(params, config)
        _check_recipe(recipe, weights, params, config)
    except ValueError as e:
        raise ModelLoadError(meta_file, str(e)) from e
    tok_dir = path / "tokenizer"
    tokenizer = load_tokenizer(tok_dir) if tok_dir.is_dir() else None
    return LoadedModel(config, params, tokenizer, str(path))


def _check_params_dir(ckptr, path: Path, config: ModelConfig) -> None:
    """Untrusted files: every file orbax could open under params/ (symlinks followed) stays inside
    the checkpoint, and no saved array is larger than the config's largest parameter (a quantized
    field never is), so a tampered orbax metadata cannot make the restore allocate from a size
    nobody checked. ModelLoadError naming the file or the array."""
    params_dir = path / "params"
    for p in params_dir.rglob("*"):
        inside(path, p)
    largest = max(math.prod(shape) for shape in flat_shapes(config).values())
    try:
        tree = ckptr.metadata(params_dir).item_metadata.tree
    except Exception as e:  # orbax's own errors: a malformed metadata file
        raise ModelLoadError(params_dir, f"unreadable orbax metadata: {e}") from e
    for key_path, meta in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in key_path)
        shape = tuple(getattr(meta, "shape", ()) or ())
        if math.prod(shape) > largest:
            raise ModelLoadError(
                params_dir,
                f"array {name} of shape {list(shape)} is larger than any parameter of the "
                f"config ({largest} elements)",
            )


def _check_row_groups(weights: dict, t: int) -> None:
    """An INT4 row-parallel weight splits its input rows over T devices in whole groups: ValueError
    naming the weight when its group size does not divide a device's rows (before orbax tries)."""
    from jaxserve.parallel.partition import role_of

    for name, spec in weights.items():
        group = spec.get("static", {}).get("group_size")
        if spec["type"] != "Int4Weight" or role_of(name.split("/")[-1]) != "row" or t == 1:
            continue
        rows = spec["shape"][-2] // t
        if group and rows % group:
            raise ValueError(
                f"{name}: INT4 groups of {group} rows cannot split over tensor_parallel_size={t} "
                f"({rows} input rows per device); convert with a --group_size dividing {rows}, "
                "or use fewer devices"
            )


def _sharded_target(ckptr, params_dir: Path, config: ModelConfig, weights: dict, mesh):
    """The restore target: every saved array as a ShapeDtypeStruct on its shards."""
    from jaxserve.parallel.mesh import mesh_sizes
    from jaxserve.parallel.partition import load_spec

    _, t = mesh_sizes(mesh)
    _check_row_groups(weights, t)
    tree = ckptr.metadata(params_dir).item_metadata.tree

    def target(key_path, meta):
        name = "/".join(str(getattr(k, "key", k)) for k in key_path)
        spec = load_spec(name, len(meta.shape), config, t)
        sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(target, tree)


def read_recipe(path) -> dict:
    """The recipe of a checkpoint (what was quantized and how), without loading params."""
    return json.loads((Path(path) / META_FILE).read_text())["recipe"]
