"""Gather a backend's launchers from its op modules: every public `*_forward` / `*_backward` / `*_step` function,
plus any a module lists in LAUNCHERS."""

import importlib
import re

OP_MODULES = (
    "linear",
    "softmax",
    "layernorm",
    "gelu",
    "crossentropy",
    "attention",
    "encoder",
    "adamw",
    "convert",
    "fused",
    "flash",
)
_VERSION = re.compile(r"^v\d+$")


def collect(package: str) -> tuple[dict, dict]:
    """(launchers by name, module by launcher name) from `package.<op>` for each op module that exists
    (gpullm_lessons.kernels.numba.<op>, gpullm_lessons.backends.hip.<op>)."""
    launchers, owners = {}, {}
    for op in OP_MODULES:
        try:
            mod = importlib.import_module(f"{package}.{op}")
        except ModuleNotFoundError as e:
            if e.name == f"{package}.{op}":
                continue  # this op has no kernels on this backend yet
            raise
        for name in dir(mod):
            listed = name in getattr(mod, "LAUNCHERS", ())  # launchers not named *_forward/_backward/_step
            if (listed or name.endswith(("_forward", "_backward", "_step"))) and not name.startswith("_"):
                fn = getattr(mod, name)
                if callable(fn) and getattr(fn, "__module__", None) == mod.__name__:
                    launchers[name] = fn
                    owners[name] = mod
    return launchers, owners


def numbered(names) -> list:
    """The plain numbered versions v1, v2, ... in order (helper kernels such as 'v2_reduce' left out)."""
    return sorted((n for n in names if _VERSION.match(n)), key=lambda n: int(n[1:]))
