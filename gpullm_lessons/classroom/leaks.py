"""Does a lesson show the answer to its exercise? Token overlap between solution regions and what a lesson shows.

For an instructor: every ``### BEGIN SOLUTION`` region of ``solutions/NN_topic.ipynb`` is compared with everything
the paired lesson ``notebooks/NN_topic.ipynb`` shows, and with the exercise's own text:

- the lesson's code cells, and the code blocks and inline code of its markdown cells;
- the source of every object the lesson prints with ``inspect.getsource(...)`` (resolved through the lesson's
  imports, the way the kernel would);
- the sections of every HIP source file the lesson reads (``hip.source_path("name")``, ``hip.kernel_dir() /
  "file"``) that it can print: a file is cut into its top-level paragraphs (a comment and the function under it),
  and a paragraph counts as shown when one of the lesson's string literals (``"v2"``, ``"// v2: tiled"``) or one
  of the lesson's names occurs in it;
- the exercise's markdown and the code outside its solution regions (the ``# TODO`` lines included).

Lines of a region that the exercise itself gives as its contract (a signature in a markdown code block) are not
the answer: they are left out of the region before it is compared with the lesson, and the share of the region
they make up is a score of its own (an exercise whose text spells out most of the region shows the answer).

Tokens: identifiers, numbers and punctuation, comments dropped (``#`` and ``//`` to the end of a line, ``/* */``),
so spacing, comments and line breaks do not matter; C++ inside Python strings is tokenised like the rest.
The score of a region is the fraction of its 6-token windows found anywhere in what the lesson shows
(containment, 0..1). A copied answer scores near 1 whatever its layout; an exercise that is a real variant
shares only the boilerplate every kernel has (``cuda.grid(1)``, a ``range(start, n, stride)`` loop, a launch):
see ``LEAK_THRESHOLD`` for the number and why.

CLI: ``python -m gpullm_lessons.classroom.leaks [--solutions DIR] [--notebooks DIR]`` prints one line per region, worst first.
"""
from __future__ import annotations

import argparse
import ast
import keyword
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

import nbformat

from .exercises import BEGIN_RE, END_RE, strip_solution_regions

# Measured with this scan (2026-12-01): the exercises of the course before its lessons were rewritten, which
# transcribed what their lessons printed (03.1 = softmax_backward_v2, 02.2 = matmul_v2, 04.1 = layernorm v1/v2,
# 08.2 = _layernorm_out, 10.1 = ring_allreduce_chunks, 01.3 = the printed layernorm_backward ...), scored 0.54-1.00
# (16 regions); the current regions, each a step past what its lesson shows, score 0.46 at most (most under 0.4),
# the overlap being the boilerplate every kernel shares (cuda.grid, a grid-stride range, a launch, a guarded store).
# 0.5 separates the two groups; a region over it shares more than half its 6-token phrases with the lesson.
LEAK_THRESHOLD = 0.5
NGRAM = 6
MIN_TOKENS = 12  # shorter regions (a launch line, a return) are compared as a whole token sequence

_TOKEN_RE = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|\d+(?:\.\d*)?(?:[eE][-+]?\d+)?[fF]?|\.\d+[fF]?|[^\sA-Za-z_0-9]")
_BLOCK_COMMENT_RE = re.compile(r"/\*.*?\*/", re.S)
_LINE_COMMENT_RE = re.compile(r"(?://|#(?!include|define|pragma|if|endif|else|elif|undef)).*$", re.M)
_MD_CODE_RE = re.compile(r"```[^\n]*\n(.*?)```|`([^`\n]+)`", re.S)


_KEEP = set(keyword.kwlist) | {
    # names whose choice is not the learner's: the APIs, types and builtins a kernel is written with
    "cuda", "numba", "np", "math", "cp", "float32", "float64", "int32", "int64", "uint16", "uint32", "range", "min",
    "max", "abs", "len", "sum", "float", "int", "__global__", "__device__", "__shared__", "__syncthreads", "extern",
    "const", "void", "unsigned", "long", "short", "char", "bool", "for", "if", "else", "while", "return", "auto",
    "__restrict__", "threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize", "include",
    "float4", "float2", "__float_as_uint", "__uint_as_float", "sqrtf", "expf", "tanhf", "fmaxf", "atomicAdd"}


def tokens(text: str, normalise: bool = True) -> list[str]:
    """Comments dropped, then identifiers, numbers and single punctuation characters. normalise: every name the
    writer chose (a variable, a function, a parameter) becomes "_", so renaming variables does not hide a copy;
    attribute names (after ".") and the names of the language and its APIs are kept."""
    text = _BLOCK_COMMENT_RE.sub(" ", text)
    text = _LINE_COMMENT_RE.sub(" ", text)
    toks = _TOKEN_RE.findall(text)
    if normalise:
        toks = ["_" if (t[0].isalpha() or t[0] == "_") and t not in _KEEP and (i == 0 or toks[i - 1] != ".") else t
                for i, t in enumerate(toks)]
    return toks


def _ngrams(toks: list[str], n: int = NGRAM) -> set[tuple]:
    return {tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)}


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def similarity(region: str, shown_texts) -> float:
    """Fraction of the region's NGRAM-token windows found in any of ``shown_texts`` (1.0: all of it is shown).

    A region of fewer than MIN_TOKENS tokens scores 1.0 when its whole token sequence appears in one text, else 0.
    """
    r = tokens(region)
    if not r:
        return 0.0
    texts = [tokens(t) for t in shown_texts]
    if len(r) < MIN_TOKENS:
        return 1.0 if any(_contains(t, r) for t in texts) else 0.0
    grams = _ngrams(r)
    shown = set().union(*(_ngrams(t) for t in texts)) if texts else set()
    return len(grams & shown) / len(grams)


# --------------------------------------------------------------------------------------------------
# What a notebook holds and shows
# --------------------------------------------------------------------------------------------------
def solution_regions(nb) -> list[tuple[int, str]]:
    """(cell index, region text without the markers and without its leading # TODO line) for every region."""
    out = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.split("\n")
        i = 0
        while i < len(lines):
            if BEGIN_RE.match(lines[i]):
                j = i + 1
                while j < len(lines) and not END_RE.match(lines[j]):
                    j += 1
                body = lines[i + 1:j]
                if body and re.match(r"^\s*#\s*TODO\b", body[0]):
                    body = body[1:]
                out.append((index, "\n".join(body)))
                i = j
            i += 1
    return out


def _imports(trees) -> dict[str, str]:
    """name -> dotted module or module.attribute path, from the notebook's import statements."""
    names = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    return names


def _resolve(expr: ast.AST, names: dict):
    """The object a dotted expression names, importing as the lesson does; None when it cannot be resolved
    (the lesson defined it in a cell: its source is then a code cell already)."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    path = names[expr.id].split(".")
    obj = None
    for k in range(len(path), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(path[:k]))
        except Exception:
            continue
        for attr in path[k:]:
            obj = getattr(obj, attr, None)
        break
    for attr in reversed(parts):
        obj = getattr(obj, attr, None) if obj is not None else None
    return obj


def _constant(node):
    """The value of a literal argument (a start= or stop= string); None for anything else."""
    return node.value if isinstance(node, ast.Constant) else None


def _code_trees(nb):
    for cell in nb.cells:
        if cell.cell_type == "code":
            src = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in cell.source.split("\n"))
            try:
                yield ast.parse(src)
            except SyntaxError:
                continue


def _paragraphs(text: str) -> list[str]:
    """A C++ file cut at blank lines outside braces: each top-level comment with the code under it."""
    out, cur, depth = [], [], 0
    for line in text.split("\n"):
        if not line.strip() and depth == 0:
            if cur:
                out.append("\n".join(cur))
            cur = []
            continue
        cur.append(line)
        code = re.sub(r"//.*$", "", line)
        depth = max(0, depth + code.count("{") - code.count("}"))
    if cur:
        out.append("\n".join(cur))
    return out


def _lesson_literals_and_names(trees) -> tuple[set, set]:
    literals, names = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value.strip()) >= 2:
                literals.add(node.value.strip())
            elif isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
    return literals, names


def shown_sources(nb) -> list[tuple[str, str]]:
    """(what, text) for everything a lesson notebook shows (see the module docstring)."""
    from ..runtime import hip
    from ..viz import show

    shown = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            shown.append((f"code cell {index}", cell.source))
        elif cell.cell_type == "markdown":
            for m in _MD_CODE_RE.finditer(cell.source):
                shown.append((f"markdown cell {index}", m.group(1) or m.group(2)))
    trees = list(_code_trees(nb))
    names = _imports(trees)
    files = set()
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "getsource" and node.args:
                obj = _resolve(node.args[0], names)
                if obj is not None:
                    try:
                        shown.append((f"inspect.getsource({ast.unparse(node.args[0])})", inspect.getsource(obj)))
                    except (TypeError, OSError):
                        pass
            elif name == "source" and node.args and _resolve(func, names) is show.source:
                # show.source(obj or "hip name", start=..., stop=...): the excerpt it prints (all of it: max_lines
                # only shortens what a learner sees at once)
                args = [_constant(a) for a in node.args[1:3]]
                kw = {k.arg: _constant(k.value) for k in node.keywords if k.arg in ("start", "stop")}
                arg = node.args[0]
                obj = arg.value if isinstance(arg, ast.Constant) else _resolve(arg, names)
                if obj is not None:
                    try:
                        _, _, lines = show.excerpt(obj, *args, **kw)
                        what = ", ".join(ast.unparse(a) for a in (*node.args, *node.keywords))
                        shown.append((f"show.source({what})", "\n".join(lines)))
                    except (TypeError, OSError, ValueError):
                        pass
            elif name == "source_path" and node.args and isinstance(node.args[0], ast.Constant):
                files.add(hip.source_path(str(node.args[0].value)))
        for node in ast.walk(tree):  # hip.kernel_dir() / "portable.h"
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and isinstance(node.left, ast.Call) and getattr(node.left.func, "attr", "") == "kernel_dir":
                files.add(hip.kernel_dir() / str(node.right.value))
    literals, used = _lesson_literals_and_names(trees)
    for path in sorted(files):
        if not path.is_file():
            continue
        for k, para in enumerate(_paragraphs(path.read_text(encoding="utf-8"))):
            defined = set(re.findall(r"\b(?:void|float|int|T)\s+([A-Za-z_]\w*)\s*\(", para))
            if any(lit in para for lit in literals) or defined & used:
                shown.append((f"{path.name} section {k}", para))
    return shown


def contract_texts(nb) -> list[str]:
    """The code an exercise's markdown gives (code blocks and inline code): its contract."""
    return [m.group(1) or m.group(2) for cell in nb.cells if cell.cell_type == "markdown"
            for m in _MD_CODE_RE.finditer(cell.source)]


def split_given(region: str, contract: list[str]) -> tuple[str, float]:
    """(the region without the lines the contract gives, the share of the region's tokens on those lines).
    A line is given when its tokens (at least 3) occur in a row in one contract text."""
    given_tokens = [tokens(t) for t in contract]
    kept, given, total = [], 0, 0
    for line in region.split("\n"):
        t = tokens(line)
        total += len(t)
        if len(t) >= 3 and any(_contains(c, t) for c in given_tokens):
            given += len(t)
        else:
            kept.append(line)
    return "\n".join(kept), (given / total if total else 0.0)


def exercise_texts(nb) -> list[tuple[str, str]]:
    """(what, text) for the exercise's own text: markdown cells and code outside the solution regions."""
    out = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            out.append((f"exercise markdown cell {index}", cell.source))
        elif cell.cell_type == "code":
            out.append((f"exercise code cell {index}", strip_solution_regions(cell.source)))
    return out


@dataclasses.dataclass
class Leak:
    solution: str  # notebook file name
    cell: int  # cell index of the region in the solution notebook
    score: float  # similarity to what the lesson and the exercise show (0..1)
    where: str  # the single shown text that overlaps most
    where_score: float

    def __str__(self):
        return (f"{self.solution} cell {self.cell}: {self.score:.2f} of the region is shown "
                f"(most in {self.where}: {self.where_score:.2f})")


def scan(solutions="solutions", notebooks="notebooks") -> list[Leak]:
    """One entry per solution region of every solution notebook, worst (highest score) first."""
    solutions, notebooks = Path(solutions), Path(notebooks)
    rows = []
    for sol in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(str(sol), as_version=4)
        shown = exercise_texts(nb)
        lesson = notebooks / sol.name
        if lesson.exists():
            shown += shown_sources(nbformat.read(str(lesson), as_version=4))
        contract = contract_texts(nb)
        texts = [t for _, t in shown]
        for cell, region in solution_regions(nb):
            rest, given = split_given(region, contract)
            per = [(similarity(rest, [t]), what) for what, t in shown] + [(given, "the exercise's contract")]
            best = max(per, default=(0.0, "nothing"))
            rows.append(Leak(sol.name, cell, max(similarity(rest, texts), given), best[1], best[0]))
    return sorted(rows, key=lambda r: -r.score)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpullm_lessons.classroom.leaks",
                                     description="How much of each solution region its lesson or exercise shows.")
    parser.add_argument("--solutions", default="solutions")
    parser.add_argument("--notebooks", default="notebooks")
    args = parser.parse_args(argv)
    if not any(Path(args.solutions).glob("*.ipynb")):
        print(f"error: no solution notebooks (*.ipynb) in {Path(args.solutions).resolve()}: leaks compares the "
              "instructor's solutions/ with the lessons; run it in the course's folder (a checkout) or name them "
              "with --solutions DIR --notebooks DIR", file=sys.stderr)
        return 2
    rows = scan(args.solutions, args.notebooks)
    for row in rows:
        flag = "LEAK " if row.score > LEAK_THRESHOLD else "     "
        print(flag + str(row))
    return 1 if any(r.score > LEAK_THRESHOLD for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
