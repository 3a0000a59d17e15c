"""The layout budgets of docs/style.md, counted: `python -m tools.budget` (exit status 1 when one is exceeded).

Code lines as cloc counts them: no blank lines, no comments, no docstrings. For each recipe: the names it imports
from shared/ (12 at most), the code lines of shared/ in its import path (the modules it imports, those they import in
turn, and shared/__init__.py: 1,561 at most), its own code lines (280 at most) and its header, the module docstring
(20 lines at most); then every shared/ file over 250 code lines.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.py"))
BUDGETS = {"names": 12, "shared": 1561, "recipe": 280, "header": 20, "file": 250}


def code_lines(path: Path) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def shared_imports(path: Path) -> tuple[list[str], set[Path]]:
    """The names `path` imports from shared/, and the shared/ files those come from."""
    names, files = [], set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "shared":
            for alias in node.names:
                names.append(alias.name)
                module = ROOT / f"{node.module}.{alias.name}".replace(".", "/")  # `from shared import tracking`
                parent = ROOT / node.module.replace(".", "/")
                files.add(next(file for file in (module.with_suffix(".py"), module / "__init__.py",
                                                 parent.with_suffix(".py"), parent / "__init__.py") if file.exists()))
    return names, files


def main() -> None:
    over = []
    for recipe in RECIPES:
        script = ROOT / "recipes" / f"{recipe}.py"
        names, todo = shared_imports(script)
        path = {ROOT / "shared" / "__init__.py"}
        while todo:
            file = todo.pop()
            if file not in path:
                path.add(file)
                todo |= shared_imports(file)[1]
        counts = {"names": len(names), "shared": sum(code_lines(file) for file in path),
                  "recipe": code_lines(script), "header": len((ast.get_docstring(ast.parse(script.read_text()),
                                                                                 clean=False) or "").splitlines())}
        print(f"{recipe}: {counts['names']} names from shared/; {counts['shared']} code lines of shared/ in its "
              f"import path ({len(path)} files); {counts['recipe']} code lines; a {counts['header']}-line header")
        over += [f"{recipe}: {key} {value} > {BUDGETS[key]}" for key, value in counts.items() if value > BUDGETS[key]]
    for file in sorted((ROOT / "shared").rglob("*.py")):
        if (length := code_lines(file)) > BUDGETS["file"]:
            over.append(f"{file.relative_to(ROOT)}: {length} code lines > {BUDGETS['file']}")
    print("\n".join(f"over budget: {line}" for line in over) or "every budget met")
    sys.exit(1 if over else 0)


if __name__ == "__main__":
    main()
