#!/usr/bin/env python3
"""Generates simgpu's driver symbol table from the CUDA toolkit.

Inputs: cudaTypedefs.h (one PFN_<name>_v<version>[_ptds|_ptsz] typedef per ABI of every driver
entry point), the symbol list of the toolkit's stub libcuda.so (every function the real driver
exports) and simgpu/driver_api_cuda13.txt (what simgpu does with each: modelled, absent, legacy,
gap; the build stops when an export is not classified or a classified name is not exported).
Output: one C file with
  - a weak stub for every exported symbol that answers as the list says through
    simgpu_unimplemented (CUDA_ERROR_NOT_INITIALIZED before cuInit, then the listed error), so
    an unimplemented entry point never crashes; a strong definition in simgpu/src replaces it;
  - simgpu_driver_api_class(name, &answer): whether the built library models name (its
    definition is not the stub) and the stub's answer, for the classification test;
  - the cuGetProcAddress table: (base name, first version, stream variant, symbol, address),
    sorted by name then version, so the lookup is a binary search.
The mapping version -> exported symbol follows the driver's naming: the i-th ABI of a name (in
version order) is exported as <name> (i = 0) or <name>_v<i+1>; a per-thread-stream variant is the
symbol of the newest ABI not newer than it, plus _ptds or _ptsz.
"""
import re
import subprocess
import sys
from collections import defaultdict

# Exported symbols that cudaTypedefs.h does not describe; first CUDA version from the release notes.
EXTRA_SINCE = {
    "cuProfilerInitialize": 4000, "cuProfilerStart": 4000, "cuProfilerStop": 4000,
    "cuCoredumpGetAttribute": 12010, "cuCoredumpGetAttributeGlobal": 12010,
    "cuCoredumpSetAttribute": 12010, "cuCoredumpSetAttributeGlobal": 12010,
    "cuCtxFromGreenCtx": 12040, "cuCtxGetDevResource": 12040, "cuDevResourceGenerateDesc": 12040,
    "cuDevSmResourceSplitByCount": 12040, "cuDeviceGetDevResource": 12040,
    "cuGreenCtxCreate": 12040, "cuGreenCtxDestroy": 12040, "cuGreenCtxGetDevResource": 12040,
    "cuGreenCtxRecordEvent": 12040, "cuGreenCtxWaitEvent": 12040, "cuStreamGetGreenCtx": 12040,
    "cuGreenCtxGetId": 12090, "cuCtxRecordEvent": 12050, "cuCtxWaitEvent": 12050,
    "cuDeviceRegisterAsyncNotification": 12040, "cuDeviceUnregisterAsyncNotification": 12040,
}


CLASSES = {"modelled", "absent", "legacy", "gap"}


def read_classes(path, exported):
    """name -> (class, answer); every export exactly once, nothing else."""
    classes = {}
    for n, line in enumerate(open(path), 1):
        line = line.split("#", 1)[0].split()
        if not line:
            continue
        name, cls = line[0], line[1] if len(line) > 1 else ""
        if cls not in CLASSES:
            sys.exit(f"{path}:{n}: '{name}': class must be one of {sorted(CLASSES)}")
        answer = "CUDA_SUCCESS"
        if cls != "modelled":
            if len(line) < 3 or not re.fullmatch(r"CUDA_(SUCCESS|ERROR_[A-Z0-9_]+)", line[2]):
                sys.exit(f"{path}:{n}: '{name}' ({cls}) needs the error it answers, e.g. CUDA_ERROR_NOT_SUPPORTED")
            answer = line[2]
        for extra in line[3 if cls != "modelled" else 2:]:
            if not re.fullmatch(r"when=CU_DEVICE_ATTRIBUTE_\w+\(\d+\)=-?\d+", extra) or cls != "absent":
                sys.exit(f"{path}:{n}: '{name}': unexpected '{extra}' (only an absent entry takes when=ATTR(N)=V)")
        if name in classes:
            sys.exit(f"{path}:{n}: '{name}' is classified twice")
        if name not in exported:
            sys.exit(f"{path}:{n}: '{name}' is not exported by the driver")
        classes[name] = (cls, answer)
    missing = sorted(exported - classes.keys())
    if missing:
        sys.exit(f"{path}: exported but not classified: {' '.join(missing)}")
    return classes


def main():
    typedefs, stub, classes_path, out, out_pt = sys.argv[1:6]
    text = open(typedefs).read()
    nm = subprocess.check_output(["nm", "-D", "--defined-only", stub], text=True)
    exports = sorted({l.split()[-1] for l in nm.splitlines() if " T " in l})
    exported = set(exports)
    classes = read_classes(classes_path, exported)
    # CUresult's values, from cuda.h beside cudaTypedefs.h.
    cuda_h = open(typedefs.replace("cudaTypedefs.h", "cuda.h")).read()
    codes = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(CUDA_SUCCESS|CUDA_ERROR_\w+)\s*=\s*(\d+)", cuda_h)}
    for name, (cls, answer) in classes.items():
        if answer not in codes:
            sys.exit(f"{classes_path}: '{name}' answers {answer}, which is not a CUresult of cuda.h")
    # A `when` attribute's name and number must be cuda.h's (the number is what the test asks).
    attrs = {m.group(1): int(m.group(2)) for m in re.finditer(r"\b(CU_DEVICE_ATTRIBUTE_\w+)\s*=\s*(\d+)", cuda_h)}
    for m in re.finditer(r"when=(CU_DEVICE_ATTRIBUTE_\w+)\((\d+)\)", open(classes_path).read()):
        if attrs.get(m.group(1)) != int(m.group(2)):
            sys.exit(f"{classes_path}: {m.group(1)} is {attrs.get(m.group(1))} in cuda.h, not {m.group(2)}")

    abis = defaultdict(set)  # name -> {version} (default-stream ABIs)
    pts = []  # (name, version, suffix)
    sigs = {}
    for name, ver, pt, sig in re.findall(r"\*PFN_(\w+?)_v(\d+)(_ptds|_ptsz)?\)\((.*?)\);", text, re.S):
        sigs[(name, int(ver), pt)] = " ".join(sig.split())
        if pt:
            pts.append((name, int(ver), pt))
        else:
            abis[name].add(int(ver))

    rows = []  # (name, version, variant, symbol)
    pt_wrappers = []  # (pt symbol, default symbol, signature)
    for name, vers in abis.items():
        for i, v in enumerate(sorted(vers)):
            sym = name if i == 0 else f"{name}_v{i + 1}"
            if sym not in exported:
                sys.exit(f"gen_driver_table: {name}@{v} maps to {sym}, which the driver does not export")
            rows.append((name, v, 0, sym))
    for name, v, pt in pts:
        older = sorted(x for x in abis[name] if x <= v)
        if not older:
            sys.exit(f"gen_driver_table: {name}{pt}@{v} has no default ABI at or before it")
        idx = sorted(abis[name]).index(older[-1])
        sym = (name if idx == 0 else f"{name}_v{idx + 1}") + pt
        if sym not in exported:
            sys.exit(f"gen_driver_table: {name}{pt}@{v} maps to {sym}, which the driver does not export")
        rows.append((name, v, 1, sym))
        pt_wrappers.append((sym, sym[: -len(pt)], sigs[(name, v, pt)]))
    known = {r[3] for r in rows}
    for sym in exports:
        if sym in known:
            continue
        base = re.sub(r"(_v\d+)?(_ptds|_ptsz)?$", "", sym)
        if base in abis:
            continue  # an older ABI no longer described (e.g. 32-bit cuMemAlloc); export only
        if base not in EXTRA_SINCE:
            sys.exit(f"gen_driver_table: no first version known for exported {sym}; add it to EXTRA_SINCE")
        rows.append((base, EXTRA_SINCE[base], 0, sym))
    rows.sort()

    with open(out, "w") as f:
        f.write("/* Generated by tools/gen_driver_table.py from the CUDA toolkit. Do not edit. */\n")
        f.write("#include \"proc_table.h\"\n\n")
        f.write("#include <string.h>\n\n")
        f.write("int simgpu_unimplemented(const char* name, int answer);\n\n")
        pt_syms = {w[0] for w in pt_wrappers}
        stubbed = [sym for sym in exports if sym not in pt_syms]
        for sym in sorted(pt_syms):
            f.write(f"int {sym}(void);  /* per-thread variant: driver_per_thread.cpp */\n")
        for sym in stubbed:
            cls, answer = classes[sym]
            f.write(f"static int simgpu_stub_{sym}(void) {{ return simgpu_unimplemented(\"{sym}\", {codes[answer]}); }}\n")
            f.write(f"__attribute__((weak, alias(\"simgpu_stub_{sym}\"), visibility(\"default\"))) int {sym}(void);\n")
        f.write("\nconst struct simgpu_proc_entry simgpu_proc_table[] = {\n")
        for name, v, pt, sym in rows:
            f.write(f"  {{\"{name}\", {v}, {pt}, \"{sym}\", (void*)&{sym}}},\n")
        f.write("};\n")
        f.write(f"const unsigned simgpu_proc_table_size = {len(rows)};\n")
        f.write("\nconst char* const simgpu_exported_symbols[] = {\n")
        for sym in exports:
            f.write(f"  \"{sym}\",\n")
        f.write("};\n")
        f.write(f"const unsigned simgpu_exported_symbols_size = {len(exports)};\n")
        # Per stubbed symbol: its final definition (-Bsymbolic: the library's own), its stub and
        # its answer; a per-thread variant is judged by its default ABI.
        f.write("\nstruct simgpu_api_row { const char* name; void* fn; void* stub; int answer; };\n")
        f.write("static const struct simgpu_api_row simgpu_api_rows[] = {\n")
        for sym in stubbed:
            f.write(f"  {{\"{sym}\", (void*)&{sym}, (void*)&simgpu_stub_{sym}, {codes[classes[sym][1]]}}},\n")
        f.write("};\n")
        pt_base = {w[0]: w[1] for w in pt_wrappers}
        f.write("static const char* const simgpu_api_pt[][2] = {\n")
        for pt, base in sorted(pt_base.items()):
            f.write(f"  {{\"{pt}\", \"{base}\"}},\n")
        f.write("};\n")
        f.write("""
/* 1 if the library models name, 0 if its stub answers (*answer: what it answers after cuInit),
 * -1 if name is not an entry point. For tests/simgpu/driver/api_classification_test.cpp. */
__attribute__((visibility("default"))) int simgpu_driver_api_class(const char* name, int* answer) {
  for (unsigned i = 0; i < sizeof simgpu_api_pt / sizeof simgpu_api_pt[0]; ++i)
    if (strcmp(simgpu_api_pt[i][0], name) == 0) { name = simgpu_api_pt[i][1]; break; }
  for (unsigned i = 0; i < sizeof simgpu_api_rows / sizeof simgpu_api_rows[0]; ++i) {
    if (strcmp(simgpu_api_rows[i].name, name) != 0) continue;
    const int modelled = simgpu_api_rows[i].fn != simgpu_api_rows[i].stub;
    if (answer) *answer = modelled ? 0 : simgpu_api_rows[i].answer;
    return modelled;
  }
  return -1;
}
""")
    write_pt(out_pt, pt_wrappers)


def param_names(sig):
    if sig.strip() in ("", "void"):
        return []
    names = []
    for p in sig.split(","):
        m = re.search(r"(\w+)\s*(\[\s*\])?\s*$", p.strip())
        if not m:
            sys.exit(f"gen_driver_table: cannot name parameter '{p}'")
        names.append(m.group(1))
    return names


def write_pt(out_pt, pt_wrappers):
    """Per-thread-default-stream variants: each runs the default ABI with stream 0 meaning the
    calling thread's default stream (PerThreadStreamScope), so the logic exists once."""
    with open(out_pt, "w") as f:
        f.write("// Generated by tools/gen_driver_table.py from the CUDA toolkit. Do not edit.\n")
        f.write("#include \"driver.h\"\n\nnamespace {\n")
        for i, (pt, base, sig) in enumerate(pt_wrappers):
            f.write(f"extern \"C\" CUresult simgpu_target_{i}({sig}) __asm__(\"{base}\");\n")
        f.write("}  // namespace\n\n")
        for i, (pt, base, sig) in enumerate(pt_wrappers):
            args = ", ".join(param_names(sig))
            f.write(f"extern \"C\" SIMGPU_EXPORT CUresult simgpu_pt_{i}({sig}) __asm__(\"{pt}\");\n")
            f.write(f"CUresult simgpu_pt_{i}({sig}) {{\n"
                    f"  simgpu::PerThreadStreamScope scope;\n  return simgpu_target_{i}({args});\n}}\n")


if __name__ == "__main__":
    main()
