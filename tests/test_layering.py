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
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, found, _ in imports(package):
        graph[name].add(found)
    return graph


def imports(package: Path = PACKAGE):
    """(module, the package's module it imports, the import's source line) for every import."""
    modules = _modules(package)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
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
                    yield name, found, " ".join(lines[max(0, node.lineno - 2) : node.end_lineno])


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
    graph = import_graph()
    settings = [m for m in graph if m == "dflash_ray.config" or m.startswith("dflash_ray.settings")]
    assert sorted(t for m in settings for t in graph[m] if t.startswith(owners)) == []


# The floors, lowest first: a module imports from its own floor and those below. Where one must
# reach up, the import says why beside it (`# up a floor: REASON`).
FLOORS = (
    (
        "storage and files",
        "dflash_ray dflash_ray.errors dflash_ray.storage dflash_ray.s3 dflash_ray.disk dflash_ray.arrow_files "
        "dflash_ray.hub_uri dflash_ray.gpus dflash_ray.progress dflash_ray.manifest dflash_ray.writer "
        "dflash_ray.model_fetch dflash_ray.tensor_ranges dflash_ray.registry dflash_ray.assets",
    ),
    ("settings", "dflash_ray.settings dflash_ray.config"),
    (
        "models, data and generation",
        "dflash_ray.data dflash_ray.drafter dflash_ray.target_model dflash_ray.tiny_models dflash_ray.plots "
        "dflash_ray.generation dflash_ray.cluster dflash_ray.chaos",
    ),
    ("training", "dflash_ray.train"),
    (
        "planning",
        "dflash_ray.simulate dflash_ray.simulate_generation dflash_ray.simulate_job dflash_ray.simulate_traffic "
        "dflash_ray.planning dflash_ray.layout_choice dflash_ray.preflight",
    ),
    ("stages", "dflash_ray.stages dflash_ray.cli"),
)
REASON = "# up a floor:"


def floor_of(module: str) -> int:
    """The floor of the longest name in FLOORS that is `module` or holds it; a module no floor names fails."""
    held = [
        (len(p), i)
        for i, (_, names) in enumerate(FLOORS)
        for p in names.split()
        if module == p or module.startswith(p + ".")
    ]
    assert held, f"{module} is on no floor: add it to FLOORS in tests/test_layering.py"
    return max(held)[1]


def climbs(package: Path = PACKAGE) -> list[str]:
    """`module -> target` of each import that runs up a floor without saying why."""
    return sorted(
        {
            f"{name} ({FLOORS[floor_of(name)][0]}) -> {found} ({FLOORS[floor_of(found)][0]})"
            for name, found, line in imports(package)
            if floor_of(found) > floor_of(name) and REASON not in line
        }
    )


def test_no_import_runs_up_a_floor_without_a_reason():
    assert climbs() == []


def test_a_climb_is_seen_and_a_reason_beside_it_lets_it_pass(tmp_path):
    package = tmp_path / "dflash_ray"
    (package / "train").mkdir(parents=True)
    (package / "drafter").mkdir()
    (package / "train" / "steps.py").write_text("X = 1\n")
    (package / "drafter" / "a.py").write_text("from dflash_ray.train.steps import X\n")
    (package / "drafter" / "b.py").write_text(f"from dflash_ray.train.steps import X  {REASON} a test\n")
    assert climbs(package) == [
        "dflash_ray.drafter.a (models, data and generation) -> dflash_ray.train.steps (training)"
    ]


MAX_MODULE_LINES = 500


def test_no_module_of_the_package_is_over_500_lines():
    long = sorted(
        f"{p.relative_to(PACKAGE.parent)}: {n}"
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert long == []


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
        "climbs_without_a_reason": climbs(package),
        "modules_over_500_lines": sorted(
            f"{p.relative_to(package.parent)}: {n}"
            for p in package.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
        ),
        "too_long": lengths,
    }
    print(json.dumps(report, indent=1))
