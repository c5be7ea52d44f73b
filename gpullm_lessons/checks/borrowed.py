"""Borrowed answers: a graded function that is, aliases, wraps or calls the course's own implementation of its task.

The library holds an implementation of many tasks (lesson 11's kernels, lesson 12's quantiser and bucket
assignment ...). An answer such as ``flash_dq_kernel = flash.flash_attention_backward_v1_dq``, or a function whose
body calls ``quant.quantize_blockwise``, computes the right numbers without the learner having written them. A
checker that names its task's implementations (``own``: "module:attribute" strings) asks ``borrowed_verdict`` first;
a hit is a *wrong* verdict that names what was borrowed (in a graded call: one with a task label).

How it looks (no code runs): the function itself and its faces (a Numba kernel's Python function, a
``functools.wraps`` chain, a ``functools.partial``), then the names its code uses (its globals, the attributes it
reads off a module, its closure and defaults, nested functions), following the learner's own helpers and kernels a
few calls deep. Other course helpers stay allowed (11.3 launches the course's delta and dK/dV kernels around its own
dQ kernel). What it cannot see: a name built at run time (``getattr(module, "quantize_" + "blockwise")``), an
implementation copied by value into the notebook, code run through ``exec``. The exercises say so.
"""

from __future__ import annotations

import dis
import functools
import importlib
import inspect
import re
import types
from typing import Iterable, Optional

DEPTH = 4  # calls followed from the graded function into the learner's helpers and kernels


def _resolve(spec: str):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _faces(obj) -> list:
    """obj and what stands for it: a Numba dispatcher's (or the simulator's) Python function, a wraps chain."""
    out, todo = [], [obj]
    while todo:
        o = todo.pop()
        if o is None or any(o is x for x in out):
            continue
        out.append(o)
        for attr in ("py_func", "fn", "__wrapped__", "func"):  # numba, the simulator, functools.wraps, partial
            inner = getattr(o, attr, None)
            if inner is not None and callable(inner):
                todo.append(inner)
    return out


def _targets(own: Iterable[str]) -> dict:
    """{id: "module.attr"} of every face of each implementation, and of their code objects."""
    targets = {}
    for spec in own:
        label = spec.replace(":", ".")
        for face in _faces(_resolve(spec)):
            targets[id(face)] = label
            code = getattr(face, "__code__", None)
            if code is not None:
                targets[id(code)] = label
    return targets


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _walk(obj, targets: dict, depth: int, seen: set) -> Optional[str]:
    for face in _faces(obj):
        hit = targets.get(id(face)) or targets.get(id(getattr(face, "__code__", None)))
        if hit:
            return hit
    if depth < 0 or id(obj) in seen or _course_code(obj):
        return None  # the course's other helpers are the learner's to use: not followed into
    seen.add(id(obj))
    if isinstance(obj, functools.partial):
        for arg in (*obj.args, *obj.keywords.values()):
            hit = _walk(arg, targets, depth - 1, seen)
            if hit:
                return hit
    for face in _faces(obj):
        if not isinstance(face, types.FunctionType):
            continue
        values = list(face.__defaults__ or ()) + list((face.__kwdefaults__ or {}).values())
        values += [c.cell_contents for c in face.__closure__ or () if _filled(c)]
        cells = {
            name: c.cell_contents for name, c in zip(face.__code__.co_freevars, face.__closure__ or ()) if _filled(c)
        }
        for code in _codes(face.__code__):
            values += _referenced(code, face.__globals__, cells if code is face.__code__ else {})
        for value in values:
            if inspect.ismodule(value) or isinstance(value, (int, float, str, bytes, bool, type(None))):
                continue
            hit = _walk(value, targets, depth - 1, seen) if callable(value) else targets.get(id(value))
            if hit:
                return hit
    return None


def _referenced(code, g: dict, cells: dict) -> list:
    """What a code object reads: each global it loads, and each attribute it reads off a module or a class it loaded
    (``flash.flash_attention_backward_v1_dq``, ``engine.GPUEngine._block_forward``), and what it imports in
    its body (``from gpullm_lessons.model.quant import quantize_blockwise``). A name the learner gave their own function
    that happens to match a course function's is not taken for it: only what the code actually reaches."""
    out, instrs, bound = [], list(dis.get_instructions(code)), {}  # bound: locals an import in the body set
    for i, ins in enumerate(instrs):
        value, found = None, False
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str) and ins.argval in g:
            value, found = g[ins.argval], True
        elif ins.opname in ("LOAD_DEREF", "LOAD_CLOSURE") and ins.argval in cells:  # a name of the enclosing function
            value, found = cells[ins.argval], True
        elif ins.opname.startswith("LOAD_FAST") and ins.argval in bound:
            value, found = bound[ins.argval], True
        elif ins.opname == "IMPORT_NAME" and isinstance(ins.argval, str):
            try:
                module = importlib.import_module(ins.argval)
            except Exception:  # noqa: BLE001 - an import that fails here fails in the learner's code too
                continue
            nxt = instrs[i + 1] if i + 1 < len(instrs) else None
            if nxt is not None and nxt.opname.startswith("STORE"):  # import a.b: binds a
                bound[nxt.argval] = importlib.import_module(ins.argval.split(".")[0])
                out.append(module)
            for k, imp in enumerate(instrs[i + 1 :], start=i + 1):  # from a.b import c [as d], e ...
                if imp.opname != "IMPORT_FROM":
                    if imp.opname.startswith("STORE"):
                        continue
                    break
                sub = getattr(module, imp.argval, None)
                if sub is None:
                    try:
                        sub = importlib.import_module(f"{ins.argval}.{imp.argval}")
                    except Exception:  # noqa: BLE001
                        continue
                out.append(sub)
                store = instrs[k + 1] if k + 1 < len(instrs) else None
                if store is not None and store.opname.startswith("STORE"):
                    bound[store.argval] = sub
            continue
        if not found:
            continue
        out.append(value)
        for nxt in instrs[i + 1 :]:  # module.Class.attr ...: attributes read off modules and classes only
            if nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                break
            if not (inspect.ismodule(value) or inspect.isclass(value)):
                break
            try:
                value = getattr(value, nxt.argval, None)
            except Exception:  # noqa: BLE001 - a class attribute that computes itself and fails
                value = None
            out.append(value)
    return [v for v in out if v is not None]


def _course_code(obj) -> bool:
    module = next((getattr(f, "__module__", None) for f in _faces(obj) if getattr(f, "__module__", None)), None)
    return isinstance(module, str) and (module == "gpullm_lessons" or module.startswith("gpullm_lessons."))


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


_KERNEL_MODULES = (
    "adamw",
    "attention",
    "convert",
    "crossentropy",
    "encoder",
    "flash",
    "fused",
    "gelu",
    "layernorm",
    "linear",
    "softmax",
    "transpose",
    "vector_add",
)  # kernels/numba/<module>.py
_REFERENCE_MODULES = ("attention", "crossentropy", "encoder", "gelu", "layernorm", "linear", "residual", "softmax")


@functools.lru_cache(maxsize=None)
def course_implementations(op: str) -> tuple:
    """The course's own implementations of op `op` (an op checker's name, e.g. "gelu_backward"): its NumPy reference
    (gpullm_lessons.reference.<module>.<op>) and its Numba launcher and whole kernel versions (kernels/numba: `op`
    and `op_v<N>`; not the stage kernels `op_v<N>_<part>`, which an exercise may give), as "module:attr" strings."""
    found = []
    for mod in _REFERENCE_MODULES:
        name = f"gpullm_lessons.reference.{mod}"
        if hasattr(importlib.import_module(name), op):
            found.append(f"{name}:{op}")
    for mod in _KERNEL_MODULES:
        name = f"gpullm_lessons.kernels.numba.{mod}"
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            # whole versions only: a stage kernel (`layernorm_backward_v1_dparams`) may be what an exercise gives
            if (attr == op or re.fullmatch(re.escape(op) + r"_v\d+", attr)) and callable(getattr(module, attr)):
                found.append(f"{name}:{attr}")
    return tuple(found)


def uses_own(fns, own: Iterable[str]) -> Optional[str]:
    """The course implementation ("module.attr") that one of `fns` is, aliases, wraps or calls; None."""
    own = tuple(own)
    if not own:
        return None
    targets = _targets(own)
    for fn in fns if isinstance(fns, (list, tuple)) else [fns]:
        hit = _walk(fn, targets, DEPTH, set())
        if hit:
            return hit
    return None


def borrowed_verdict(name: str, fns, own: Iterable[str], *, task=None, seed=None, quiet=False, check=None):
    """A recorded *wrong* CheckResult when `fns` use the course's own implementation of the task, else None. Only a
    graded call (one with a task label: every exercise cell's, and every call the grader makes) is judged so: the
    course's own tests run its implementations through the same checkers."""
    if task is None:
        return None
    hit = uses_own(fns, own)
    if hit is None:
        return None
    from . import verdict

    msg = f"{name}: wrong - your answer uses the course's own implementation, {hit}"
    hint = (
        f"{hit} is the course's answer to this task: write your own (the exercise's idea and contract say "
        "what it must do); the other course helpers the exercise imports stay yours to use"
    )
    result = verdict.build_result("wrong", msg, hint, name=name, task=task, seed=seed)
    return verdict.record(result, quiet=quiet, check=check)
