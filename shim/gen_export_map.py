#!/usr/bin/env python3
"""Writes libcushare's linker version script from the hook tables: exactly the hooked symbols,
dlsym, dlvsym and dlmopen are exported, and the tenant-facing API (cushare/reclaim.h); everything else is local (no version node: an unversioned
dlsym and cu* symbols satisfy the versioned and unversioned references of every caller)."""
import re
import sys

*defs, out = sys.argv[1:]
names = ["dlsym", "dlvsym", "dlmopen", "cushare_reclaim_fd", "cushare_reclaim_target"]
for d in defs:
    for m in re.finditer(r"^CUSHARE_(?:DRIVER|LAUNCH|NVML)_HOOK\((\w+)", open(d).read(), re.M):
        names.append(m.group(1))
with open(out, "w") as f:
    f.write("{\n  global:\n")
    for n in names:
        f.write(f"    {n};\n")
    f.write("  local:\n    *;\n};\n")
