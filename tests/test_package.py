"""The package's shape: no import circles, no private names across modules, no mutable
module state but the step slot, and the old module names still work."""

import ast
import pathlib

import torch

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "src" / "blockdiag_cp"
#: module-level names allowed to hold a mutable object (Note [Why a process-wide slot];
#: Note [Sub-groups made once]: process groups live as long as the process)
MUTABLE_ALLOWED = {"slot": {"STEP_SLOT"}, "groups": {"SUBGROUPS"}}
#: calls whose result is immutable (or a logger) at module level
IMMUTABLE_CALLS = {"MappingProxyType", "frozenset", "tuple", "getLogger", "TypeVar", "getattr", "signature"}


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


def runtime_nodes(node):
    """Every node below `node`, except under ``if TYPE_CHECKING:`` (never imported at run time)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING":
            continue
        yield child
        yield from runtime_nodes(child)


def package_imports(module, tree, is_package):
    """Intra-package modules `module` imports at run time, at the top or inside functions."""
    return {resolve(module, is_package, node.level, node.module)
            for node in runtime_nodes(tree) if isinstance(node, ast.ImportFrom) and node.level}


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


def test_old_module_names_still_work():
    from blockdiag_cp.balance import BALANCE_TOLERANCE, plan_balanced
    from blockdiag_cp.bench import doc_lengths
    from blockdiag_cp.cli import build_parser
    from blockdiag_cp.docs import resolve_doc_ids
    from blockdiag_cp.sdpa import cp_blockdiag_sdpa
    from blockdiag_cp.state import current_step
    from blockdiag_cp.verify import doc_ids_from_lengths

    ids = doc_ids_from_lengths((3, -1, 2))
    assert ids.tolist() == [1, 1, 1, 0, 2, 2]
    assert resolve_doc_ids({"_packed_seq_ids": ids.unsqueeze(0)}, 6, "cpu", 1).tolist() == [[1, 1, 1, 0, 2, 2]]
    assert plan_balanced(ids, 2).positions_WL.shape == (2, 3) and 0 < BALANCE_TOLERANCE < 1
    assert sum(doc_lengths("uniform:3", 30)) == 30
    assert build_parser().parse_args(["verify"]).command == "verify"
    assert current_step() is None
    q = torch.randn(1, 2, 4, 8)
    assert torch.equal(cp_blockdiag_sdpa(q, q, q), torch.nn.functional.scaled_dot_product_attention(q, q, q))
