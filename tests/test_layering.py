"""The package's floors hold: its import graph (module-top and function-level imports alike; those
under `if TYPE_CHECKING:` run nothing and are left out) has no circle, no stage imports another
stage (the demo, which is the pipeline on its defaults, may call the pipeline), and the config
imports none of the code whose settings it holds."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dflash_ray"
ALLOWED_STAGE_IMPORTS = {("dflash_ray.stages.demo", "dflash_ray.stages.pipeline")}


def _modules(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name inside a module counts as the module)."""
    modules = _modules(package)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
            for statement in node.body
            for inner in ast.walk(statement)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("dflash_ray") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in list(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_package_has_no_import_circle():
    assert circles(import_graph()) == []


def test_the_finder_sees_a_circle_where_there_is_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_stage_imports_another_stage():
    graph = import_graph()
    stage = "dflash_ray.stages."
    crossing = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        if a.startswith(stage) and b.startswith(stage) and (a, b) not in ALLOWED_STAGE_IMPORTS
    )
    assert crossing == []


def test_the_config_imports_none_of_the_code_whose_settings_it_holds():
    owners = ("dflash_ray.drafter", "dflash_ray.train", "dflash_ray.generation", "dflash_ray.chaos")
    assert sorted(m for m in import_graph()["dflash_ray.config"] if m.startswith(owners)) == []


MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 300


def too_long(root: Path = PACKAGE) -> list[str]:
    """`file:name:lines` of each function over MAX_FUNCTION_LINES and each class over
    MAX_CLASS_LINES, counted from the `def` or `class` line to the last (decorators left out): past
    those, a reader no longer sees what one thing does on a screen or two."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{path.relative_to(root.parent)}:{node.name}:{lines}")
    return found


def test_no_function_or_class_is_too_long():
    assert too_long() == []


def test_the_length_check_names_what_is_too_long(tmp_path):
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(f"def f():\n{body}\n\ndef g():\n    pass\n")
    assert too_long(tmp_path / "pkg") == [f"pkg/long.py:f:{MAX_FUNCTION_LINES + 1}"]


def function_level_imports(package: Path = PACKAGE) -> int:
    """Imports of the package's own modules made inside a function (a lazy import, or a circle's way out)."""
    count = 0
    for path in package.rglob("*.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count += sum(
                    isinstance(n, ast.ImportFrom) and (n.module or "").startswith("dflash_ray") for n in ast.walk(fn)
                )
    return count


if __name__ == "__main__":  # the house measured: python tests/test_layering.py [PACKAGE_DIR]
    import json
    import sys

    package = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PACKAGE
    graph = import_graph(package)
    stage = "dflash_ray.stages."
    owners = ("dflash_ray.drafter", "dflash_ray.train", "dflash_ray.generation", "dflash_ray.chaos")
    lengths = sorted(too_long(package), key=lambda x: -int(x.rsplit(":", 1)[1]))
    report = {
        "modules": len(_modules(package)),
        "arrows": sum(len(v) for v in graph.values()),
        "circles": circles(graph),
        "stage_to_stage": sorted(
            f"{a} -> {b}"
            for a, bs in graph.items()
            for b in bs
            if a.startswith(stage) and b.startswith(stage) and (a, b) not in ALLOWED_STAGE_IMPORTS
        ),
        "config_imports_owners": sorted(m for m in graph.get("dflash_ray.config", ()) if m.startswith(owners)),
        "function_level_imports": function_level_imports(package),
        "too_long": lengths,
    }
    print(json.dumps(report, indent=1))
