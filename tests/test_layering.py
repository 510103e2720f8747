"""The house rules that keep shardserve readable (docs/structure.md, "Rooms"): no module imports
another that (directly or not) imports it back, every kernel lives under shardserve/kernels/, and
the kernels room holds no nn.Module. The rule that rooms import downwards only is import-linter's
layers contract in pyproject.toml, run by `make test` (`lint-imports`)."""
from __future__ import annotations

import ast
import pathlib

import grimp

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "shardserve"


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(sorted(imports[root])))]
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
                    work.append((child, iter(sorted(imports[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    """Imports inside functions count too (a lazy import is still a dependency); imports only for type
    annotations (`if TYPE_CHECKING:`) do not."""
    graph = grimp.build_graph("shardserve", cache_dir=None, exclude_type_checking_imports=True)
    imports = {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}
    assert _circles(imports) == []


def test_every_kernel_lives_under_kernels():
    outside = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*")
               if "kernels" not in p.relative_to(PACKAGE).parts
               and (p.suffix in (".c", ".cu", ".cpp", ".h") or (p.suffix == ".py" and "triton.jit" in p.read_text()))]
    assert outside == []


def test_the_kernels_room_holds_no_module():
    for path in (PACKAGE / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert not bases & {"nn.Module", "torch.nn.Module", "Module"}, f"{path}: {node.name}"
