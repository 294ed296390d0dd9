"""What the frameworks tier's test files share (scripts/test-frameworks.sh runs each file twice:
plain simgpu, then under the shim with CUSHARE_MEMORY_LIMIT set)."""

import os

import pytest

UNDER_SHIM = bool(os.environ.get("CUSHARE_MEMORY_LIMIT"))
plain_only = pytest.mark.skipif(UNDER_SHIM, reason="plain simgpu case; CUSHARE_MEMORY_LIMIT is set")
shim_only = pytest.mark.skipif(not UNDER_SHIM, reason="shim case; CUSHARE_MEMORY_LIMIT is unset")


def mapped(name):
    """The files mapped into this process whose path contains name."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if name in line.split()[-1]})


@shim_only
def test_shim_is_preloaded():
    # Imported by each test file, so it runs in each file's shim run.
    assert mapped("libcushare.so"), "CUSHARE_MEMORY_LIMIT is set but libcushare.so is not loaded"
