"""Test setup: the package is imported first, so with no GPU the CUDA simulator is on before numba loads."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import gpullm_lessons  # noqa: E402  (must precede any numba import)
from gpullm_lessons import device  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip, with the reason, without a GPU (`make gpu-test` refuses to start without one)."""
    if device.has_gpu():
        return
    skip = pytest.mark.skip(reason=f"needs a real GPU; this machine runs as '{device.kind()}' ({device.info().reason})")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def require_tool(name: str):
    """Skip when a compiler is missing, unless GPULLM_REQUIRE_COMPILERS=1 (CI), where it fails."""
    import shutil
    if shutil.which(name):
        return
    msg = f"{name} not found (install it: see `python -m gpullm_lessons doctor`)"
    if os.environ.get("GPULLM_REQUIRE_COMPILERS") == "1":
        pytest.fail("GPULLM_REQUIRE_COMPILERS=1 but " + msg)
    pytest.skip(msg)
