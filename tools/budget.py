"""What a copier reads, counted against the budgets of docs/style.md: `python -m tools.budget` (exit status 1 over one).

Python tokens: every token but comments, docstrings and layout (newlines, indents). Counted for each recipe:
- its own tokens (3,000 at most) and its header, the module docstring (20 lines at most);
- its default path: the shared/ modules it imports at module level, those they import at module level in turn, and
  shared/__init__.py (11,000 tokens at most, in 10 files at most);
and once, the opt-in modules: the shared/ modules that only a function imports, where only some runs or inputs need
them (4,000 tokens at most, together). `--files` also lists each file's tokens. What is still over its budget has a
ceiling (CEILINGS), the count when the budgets came: the exit status is 1 only over a ceiling, or over a budget
without one.
"""

from __future__ import annotations

import argparse
import ast
import io
import signal
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("*.py"))
BUDGETS = {"recipe": 3_000, "header": 20, "default path": 11_000, "default files": 10, "opt-in": 4_000}
# What is still over its budget (issue 76): a ceiling, so that nothing grows unseen while the cuts land. A change
# lowers it as its count falls; only a change that adds what an issue asks for raises it, by what it could not pay
# for elsewhere, or one that moves code from the default path into an opt-in module raises the opt-in ceiling by
# what it moved (and the new calls); either says so in its commit. A count within its ceiling but over its budget
# is printed, not failed; one over both fails. Remove a line once its count meets the budget.
CEILINGS = {"opt-in": 15_616}
LAYOUT = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
# Python 3.12 splits an f-string into its pieces; counted as one token, as Python 3.10 and 3.11 count it, the
# budgets mean the same on every Python.
FSTRING_START, FSTRING_END = getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1)


def tokens(path: Path) -> int:
    """Python tokens that are not comments, docstrings or layout."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add((body[0].lineno, body[0].col_offset))
    count, depth = 0, 0  # depth: inside an f-string (3.12)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        depth += (token.type == FSTRING_START) - (token.type == FSTRING_END)
        if token.type == FSTRING_START and depth == 1:
            count += 1
        elif not depth and token.type not in (*LAYOUT, FSTRING_END) and not (
                token.type == tokenize.STRING and token.start in docstrings):
            count += 1
    return count


def module_file(module: str) -> Path | None:
    """shared.x.y -> shared/x/y.py, or its package's __init__.py."""
    base = ROOT / module.replace(".", "/")
    return next((file for file in (base.with_suffix(".py"), base / "__init__.py") if file.exists()), None)


def shared_imports(path: Path) -> tuple[set[Path], set[Path]]:
    """The shared/ files `path` imports: (at module level, inside a function)."""
    found = ({ROOT / "shared" / "__init__.py"}, set())

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "shared":
                for alias in child.names:  # `from shared import tracking` names a module, `from shared.x import f` not
                    file = module_file(f"{child.module}.{alias.name}") or module_file(child.module)
                    found[in_function].add(file)
            elif isinstance(child, ast.Import):
                found[in_function].update(filter(None, (module_file(alias.name) for alias in child.names
                                                        if alias.name.split(".")[0] == "shared")))
            if not (isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING"):  # annotations only
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return found


def default_path(script: Path) -> set[Path]:
    """The shared/ files importing `script` loads: its module-level imports, transitively."""
    path, todo = set(), set(shared_imports(script)[0])
    while todo:
        file = todo.pop()
        if file not in path:
            path.add(file)
            todo |= shared_imports(file)[0]
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", action="store_true", help="also list each shared/ file's tokens")
    args = parser.parse_args()
    over, default_files = [], set()
    for recipe in RECIPES:
        script = ROOT / "recipes" / f"{recipe}.py"
        path = default_path(script)
        default_files |= path
        counts = {"recipe": tokens(script), "default path": sum(map(tokens, path)), "default files": len(path),
                  "header": len((ast.get_docstring(ast.parse(script.read_text()), clean=False) or "").splitlines())}
        print(f"{recipe}: {counts['recipe']:,} tokens; its default path {counts['default path']:,} tokens in "
              f"{counts['default files']} files of shared/; a {counts['header']}-line header")
        over += [(f"{recipe}: {key}", value, BUDGETS[key]) for key, value in counts.items()]
    opt_in = sorted(set((ROOT / "shared").rglob("*.py")) - default_files)
    total = sum(map(tokens, opt_in))
    print(f"opt-in modules: {total:,} tokens in {len(opt_in)} files ({', '.join(f.stem for f in opt_in) or 'none'})")
    over.append(("opt-in", total, BUDGETS["opt-in"]))
    if args.files:
        for file in sorted((ROOT / "shared").rglob("*.py")):
            where = "default path" if file in default_files else "opt-in"
            print(f"  {file.relative_to(ROOT)}: {tokens(file):,} tokens ({where})")
    sys.exit(report(over))


def report(counts: list[tuple[str, int, int]], ceilings: dict[str, int] = CEILINGS) -> int:
    """Each (name, count, budget) over its budget, in a line; 1 if any is also over its ceiling (or has none)."""
    failed = False
    for name, count, budget in counts:
        ceiling = ceilings.get(name, budget)
        if count > max(budget, ceiling):
            failed = True
            print(f"over budget: {name} {count:,} > {budget:,}" + (
                f", and over its ceiling {ceiling:,}: cut what this change added" if ceiling > budget else ""))
        elif count > budget:
            print(f"over budget: {name} {count:,} > {budget:,} (within its ceiling {ceiling:,}; lower the ceiling "
                  "in tools/budget.py as the count falls)")
    if not any(count > budget for _, count, budget in counts):
        print("every budget met")
    return int(failed)


if __name__ == "__main__":
    # `python -m tools.budget | head`: a reader that ends first ends this quietly, as it ends a Unix tool, not in a
    # BrokenPipeError traceback at the exit's flush
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    main()
