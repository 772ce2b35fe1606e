"""The package layout docs/architecture.md states holds in the source: no package imports one above
it, no module imports itself back through others, `cdi/` stands alone, every package is listed, and
only `agent/app` imports the simulated machine (`agent/sim`).

The graph is read from the source with `ast`, every import counted (also those inside functions and
under TYPE_CHECKING: a circle through a lazy import is still a circle a reader has to untangle)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOT_FLOOR = "(root)"


def documented_order() -> list[str]:
    """The package names of docs/architecture.md's "Packages" table, top to bottom."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Packages", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `agent/([a-z_]*)/?` ", section, flags=re.M)
    return [n or ROOT_FLOOR for n in names]


def modules(top: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / top).rglob("*.py"):
        rel = path.relative_to(ROOT)
        if "pb" in rel.parts[:2]:  # generated from proto/
            continue
        name = ".".join(rel.with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from pkg import mod` imports the module; the package only for names that are not modules.
            subs = [f"{node.module}.{a.name}" for a in node.names]
            candidates = [s for s in subs if s in known]
            if len(candidates) < len(subs):
                candidates.append(node.module)
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        yield from (c for c in candidates if c in known)


def graph() -> dict[str, set[str]]:
    known = modules("agent") | modules("cdi")
    return {name: set(imports(path, known)) - {name} for name, path in known.items()}


def floor(module: str, order: list[str]) -> str:
    """The module's package in the order; a module of the shared root (or of a root sub-package such as
    `agent/apirules/`) is on the root floor."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in order else ROOT_FLOOR


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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


def test_the_documented_order_names_every_package_once() -> None:
    order = documented_order()
    assert order[-1] == ROOT_FLOOR and len(order) == len(set(order)), order
    packages = {p.parent.name for p in (ROOT / "agent").glob("*/__init__.py")} - {"pb"}
    text = (ROOT / "docs" / "architecture.md").read_text()
    root_row = next(line for line in text.splitlines() if line.startswith("| `agent/` (root)"))
    in_root = set(re.findall(r"`agent/([a-z_]+)/`", root_row))
    assert packages == (set(order) - {ROOT_FLOOR}) | in_root, "docs/architecture.md's Packages table and agent/ differ"


def test_no_package_imports_one_above_it() -> None:
    order = documented_order()
    upward = []
    for module, targets in graph().items():
        if not module.startswith("agent.") or module == "agent.__main__":  # the entry point calls the CLI
            continue
        for target in targets:
            if not target.startswith("agent"):
                continue
            mine, theirs = order.index(floor(module, order)), order.index(floor(target, order))
            if theirs < mine:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward:\n" + "\n".join(sorted(upward))


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_cdi_stands_alone() -> None:
    leaks = [f"{m} -> {t}" for m, ts in graph().items() if m.startswith("cdi") for t in ts if t.startswith("agent")]
    assert not leaks, leaks


def sim_imports(module: str, source: str) -> list[str]:
    """The modules of `agent.sim` that `module`'s source imports, in any form: `import agent.sim...`,
    `from agent.sim... import`, `from agent import sim`, and relative imports resolved against the
    module's package; also inside functions and under TYPE_CHECKING."""
    package = module.split(".")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # `from .x import y` in agent/a/b.py is agent.a.x (`package` ends in the module's own name,
                # which a package's __init__ does not have: its module name is the package's).
                parent = package[:len(package) - node.level]
                base = ".".join(parent + ([base] if base else []))
            # `from agent.sim.x import y` imports agent.sim.x; `from agent import sim` imports agent.sim.
            names = [base] if _in_sim(base) else [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if _in_sim(n)]
    return sorted(set(found))


def _in_sim(name: str) -> bool:
    return name == "agent.sim" or name.startswith("agent.sim.")


def test_only_the_app_imports_the_simulator() -> None:
    """Discovery, health and host changes meet NVML and VF settings through the seams they declare
    (`agent.inventory.nvmlapi`, `agent.host.vfio.sriov.VfLinks`); `agent.app.assembly` chooses the real
    or the simulated implementation and hands it in."""
    found = []
    for name, path in modules("agent").items():
        if name.startswith(("agent.app.", "agent.sim.")) or name in ("agent.sim", "agent.app"):
            continue
        # An __init__ module is its package: its relative imports resolve from the package itself.
        module = f"{name}.__init__" if path.name == "__init__.py" else name
        found += [f"{name} -> {target}" for target in sim_imports(module, path.read_text())]
    assert not found, "imports of the simulator outside agent/app:\n" + "\n".join(found)


def test_the_checks_find_what_they_guard() -> None:
    """Positive controls: a circle and an upward import made up here are found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    order = documented_order()
    assert order.index(floor("agent.inventory.gpus", order)) > order.index(floor("agent.app.cli", order))
    assert floor("agent.config", order) == ROOT_FLOOR and floor("agent.claims", order) == "claims"
    source = ("import agent.sim.nvml\nfrom agent import sim\ndef f():\n    from ..sim.vflinks import SimVfLinks\n"
              "    from .. import sim\n    from agent.simple import x\n")
    assert sim_imports("agent.hostprep.vfio", source) == ["agent.sim", "agent.sim.nvml", "agent.sim.vflinks"]
    assert sim_imports("agent.inventory.__init__", "from ..sim import control\n") == ["agent.sim"]
