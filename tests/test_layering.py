"""The layering the folders show (docs/architecture.md), checked on the source: every import, at module level or
inside a function, is an edge. Each layer imports only the layers below it; a backend's session imports the
runtime and its own runtime library only; commands reach backends through the `targets` registry; and no module
imports itself through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash_onnx"
# the layers beneath the one import name: dflash_onnx.<layer>; the design card's passes/ and targets/ stay at the top
# of the repository and install as dflash_onnx.passes and dflash_onnx.targets (pyproject.toml's package-dir)
LAYERS = ("runtime", "artifacts", "exporter", "training", "passes", "targets", "serving")
MAPPED = {"passes": ROOT / "passes", "targets": ROOT / "targets"}
# each layer (the CLI apart) and the layers it may import, bottom up; exporter, training and passes are siblings that
# never import each other's modules, except that training trains the exporter's draft; the commands are the modules
# of dflash_onnx/ outside the layers' folders
MAY_IMPORT = {
    "runtime": {"runtime"},
    "artifacts": {"runtime", "artifacts"},
    "exporter": {"runtime", "artifacts", "exporter"},
    "training": {"runtime", "artifacts", "exporter", "training"},
    "passes": {"runtime", "artifacts", "passes"},
    "targets": {"runtime", "artifacts", "exporter", "passes", "targets"},
    "commands": {"runtime", "artifacts", "exporter", "training", "passes", "targets", "commands"},
    # the HTTP server and its other hosts (Ray Serve, Triton): the runtime, and the targets registry to open a
    # directory
    "serving": {"runtime", "targets", "serving"},
    "cli": {"runtime", "artifacts", "exporter", "training", "passes", "targets", "commands", "serving", "cli"},
}
# third-party libraries each layer may use (besides the standard library)
RUNTIME_LIBRARIES = {"numpy", "tokenizers", "jinja2"}
LAYER_LIBRARIES = {"runtime": RUNTIME_LIBRARIES, "artifacts": RUNTIME_LIBRARIES | {"onnx", "huggingface_hub"},
                   "passes": RUNTIME_LIBRARIES | {"onnx", "onnx_ir", "onnxscript", "onnxruntime"}}
SESSION_LIBRARIES = {"ort": {"onnxruntime", "onnx"}, "ai100": {"QAicApi_pb2", "qaicrt"}, "mlx": {"mlx", "onnx"},
                     "coreml": {"coremltools"}}
# neutral helpers a session may use: artifact names checked to stay inside their directory; how many rows the
# K/V buffers of the ORT and MLX sessions hold (no runtime import of its own)
SESSION_HELPERS = {"dflash_onnx.artifacts.graph_files", "dflash_onnx.targets.kv_rows"}
HEAVY = {"torch", "transformers", "safetensors", "onnx", "onnxruntime", "onnx_ir", "onnxscript", "mlx", "coremltools"}
THIRD_PARTY = HEAVY | RUNTIME_LIBRARIES | {"tqdm", "matplotlib", "onnxruntime_genai", "dflash", "scipy", "optimum",
                                          "huggingface_hub",
                                          "QAicApi_pb2", "qaicrt"}


def layer(module: str) -> str:
    """The layer a project module belongs to: dflash_onnx.<layer>...; the package's other modules are the commands,
    and its entry points (cli, __main__) the CLI."""
    if module in (f"{PACKAGE}.cli", f"{PACKAGE}.__main__"):
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "commands"


def _module_name(path: Path) -> str:
    for name, folder in MAPPED.items():
        if path.is_relative_to(folder):
            parts = [PACKAGE, name, *path.relative_to(folder).with_suffix("").parts]
            break
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [p for folder in (ROOT / PACKAGE, *MAPPED.values()) for p in sorted(folder.rglob("*.py"))]
    return {_module_name(p): p for p in files if "demo_pair" not in p.parts}


MODULES = _modules()
RUNTIME = {m for m in MODULES if layer(m) == "runtime"}


def _imports(name: str, path: Path) -> set[str]:
    """Every module `name` imports, project modules resolved to the module (not the names in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def _project(imports: set[str]) -> set[str]:
    return {m for m in imports if m in MODULES}


def _libraries(imports: set[str]) -> set[str]:
    return {_top(m) for m in imports if _top(m) in THIRD_PARTY}


def test_the_walk_sees_the_code():
    core = ("errors", "manifest", "session", "runners", "sampling", "decode", "feeds", "tokenizer", "chat", "paths",
            "policy", "costs")
    assert {f"dflash_onnx.runtime.{name}" for name in core} <= RUNTIME
    assert "dflash_onnx.targets.ort.session" in MODULES and "dflash_onnx.passes.kv_buffer" in MODULES
    assert "dflash_onnx.runtime.manifest" in GRAPH["dflash_onnx.runtime.decode"]
    assert "dflash_onnx.targets.ort.lower" in GRAPH["dflash_onnx.targets.ort"]  # imports inside functions count
    assert {"torch"} <= _libraries(GRAPH["dflash_onnx.exporter.export"])
    assert {layer(m) for m in MODULES} == set(MAY_IMPORT), "a folder the layering does not know"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(_project(GRAPH[module])):
            if state.get(imported) == 1:
                cycle = path[path.index(imported):] + [imported]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_the_layers_below_its_own(module):
    allowed = MAY_IMPORT[layer(module)]
    above = sorted(m for m in _project(GRAPH[module]) if layer(m) not in allowed)
    assert not above, f"{module} ({layer(module)}) imports {above}"
    if layer(module) in LAYER_LIBRARIES:
        extra = _libraries(GRAPH[module]) - LAYER_LIBRARIES[layer(module)]
        assert not extra, f"{module} ({layer(module)}) imports {sorted(extra)}"


@pytest.mark.parametrize("backend", sorted(SESSION_LIBRARIES))
def test_a_session_imports_the_runtime_and_its_own_library_only(backend):
    module = f"dflash_onnx.targets.{backend}.session"
    package = f"dflash_onnx.targets.{backend}"
    own = {m for m in MODULES if m.startswith(f"{package}.")} - {f"{package}.lower"}
    allowed = RUNTIME | SESSION_HELPERS | own | {"dflash_onnx.targets.backend"}
    reached, pending = set(), [module]
    while pending:  # everything the session needs loaded, transitively (within its own package)
        current = pending.pop()
        for imported in _project(GRAPH[current]) - reached:
            assert imported in allowed, f"{current} (needed by {module}) imports {imported}"
            reached.add(imported)
            pending.append(imported)
    libraries = set().union(*(_libraries(GRAPH[m]) for m in reached | {module}))
    assert libraries <= RUNTIME_LIBRARIES | SESSION_LIBRARIES[backend], f"{module} needs {libraries}"


def _top_level_imports(module: str) -> set[str]:
    """What importing `module` imports right away (not inside functions), project modules resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
            base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return found


def _loaded_at_import(start: str) -> tuple[set[str], set[str]]:
    """The project modules and third-party libraries importing `start` loads right away (its parent packages
    first)."""
    loaded, libraries, pending = {start}, set(), [start]
    while pending:
        current = pending.pop()
        parents = {".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)}
        imports = _top_level_imports(current) | parents
        libraries |= _libraries(imports)
        for imported in _project(imports) - loaded:
            loaded.add(imported)
            pending.append(imported)
    return loaded, libraries


def test_loading_the_registry_needs_only_the_core_runtime():
    """Every command imports `targets`: that must not pull in torch, onnx (~1 s with ml_dtypes: a bad flag is
    refused before it) or the lowerings' tools; the ORT and MLX sessions, which need onnx, load when one opens,
    with the core runtime and onnx only."""
    loaded, libraries = _loaded_at_import("dflash_onnx.targets")
    assert libraries <= RUNTIME_LIBRARIES | {"onnxruntime"}, libraries
    assert not {m for m in loaded if m.endswith(".lower")}, loaded
    assert not {"dflash_onnx.targets.ort.session", "dflash_onnx.targets.mlx.session"} & loaded, loaded
    for session in ("dflash_onnx.targets.ort.session", "dflash_onnx.targets.mlx.session"):
        loaded, libraries = _loaded_at_import(session)
        assert libraries <= RUNTIME_LIBRARIES | {"onnx", "onnxruntime"}, (session, libraries)
        assert not {m for m in loaded if m.endswith(".lower")}, (session, loaded)


def test_commands_reach_backends_through_the_registry():
    for module, imports in GRAPH.items():
        if layer(module) not in ("commands", "cli"):
            continue
        direct = {m for m in _project(imports) if m.startswith("dflash_onnx.targets.")}
        assert not direct, f"{module} imports {sorted(direct)}: go through the targets registry"


@pytest.mark.parametrize("module", ["decode", "request", "proposers", "policy", "runners"])
def test_the_decoding_loop_reads_a_function_to_a_screen(module):
    """The loop is in layers (Decoder -> RequestDecoding -> proposer, policy, runners): no function of it runs past
    60 lines, docstring included."""
    path = MODULES[f"dflash_onnx.runtime.{module}"]
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60]
    assert not long, long
