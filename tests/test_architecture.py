"""The layout's rules, checked on the source: no import cycle (imports inside functions and under
``TYPE_CHECKING`` included), no module importing one from a layer above it, no module over 400 lines,
and no probing of this package's own objects with ``getattr``/``hasattr``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "lightning_vllm"

# Lowest first; a module may import from its own layer or from those below. docs/index.md draws them.
LAYERS: dict[str, list[str]] = {
    "base": ["settings", "errors", "options", "_waits", "prompts"],
    "in vLLM": ["in_vllm", "in_vllm.plugin", "in_vllm.busy_wait", "in_vllm.lora_adapters", "in_vllm.lora_ops",
               "in_vllm.worker_methods"],
    "what is sent": [
        "weights", "weights.base", "weights.model", "weights.lora_merge", "weights.fsdp",
        "weights.zero3", "weights.sources", "weights.checks", "weights.payload", "weights.snapshot", "weights.shares",
        "weights.layer_sums", "weights.packed_sums", "weights.held_sums",
        "weights.cpu_loops", "weights.gpu_sums", "weights.survey", "weights.hf_conversion", "weights.checkpoint_layout",
        "weights.fp8", "weights.online_sums",
        "lora", "lora.adapter", "lora.serving",
    ],
    "where vLLM lives": [
        "engines", "engines.routes", "engines.completions", "engines.serialization", "engines.worker_check",
        "engines.base", "engines.local", "engines.async_local", "engines.http", "engines.ray",
        "engines.failures", "server", "engines.client", "engines.sleep", "engines.placement",
    ],
    "backends": [
        "backends", "backends.base", "backends.registry", "backends.vllm_engines",
        "backends.gloo", "backends.gloo.messages", "backends.gloo.group", "backends.gloo.rendezvous",
        "backends.gloo.tied_embedding_fix", "backends.gloo.moe_prepack_fix", "backends.gloo.receiver",
        "backends.gloo.worker", "backends.gloo.shares", "backends.gloo.trainer",
        "backends.gloo.backend",
        "backends.nccl", "backends.nccl.worker", "backends.nccl.backend",
        "backends.ipc", "backends.ipc.backend",
        "backends.lightning_ipc", "backends.lightning_ipc.recorded_loads", "backends.lightning_ipc.summed_replay",
        "backends.lightning_ipc.sums_mailbox",
        "backends.lightning_ipc.worker",
        "backends.lightning_ipc.trainer", "backends.lightning_ipc.backend",
        "backends.lightning_nccl", "backends.lightning_nccl.worker", "backends.lightning_nccl.backend",
    ],
    "core": [
        "core", "core.versions", "core.after_failure", "core.facts", "core.connection",
        "core.payload_choice", "core.landing_check", "core.push", "core.weight_sync",
    ],
    "fronts": [
        "fronts", "fronts.lightning", "fronts.lightning.ranks", "fronts.lightning.every_rank", "fronts.lightning.roles",
        "fronts.lightning.background", "fronts.lightning.rollouts", "fronts.lightning.push_points",
        "fronts.lightning.sleeping", "fronts.lightning.callback", "fronts.torchrl", "fronts.torchrl.collectors",
        "fronts.torchrl.updater",
        "fronts.torchrl.scheme",
    ],
    "the package": ["", "torchrl"],
}  # fmt: skip

MAX_FLOORS = 8
"""The most floors the house may have: rooms (a top-level module, or a folder) stacked by their imports (``benchmarks/``
stands on them: one more)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every module's imports of this package's modules, wherever they stand in the file."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_vllm"):
                base = node.module.removeprefix("lightning_vllm").lstrip(".")
                for alias in node.names:
                    submodule = f"{base}.{alias.name}".lstrip(".")
                    imported.add(submodule if submodule in modules else base)
            elif isinstance(node, ast.Import):
                imported |= {
                    a.name.removeprefix("lightning_vllm").lstrip(".")
                    for a in node.names
                    if a.name.startswith("lightning_vllm")
                }
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def test_every_module_has_a_layer_and_imports_point_down():
    layer_of = {module: rank for rank, modules in enumerate(LAYERS.values()) for module in modules}
    graph = import_graph()
    assert sorted(set(graph) - set(layer_of)) == [], "a module without a layer: add it to LAYERS and docs/index.md"
    upward = [
        f"{module} imports {other}" for module, imports in graph.items() for other in imports
        if layer_of[other] > layer_of[module]
    ]  # fmt: skip
    assert upward == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                return [*path, module, other]
            if other not in state and (cycle := visit(other, [*path, module])):
                return cycle
        state[module] = 2
        return None

    cycles = [cycle for module in sorted(graph) if module not in state and (cycle := visit(module, []))]
    assert cycles == []


def test_no_module_is_over_400_lines():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_our_own_objects_are_not_probed():
    """Capabilities are Protocols an engine target declares, and a push's extras travel in a Payload:
    none of these names is asked for with getattr/hasattr any more."""
    ours = {
        "adapter", "adapter_config", "adapter_message", "stamps", "loads_at_finish", "follow_timeout",
        "lora_limits", "serve_adapter", "check_serves_adapters", "background_push_problem", "lora_request",
        "rollouts", "iter_groups", "llm", "async_llm", "handle", "base_url", "engine_key",
    }  # fmt: skip
    probes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ours
            ):
                probes.append(f"{module_name(path)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    assert probes == []


def room_graph() -> dict[str, set[str]]:
    """Which rooms (a top-level module or folder; the package itself is one) each room imports."""
    room = lambda module: module.split(".")[0]  # noqa: E731
    rooms: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        rooms.setdefault(room(module), set()).update(room(other) for other in imports if room(other) != room(module))
    return rooms


def test_the_rooms_stand_on_at_most_eight_floors_with_no_arrow_back_up():
    """A folder is one row of the house: no two rooms import each other, even through others, and the
    longest chain of rooms standing on each other (the package on top) is at most ``MAX_FLOORS``."""
    rooms = room_graph()
    floors: dict[str, int] = {}

    def floor(name: str, path: tuple[str, ...] = ()) -> int:
        assert name not in path, f"rooms in a circle: {' -> '.join([*path, name])}"
        if name not in floors:
            floors[name] = 1 + max((floor(other, (*path, name)) for other in rooms[name]), default=0)
        return floors[name]

    assert max(floor(name) for name in rooms) <= MAX_FLOORS, sorted(floors.items(), key=lambda item: item[1])


BACKEND_NAMES = {"gloo", "nccl", "ipc", "sparse_nccl", "nccl_m2n"}
"""The backends' names (vLLM's and ours): compared nowhere outside the backends' own modules."""


def test_no_module_outside_the_backends_compares_backend_names():
    """Code asks a backend for its traits instead (``backends/base.py``); the backends, and the
    plugin that registers them (``in_vllm/``), may name themselves."""

    def names_a_backend(node: ast.AST) -> bool:
        constants = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(c, ast.Constant) and c.value in BACKEND_NAMES for c in constants)

    comparisons = []
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        if module.split(".")[0] in ("backends", "in_vllm"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(map(names_a_backend, [node.left, *node.comparators])):
                comparisons.append(f"{module}:{node.lineno}")
    assert comparisons == []
