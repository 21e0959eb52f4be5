"""The package's shape: no import circles (type-checking imports included), no private names
across modules, no mutable module state but the step slot, no re-export shims, a small root."""

import ast
import pathlib

import torch

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "src" / "blockdiag_cp"
#: module-level names allowed to hold a mutable object (Note [Why a process-wide slot];
#: Note [Sub-groups made once]: process groups live as long as the process)
MUTABLE_ALLOWED = {"step.slot": {"STEP_SLOT"}, "parallel.heads": {"SUBGROUPS"}}
#: calls whose result is immutable (or a logger) at module level (`Registry` is a frozen dataclass of tuples,
#: `StepCosts` one of numbers)
IMMUTABLE_CALLS = {"MappingProxyType", "frozenset", "tuple", "getLogger", "TypeVar", "getattr", "signature", "Registry", "StepCosts"}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        yield ".".join(parts), path, ast.parse(path.read_text()), path.name == "__init__.py"


def resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, *([target] if target else [])])


def package_imports(module, tree, is_package):
    """Intra-package modules `module` imports anywhere: at the top, inside functions, and under
    ``if TYPE_CHECKING:`` (a circle there is still two homes that lean on each other)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            target = resolve(module, is_package, node.level, node.module)
            # ``from . import hf`` (no module): each name may be a module of the package
            out.update([target] if node.module else [".".join(filter(None, [target, a.name])) for a in node.names])
    return out


#: what `plan/` (layouts, geometry, cost models) may import from the package: it is the layer the step, the
#: exchanges and head parallelism build on (issue #36), so it reaches none of them, nor `config` (issue #42: the
#: config reads `PlanOptions`; the planners take plain values)
PLAN_MAY_IMPORT = ("plan", "errors", "registry")


def test_plan_imports_nothing_above_it():
    offenders = sorted(f"{name} -> {target}" for name, _, tree, pkg in modules() if name.split(".")[0] == "plan"
                       for target in package_imports(name, tree, pkg)
                       if target and target.split(".")[0] not in PLAN_MAY_IMPORT)
    assert not offenders, offenders


def part_of(module: str) -> str:
    """The top-level part a module belongs to: its folder under the package, or the root module itself."""
    return module.split(".")[0] if module else "__init__"


def test_no_two_top_level_parts_import_each_other():
    """The folders are the architecture (issue #42): a value flows one way down, so no two top-level parts (a
    folder, or a root module) import each other, directly or around a circle, lazy and type-checking imports
    included."""
    graph = {}
    for name, _, tree, pkg in modules():
        here = part_of(name)
        graph.setdefault(here, set()).update(
            part_of(t) for t in package_imports(name, tree, pkg) if t and part_of(t) != here)
    state, circles = {}, []

    def visit(part, stack):
        if state.get(part) == "done":
            return
        if state.get(part) == "open":
            circles.append(" -> ".join([*stack[stack.index(part):], part]))
            return
        state[part] = "open"
        for target in sorted(graph.get(part, ())):
            visit(target, [*stack, part])
        state[part] = "done"

    for part in sorted(graph):
        visit(part, [])
    assert not circles, circles


#: the longest module the house keeps (issue #42)
MAX_MODULE_LINES = 450


def test_no_module_is_longer_than_the_house_keeps():
    long = {str(path.relative_to(PACKAGE)): n for _, path, _, _ in modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_import_circles():
    graph = {name: package_imports(name, tree, pkg) for name, _, tree, pkg in modules()}
    known = set(graph)

    def targets(name):
        return {t for t in graph[name] if t in known}

    state = {}

    def visit(name, stack):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import circle: " + " -> ".join([*stack, name])
        state[name] = "open"
        for t in targets(name):
            if t != name:
                visit(t, [*stack, name])
        state[name] = "done"

    for name in graph:
        visit(name, [])


def test_no_private_name_is_imported_across_modules():
    offenders = []
    for name, path, tree, _ in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("blockdiag_cp")):
                for alias in node.names:
                    if alias.name.startswith("_") and alias.name != "_cp_blockdiag_doc_ids":
                        offenders.append(f"{path.name}: {alias.name}")
    assert not offenders, offenders


def test_no_mutable_module_state_but_the_step_slot():
    offenders = []
    for name, path, tree, _ in modules():
        allowed = MUTABLE_ALLOWED.get(name, set())
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            value = node.value
            mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp))
            if isinstance(value, ast.Call):
                func = value.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                mutable = called not in IMMUTABLE_CALLS
            if mutable and not names <= allowed:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {sorted(names)}")
    assert not offenders, offenders


def test_no_bare_assert_in_the_library():
    offenders = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for _, path, tree, _ in modules()
                 for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not offenders, offenders


def is_shim(tree) -> bool:
    """A module whose body is only a docstring, imports and ``__all__``: a second home for names."""
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    rest = [n for n in body if n not in imports and not (
        isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["__all__"])]
    return bool(imports) and not rest


def test_no_module_only_re_exports_another():
    """Package faces (``__init__.py``) may gather their members' names; no other module may."""
    shims = [str(path.relative_to(PACKAGE)) for _, path, tree, is_package in modules()
             if not is_package and path.name != "__main__.py" and is_shim(tree)]
    assert not shims, shims


def test_the_root_holds_at_most_ten_modules_and_the_public_face():
    import blockdiag_cp

    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 10, root
    for name in blockdiag_cp.__all__:
        assert getattr(blockdiag_cp, name) is not None
    public = {"CPConfig", "ShardPlan", "StepState", "cp_blockdiag_sdpa", "current_step", "gather_sequence",
              "make_cp_batch_and_ctx", "make_cp_blockdiag_batch_and_ctx", "plan_shards", "resolve_doc_ids",
              "_cp_blockdiag_doc_ids"}
    assert public <= set(blockdiag_cp.__all__)
    q = torch.randn(1, 2, 4, 8)
    assert torch.equal(blockdiag_cp.cp_blockdiag_sdpa(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
