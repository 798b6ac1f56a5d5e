"""The house's layers: models, then core, then view, then tools; each imports only the layers below
it (or its own), and no import circle exists. Drawn from the source with `ast`, so a new import
that runs upward or closes a circle fails here, naming it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specviz"
LAYERS = ("models", "core", "view", "tools", "ui")  # bottom to top; the package root and app.py sit above all


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, file: Path, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported specviz module, at module level?) for every import in the file."""
    package = name if file.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(file.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            found += [(t, id(node) in top) for t in subs or [target] if t in modules and t != name]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top) for a in node.names if a.name in modules]
    return found


def _rank(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_every_module_lives_in_a_layer_and_each_layer_says_what_it_owns():
    modules = _modules()
    loose = [m for m in modules if m.count(".") == 1 and m.split(".")[1] not in (*LAYERS, "__main__")]
    assert not loose, f"modules outside the layers: {loose}"
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text(encoding="utf-8")))
        assert doc and len(doc.splitlines()) <= 2, f"specviz/{layer}/__init__.py: say what it owns in two lines"


def test_imports_only_run_downward():
    modules = _modules()
    upward = [(name, target) for name, file in modules.items() for target, _ in _imports(name, file, modules)
              if _rank(target) > _rank(name)]
    assert not upward, f"imports that run upward: {upward}"


def test_no_import_circle():
    modules = _modules()
    edges = {name: {t for t, _ in _imports(name, file, modules)}
             for name, file in modules.items()}
    seen, on_path = set(), []

    def visit(node):
        if node in on_path:
            raise AssertionError("import circle: " + " -> ".join(on_path[on_path.index(node):] + [node]))
        if node in seen:
            return
        seen.add(node)
        on_path.append(node)
        for nxt in sorted(edges.get(node, ())):
            visit(nxt)
        on_path.pop()

    for name in sorted(edges):
        visit(name)


def test_the_app_is_thin_and_its_handlers_take_few_parameters():
    """app.py lays out the page and wires it; the handlers (specviz/ui) read one Page, not 14 values."""
    app_file = PACKAGE.parent / "app.py"
    assert len(app_file.read_text(encoding="utf-8").splitlines()) <= 350
    for file in (app_file, *sorted((PACKAGE / "ui").glob("*.py"))):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                count = len(node.args.posonlyargs) + len(node.args.args) + len(node.args.kwonlyargs)
                assert count <= 6, f"{file.name}: {node.name} takes {count} parameters"
