"""The package's layers (docs/architecture.md, "Layers of the package"): every import, at module level
or inside a function, goes to a layer at or below the importer's, and no two parts of the package
import each other (no circle), read from the source with ast."""
import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardmoe"

# bottom to top: a part may import the parts of its own layer and of the layers below it
LAYERS = [
    ("rows", "expert_kinds", "notation", "settings", "testing"),
    ("kernels",),
    ("mesh", "shardops"),
    ("moe",),
    ("parallel",),
    ("shardmoe",),  # the package's own __init__: MoE, Mesh, and parallel's registration
    ("model",),
    ("check", "arguments"),
    ("tasks", "hf", "torchtitan"),
    ("train", "simulate"),
    ("tools", "gpu_check"),  # the measurement tools; gpu_check: their old command name, forwarding
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


def _imports() -> dict[tuple[str, str], list[str]]:
    """(importing part, imported part) -> the 'module -> module' imports between them."""
    edges = defaultdict(list)
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
            for target in targets:
                if target.split(".")[0] == "shardmoe" and _part(target) != _part(module):
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


# the modules one warm CPU forward + backward of the default layer runs code in: the walk of x in
# docs/architecture.md, which a reader follows; a new stop on it shows here first
WALK = {"layer", "ops", "function", "config", "routing", "backends", "dispatch", "experts", "cpu", "combine",
        "precision"}
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
    assert entered == {f"shardmoe.moe.{m}" for m in WALK} | LEAVES and len(entered) <= 13, sorted(entered)
