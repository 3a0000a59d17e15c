"""The layout budgets of docs/style.md, counted: `python -m tools.budget`.

For each recipe: the names it imports from shared/, the lines of shared/ in its import path (the modules it
imports and the ones those import in turn, plus shared/__init__.py) and its own length; then every shared/ file
over 250 lines. Budgets (../shared/STYLE.md): 12 names, 1,100 lines, about 330 lines, 250 lines a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("cifar_cnn", "resnet18_fmnist", "deep_mlp_ckpt")


def shared_imports(path: Path) -> tuple[list[str], set[Path]]:
    """The names `path` imports from shared/, and the shared/ files those come from."""
    names, files = [], set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shared":
            for alias in node.names:
                names.append(alias.name)
                module = ROOT / f"{node.module}.{alias.name}".replace(".", "/")  # `from shared import tracking`
                files.add(module.with_suffix(".py") if module.with_suffix(".py").exists()
                          else (ROOT / node.module.replace(".", "/")).with_suffix(".py"))
    return names, files


def main() -> None:
    for recipe in RECIPES:
        script = ROOT / "recipes" / f"{recipe}.py"
        names, todo = shared_imports(script)
        path = {ROOT / "shared" / "__init__.py"}
        while todo:
            file = todo.pop()
            if file.name != "__init__.py" and file not in path:
                path.add(file)
                todo |= shared_imports(file)[1]
        lines = sum(len(file.read_text().splitlines()) for file in path)
        print(f"{recipe}: {len(names)} names from shared/; {lines} lines of shared/ in its import path "
              f"({len(path)} files); {len(script.read_text().splitlines())} lines")
    for file in sorted((ROOT / "shared").glob("*.py")):
        if (length := len(file.read_text().splitlines())) > 250:
            print(f"over 250 lines: {file.relative_to(ROOT)} ({length})")


if __name__ == "__main__":
    main()
