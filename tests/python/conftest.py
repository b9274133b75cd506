import os
import sys

import pytest

# The build tree's package (python/ links + _C) comes first when ctest runs us; a plain `pytest`
# after `pip install .` uses the installed package.
_build = os.environ.get("MEGACORE_PYTHON_BUILD_DIR")
if _build and _build not in sys.path:
    sys.path.insert(0, _build)

import megacore  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if megacore.cuda_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
