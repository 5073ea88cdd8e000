"""The package's layers (docs/architecture.md, "Layers of the package"): every import, at module level
or inside a function, goes to a layer at or below the importer's, and no two parts of the package
import each other (no circle), read from the source with ast."""
import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardmoe"

# bottom to top: a part may import the parts of its own layer and of the layers below it
LAYERS = [
    ("rows", "expert_kinds", "notation", "settings", "testing"),
    ("kernels",),
    ("mesh",),
    ("moe",),
    ("parallel",),
    ("shardmoe",),  # the package's own __init__: MoE, Mesh, and parallel's registration
    ("model",),
    ("check", "arguments"),
    ("tasks", "hf", "torchtitan"),
    ("train", "simulate"),
    ("tools",),  # the measurement tools
    ("cli", "__main__"),
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _part(module: str) -> str:
    """The package part a module belongs to: its first name below shardmoe ('shardmoe' for the package)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else "shardmoe"


def _module_imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at module level or inside a function)."""
    graph = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")] or [base]
            else:
                continue
            graph[module].update(t for t in targets if t.split(".")[0] == "shardmoe" and t != module)
    return graph


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the 'module -> module' imports between them."""
    edges = defaultdict(list)
    for module, targets in _module_imports().items():
        for target in sorted(targets):
            if _part(target) != _part(module):
                edges[(_part(module), _part(target))].append(f"{module} -> {target}")
    return edges


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(_module(p)) for p in PACKAGE.rglob("*.py")}
    assert parts <= set(RANK), sorted(parts - set(RANK))


def test_no_part_imports_a_layer_above_it():
    upward = {pair: found for pair, found in _imports().items() if RANK[pair[1]] > RANK[pair[0]]}
    assert not upward, upward


def test_no_two_parts_import_each_other():
    edges = _imports()
    circles = {(a, b): edges[(a, b)] + edges[(b, a)] for a, b in edges if (b, a) in edges and a < b}
    assert not circles, circles


def test_no_module_imports_itself_back_through_others():
    """No circle of imports between modules either, inside a part too (a circle between two modules
    makes each half of one concept: it was kernels/tuned.py and kernels/tuning.py)."""
    graph = _module_imports()
    circles, done = [], set()

    def visit(module, path):
        if module in path:
            circles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not circles, [" -> ".join(c) for c in circles]


# the modules one warm CPU forward + backward of the default layer runs code in: the walk of x in
# docs/architecture.md, which a reader follows; a new stop on it shows here first
WALK = {"layer", "function", "config", "routing", "dispatch", "experts", "cpu", "combine", "precision"}
LEAVES = {"shardmoe.rows", "shardmoe.expert_kinds"}


def test_one_cpu_step_of_the_layer_walks_the_documented_modules():
    import sys

    import torch

    import shardmoe

    torch.manual_seed(0)
    layer = shardmoe.MoE(64, 128, 8, 2)
    x = torch.randn(256, 64, requires_grad=True)
    layer(x).sum().backward()  # warm: the C++ library is loaded, the caches are filled
    entered = set()

    def note(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("shardmoe"):
            entered.add(name)

    sys.setprofile(note)
    try:
        layer(x).sum().backward()
    finally:
        sys.setprofile(None)
    assert entered == {f"shardmoe.moe.{m}" for m in WALK} | LEAVES and len(entered) <= 11, sorted(entered)


# The corridor from the module to its first expert GEMM: MoE.forward, the operator's body, the
# dispatcher, the expert stage, the up projection, and the primitive that issues the GEMM. A seventh
# shardmoe frame on the way shows here first.
MAX_FRAMES_TO_FIRST_GEMM = 6


def _shardmoe_frames(frame) -> list[str]:
    """module.function of every shardmoe frame on the stack from `frame` down, outermost first."""
    names = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("shardmoe"):
            names.append(f"{module}.{frame.f_code.co_qualname}")
        frame = frame.f_back
    return names[::-1]


def _frames_to_first_expert_gemm(step) -> list[str]:
    """The shardmoe frames on the stack when `step` first enters an expert GEMM: torch.mm or
    torch.addmm (one GEMM per expert), grouped_mm, the side-by-side GEMM operators
    (torch.ops.shardmoe_gemm), or the launch of the forward GEMM kernel."""
    import sys

    import torch

    found = []

    def note(frame, event, arg):
        if event == "c_call" and arg in (torch.mm, torch.addmm):
            found.append(_shardmoe_frames(frame))
        elif event == "call":
            code, caller = frame.f_code, frame.f_back
            if code.co_name == "grouped_mm" and frame.f_globals.get("__name__") == "torch.nn.functional":
                found.append(_shardmoe_frames(caller))
            elif code.co_name == "__call__" and frame.f_globals.get("__name__") == "torch._ops":
                if str(getattr(frame.f_locals.get("self"), "_qualified_op_name", "")).startswith("shardmoe_gemm::"):
                    found.append(_shardmoe_frames(caller))
            elif code.co_name == "run" and frame.f_globals.get("__name__", "").startswith("triton.runtime"):
                kernel = getattr(frame.f_locals.get("self"), "fn", None)
                if getattr(kernel, "__name__", "") == "forward_gemm_kernel":
                    found.append(_shardmoe_frames(caller))
        if found:
            sys.setprofile(None)  # the rest of the step runs unprofiled (the interpreter's kernels are slow under it)

    sys.setprofile(note)
    try:
        step()
    finally:
        sys.setprofile(None)
    assert found, "no expert GEMM was entered"
    return found[0]


def _layer_and_input(dtype):
    import torch

    import shardmoe

    torch.manual_seed(0)
    layer = shardmoe.MoE(64, 128, 8, 2, dtype=dtype)
    return layer, torch.randn(256, 64, dtype=dtype, requires_grad=True)


@pytest.mark.parametrize("dtype,threads", [("float32", 2), ("bfloat16", 2), ("float32", 1), ("float64", 2)],
                         ids=["fp32", "bf16", "fp32-one-thread", "float64"])
def test_the_first_expert_gemm_is_six_frames_from_the_module_on_cpu(dtype, threads):
    """On CPU every GEMM form (side by side, one per expert, grouped_mm) is entered from
    experts.TorchOps.linear, six shardmoe frames below MoE.forward."""
    import torch

    layer, x = _layer_and_input(getattr(torch, dtype))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer(x).sum().backward()  # warm: the C++ library is loaded
        frames = _frames_to_first_expert_gemm(lambda: layer(x))
    finally:
        torch.set_num_threads(previous)
    assert frames[0] == "shardmoe.moe.layer.MoE.forward" and frames[-1] == "shardmoe.moe.experts.TorchOps.linear"
    assert len(frames) <= MAX_FRAMES_TO_FIRST_GEMM, frames


def test_the_first_expert_gemm_is_six_frames_from_the_module_on_the_kernel_path():
    """The kernel path (here in Triton's interpreter, forced for a CPU tensor): the forward GEMM
    kernel is launched six shardmoe frames below MoE.forward."""
    import torch

    from shardmoe import kernels, settings

    if not kernels.triton_importable():
        pytest.skip("triton cannot be imported")
    from shardmoe.kernels.tuning import interpreting

    if not interpreting():
        pytest.skip("compiled mode: the kernel path of a CPU tensor runs only in Triton's interpreter")
    layer, x = _layer_and_input(torch.float32)
    with settings.override(force_kernels=True):
        frames = _frames_to_first_expert_gemm(lambda: layer(x))
    assert frames[0] == "shardmoe.moe.layer.MoE.forward"
    assert frames[-1] == "shardmoe.kernels.forward_gemm.forward_gemm", frames
    assert len(frames) <= MAX_FRAMES_TO_FIRST_GEMM, frames
