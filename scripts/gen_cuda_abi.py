#!/usr/bin/env python3
"""Generate cuda-abi/src/generated.rs from the CUDA 12.9 driver API headers.

Usage:
    python3 scripts/gen_cuda_abi.py                 # pip-downloads the wheel
    python3 scripts/gen_cuda_abi.py --include DIR   # DIR holds cuda.h + cudaTypedefs.h
    python3 scripts/gen_cuda_abi.py --check         # fail if generated.rs is stale

The headers come from the PyPI wheel nvidia-cuda-runtime-cu12==12.9.79
(nvidia/cuda_runtime/include/). Standard library only.

What is generated
-----------------
* ENTRY_POINTS: one row per ``PFN_<name>_v<version>[_ptsz|_ptds]`` typedef in
  cudaTypedefs.h (the ``__CUDA_API_VERSION_INTERNAL`` legacy block included)
  and cudaProfilerTypedefs.h (the profiler control API), each with the exported
  driver symbol implementing that ABI version.
* SYMBOLS: the distinct symbols of ENTRY_POINTS, sorted.
* ERRORS / ERROR_CSTRS / result::*: every CUresult enumerator.
* DEVICE_ATTRIBUTES: every CUdevice_attribute value (first name per value).

How a typedef is mapped to a symbol
-----------------------------------
1. The exported symbols are the names declared ``CUresult CUDAAPI cuX(`` in
   cuda.h, with cuda.h's own ``#define cuX ...`` macros expanded at the point
   of declaration, in two preprocessor configurations: as an application sees
   it (nothing defined) and as the driver itself is built
   (``__CUDA_API_VERSION_INTERNAL`` defined, which turns
   ``__CUDA_API_PTDS(x)``/``__CUDA_API_PTSZ(x)`` into ``x_ptds``/``x_ptsz`` and
   exposes the legacy declarations).  The union of both is the symbol set.
2. For a base name ``cuX`` the legacy (non per-thread) symbols are ``cuX``,
   ``cuX_v2``, ``cuX_v3``...  They must form an unbroken sequence, and their
   number must equal the number of legacy typedef versions; the sorted
   versions are then paired with the symbols in suffix order.  Any other
   situation aborts the script (unless OVERRIDES covers it).
3. A per-thread typedef ``PFN_cuX_vN_ptsz`` maps to the per-thread variant of
   the symbol of the highest legacy version <= N; that variant (with the same
   ``_ptsz``/``_ptds`` suffix) must be a declared symbol.
4. Cross-check: the symbol an application compiled against these headers
   calls for ``cuX`` (the legacy-mode macro expansion of ``cuX``) must be one
   of the symbols chosen for ``cuX``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from pathlib import Path

WHEEL = "nvidia-cuda-runtime-cu12==12.9.79"
CUDA_VERSION = 12090
REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "cuda-abi" / "src" / "generated.rs"

# ---------------------------------------------------------------------------
# Override table: exceptions found in the 12.9 headers, each justified.
# ---------------------------------------------------------------------------

# Typedefs without a ``_v<version>`` suffix.  cudaTypedefs.h declares them as
# plain ``PFN_<name>``; their version is taken from the
# ``#define PFN_<name> PFN_<name>_v<version>`` "latest version" macro (which
# names a typedef that does not exist).  Listed explicitly so a new one makes
# the script fail instead of being silently versioned.
UNVERSIONED_TYPEDEFS = {
    "cuModuleGetFunctionCount",
    "cuModuleEnumerateFunctions",
    "cuLibraryGetKernelCount",
    "cuLibraryEnumerateKernels",
}

# Extra rows with no typedef of their own: (name, version, per_thread) -> symbol.
#
# cuGraphInstantiate: CUDA 12.0 changed the source-level API so that
# ``cuGraphInstantiate`` *is* cuGraphInstantiateWithFlags (cuda.h:
# ``#define cuGraphInstantiate cuGraphInstantiateWithFlags``; cudaTypedefs.h:
# ``#define PFN_cuGraphInstantiate PFN_cuGraphInstantiateWithFlags_v11040``),
# but no ``PFN_cuGraphInstantiate_v12000`` typedef exists; only the two
# legacy ones (v10000, v11000) do.  An application built against 12.x headers
# asking for "cuGraphInstantiate" at 12000+ expects the 3-argument WithFlags
# ABI, so the row is added by hand.  The version 12000 is the release in which
# the macro changed (11.x headers mapped it to cuGraphInstantiate_v2).
EXTRA_ROWS = {
    ("cuGraphInstantiate", 12000, False): "cuGraphInstantiateWithFlags",
}

# Bases whose cuda.h macro maps the plain name onto another API's symbol;
# the cross-check of rule 4 is satisfied by the EXTRA_ROWS entry above.
CROSS_API_MACROS = {"cuGraphInstantiate": "cuGraphInstantiateWithFlags"}

# Facts the output must satisfy: (name, version, per_thread) -> symbol.
KNOWN_FACTS = {
    ("cuMemAlloc", 3020, False): "cuMemAlloc_v2",
    ("cuMemAlloc", 2000, False): "cuMemAlloc",
    ("cuCtxCreate", 2000, False): "cuCtxCreate",
    ("cuCtxCreate", 3020, False): "cuCtxCreate_v2",
    ("cuCtxCreate", 11040, False): "cuCtxCreate_v3",
    ("cuCtxCreate", 12050, False): "cuCtxCreate_v4",
    ("cuEventElapsedTime", 2000, False): "cuEventElapsedTime",
    ("cuEventElapsedTime", 12080, False): "cuEventElapsedTime_v2",
    ("cuLaunchKernel", 4000, False): "cuLaunchKernel",
    ("cuLaunchKernel", 7000, True): "cuLaunchKernel_ptsz",
    ("cuMemcpyHtoD", 3020, False): "cuMemcpyHtoD_v2",
    ("cuMemcpyHtoD", 7000, True): "cuMemcpyHtoD_v2_ptds",
    ("cuGetProcAddress", 11030, False): "cuGetProcAddress",
    ("cuGetProcAddress", 12000, False): "cuGetProcAddress_v2",
    ("cuStreamGetCaptureInfo", 10010, False): "cuStreamGetCaptureInfo",
    ("cuStreamGetCaptureInfo", 11030, False): "cuStreamGetCaptureInfo_v2",
    ("cuStreamGetCaptureInfo", 12030, False): "cuStreamGetCaptureInfo_v3",
    ("cuStreamGetCaptureInfo", 12030, True): "cuStreamGetCaptureInfo_v3_ptsz",
}


class GenError(Exception):
    pass


def fail(msg: str) -> None:
    raise GenError(msg)


# ---------------------------------------------------------------------------
# Header acquisition
# ---------------------------------------------------------------------------


def fetch_headers(tmp: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
         "--dest", str(tmp), WHEEL],
        check=True,
    )
    wheels = sorted(tmp.glob("*.whl"))
    if len(wheels) != 1:
        fail(f"expected one wheel in {tmp}, found {wheels}")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extractall(tmp / "unpacked")
    inc = tmp / "unpacked" / "nvidia" / "cuda_runtime" / "include"
    return inc


# ---------------------------------------------------------------------------
# Minimal C preprocessing
# ---------------------------------------------------------------------------


def strip_comments(text: str) -> str:
    """Remove /* */ and // comments, keeping newlines so line numbers hold."""
    out = []
    i, n = 0, len(text)
    while i < n:
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                fail("unterminated comment")
            out.append("\n" * text.count("\n", i, j + 2))
            i = j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def join_continuations(text: str) -> list[str]:
    return text.replace("\\\n", " ").split("\n")


def eval_condition(expr: str, defined: set[str]) -> bool:
    """Evaluate a #if expression: defined(), !, &&, ||, comparisons.

    Identifiers that are not macros evaluate to 0, as in C.
    """
    e = re.sub(r"defined\s*\(\s*(\w+)\s*\)", lambda m: " 1 " if m.group(1) in defined else " 0 ", expr)
    e = re.sub(r"defined\s+(\w+)", lambda m: " 1 " if m.group(1) in defined else " 0 ", e)
    e = re.sub(r"\b(\d+)[uUlL]+\b", r"\1", e)
    e = e.replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e)
    e = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: m.group(0) if m.group(0) in ("and", "or", "not") else "0", e)
    try:
        return bool(eval(e, {"__builtins__": {}}, {}))  # noqa: S307 - arithmetic only
    except Exception as exc:  # pragma: no cover
        fail(f"cannot evaluate #if {expr!r}: {exc}")
    return False


DECL_RE = re.compile(r"\bCUDAAPI\s+(cu\w+)\s*\(")
PT_MACRO_RE = re.compile(r"^__CUDA_API_(PTDS|PTSZ)\(\s*(\w+)\s*\)$")


def declared_symbols(cuda_h: str, defined: set[str]):
    """Symbols declared by cuda.h under one configuration.

    Returns (symbols, expand) where ``expand(name)`` applies the function-name
    macros still in force at the end of the file (what a caller's ``name(...)``
    compiles to).
    """
    defined = set(defined)
    pt_suffix = None  # resolved once __CUDA_API_PTDS is defined
    macros: dict[str, str] = {}
    symbols: set[str] = set()
    stack: list[tuple[bool, bool]] = []  # (active, any branch taken)
    pending: list[str] = []

    def active() -> bool:
        return all(a for a, _ in stack)

    def expand(name: str) -> str:
        seen = set()
        while name in macros and name not in seen:
            seen.add(name)
            exp = macros[name]
            m = PT_MACRO_RE.match(exp)
            if m:
                if pt_suffix is None:
                    fail("__CUDA_API_PT* used before being defined")
                name = m.group(2) + (("_" + m.group(1).lower()) if pt_suffix else "")
            elif re.fullmatch(r"cu\w+", exp):
                name = exp
            else:
                fail(f"unexpected expansion of {name}: {exp!r}")
        return name

    def flush() -> None:
        chunk = "\n".join(pending)
        pending.clear()
        for m in DECL_RE.finditer(chunk):
            symbols.add(expand(m.group(1)))

    for line in join_continuations(strip_comments(cuda_h)):
        s = line.strip()
        if not s.startswith("#"):
            if active():
                pending.append(line)
            continue
        flush()
        d = re.match(r"#\s*(\w+)\s*(.*)$", s)
        if not d:
            continue
        kw, rest = d.group(1), d.group(2).strip()
        if kw in ("if", "ifdef", "ifndef"):
            if kw == "ifdef":
                c = rest in defined
            elif kw == "ifndef":
                c = rest not in defined
            else:
                c = eval_condition(rest, defined)
            stack.append((c, c))
        elif kw == "elif":
            _, taken = stack.pop()
            c = (not taken) and eval_condition(rest, defined)
            stack.append((c, taken or c))
        elif kw == "else":
            _, taken = stack.pop()
            stack.append((not taken, True))
        elif kw == "endif":
            stack.pop()
        elif not active():
            continue
        elif kw == "define":
            m = re.match(r"(\w+)(\([^)]*\))?\s*(.*)$", rest)
            name, params, body = m.group(1), m.group(2), m.group(3).strip()
            defined.add(name)
            if name == "__CUDA_API_PTDS":
                pt_suffix = "##" in body
            elif params is None and re.fullmatch(r"cu\w+", name):
                macros[name] = body
        elif kw == "undef":
            defined.discard(rest)
            macros.pop(rest, None)
    flush()
    if stack:
        fail("unbalanced #if in cuda.h")
    return symbols, expand


# ---------------------------------------------------------------------------
# cudaTypedefs.h
# ---------------------------------------------------------------------------

TYPEDEF_RE = re.compile(r"typedef\s+CUresult\s*\(\s*CUDAAPI\s*\*\s*PFN_(\w+)\s*\)\s*\(")
VERSIONED_RE = re.compile(r"^(\w+)_v(\d+)(?:_(ptsz|ptds))?$")
LATEST_RE = re.compile(r"^#define\s+PFN_(\w+)\s+(.*?)\s*$", re.M)


def parse_typedefs(text: str, unversioned: set[str] = UNVERSIONED_TYPEDEFS) -> tuple[list[tuple[str, int, str | None]], list[str]]:
    clean = strip_comments(text)
    if clean.count("typedef") != len(TYPEDEF_RE.findall(clean)):
        fail("cudaTypedefs.h has a typedef the PFN pattern does not recognise")
    latest = {}
    for m in LATEST_RE.finditer(clean):
        latest[m.group(1)] = m.group(2)
    rows: list[tuple[str, int, str | None]] = []
    notes: list[str] = []
    seen = set()
    for m in TYPEDEF_RE.finditer(clean):
        full = m.group(1)
        vm = VERSIONED_RE.match(full)
        if vm:
            row = (vm.group(1), int(vm.group(2)), vm.group(3))
        else:
            if full not in unversioned:
                fail(f"unversioned typedef PFN_{full} is not in UNVERSIONED_TYPEDEFS")
            lm = re.fullmatch(rf"PFN_{full}_v(\d+)", latest.get(full, ""))
            if not lm:
                fail(f"no '#define PFN_{full} PFN_{full}_vN' to version PFN_{full}")
            row = (full, int(lm.group(1)), None)
            notes.append(f"unversioned typedef PFN_{full}: version {row[1]} taken from its PFN_ macro")
        if row in seen:
            fail(f"duplicate typedef {row}")
        seen.add(row)
        rows.append(row)
    for name in unversioned:
        if not any(r[0] == name for r in rows):
            fail(f"stale UNVERSIONED_TYPEDEFS entry {name}")
    # Report "latest version" macros that disagree with the typedefs.
    by_base = defaultdict(set)
    for b, v, pt in rows:
        if pt is None:
            by_base[b].add(v)
    for name, body in sorted(latest.items()):
        m = re.fullmatch(r"PFN_(\w+?)_v(\d+)", body) or re.fullmatch(
            r"__API_TYPEDEF_PT(?:DS|SZ)\(\s*PFN_(\w+)\s*,\s*(\d+)\s*,\s*\d+\s*\)", body)
        if not m:
            notes.append(f"malformed macro: #define PFN_{name} {body}")
            continue
        base, ver = m.group(1), int(m.group(2))
        if base != re.sub(r"_v\d+$", "", name):
            notes.append(f"#define PFN_{name} names another API: {body}")
        elif ver not in by_base.get(base, ()):
            notes.append(f"#define PFN_{name} -> v{ver}, but no PFN_{base}_v{ver} typedef exists")
        elif ver != max(by_base[base]) and name == base:
            notes.append(f"#define PFN_{name} -> v{ver}, not the newest typedef v{max(by_base[base])}")
    return rows, notes


# ---------------------------------------------------------------------------
# Pairing
# ---------------------------------------------------------------------------


def symbol_rank(base: str, sym: str) -> int | None:
    if sym == base:
        return 1
    m = re.fullmatch(re.escape(base) + r"_v(\d+)", sym)
    return int(m.group(1)) if m else None


def build_entry_points(typedefs, symbols, app_expand, notes):
    by_base = defaultdict(lambda: ([], []))  # base -> (legacy versions, [(ver, pt)])
    for base, ver, pt in typedefs:
        (by_base[base][1] if pt else by_base[base][0]).append((ver, pt) if pt else ver)

    rows: dict[tuple[str, int, bool], str] = {}
    used_extra = set()
    for base in sorted(by_base):
        legacy, per_thread = by_base[base]
        legacy.sort()
        cands = sorted(
            ((r, s) for s in symbols if (r := symbol_rank(base, s)) is not None)
        )
        ranks = [r for r, _ in cands]
        if ranks != list(range(1, len(ranks) + 1)):
            fail(f"{base}: symbol suffixes are not an unbroken base,_v2,_v3.. sequence: {cands}")
        if len(cands) != len(legacy):
            fail(f"{base}: {len(legacy)} typedef versions {legacy} but "
                 f"{len(cands)} declared symbols {[s for _, s in cands]}; ambiguous")
        chosen = dict(zip(legacy, (s for _, s in cands)))
        for v, s in chosen.items():
            rows[(base, v, False)] = s
        for v, pt in sorted(per_thread):
            older = [lv for lv in legacy if lv <= v]
            if not older:
                fail(f"{base}: per-thread typedef v{v}_{pt} has no legacy version <= {v}")
            sym = f"{chosen[max(older)]}_{pt}"
            if sym not in symbols:
                fail(f"{base}: per-thread typedef v{v}_{pt} -> {sym}, which cuda.h does not declare")
            rows[(base, v, True)] = sym
        for key, sym in EXTRA_ROWS.items():
            if key[0] == base:
                if key in rows:
                    fail(f"EXTRA_ROWS {key} collides with a typedef row")
                if sym not in symbols:
                    fail(f"EXTRA_ROWS {key} -> {sym} is not a declared symbol")
                rows[key] = sym
                used_extra.add(key)
        # Rule 4: what an application compiled against these headers calls.
        app = app_expand(base)
        mine = {s for (b, _, _), s in rows.items() if b == base}
        if app not in mine:
            if CROSS_API_MACROS.get(base) == app:
                notes.append(f"cuda.h maps {base} to another API: {app} (handled by EXTRA_ROWS)")
            else:
                fail(f"{base}: cuda.h maps it to {app}, which no row of {base} uses: {sorted(mine)}")
    for key in EXTRA_ROWS:
        if key not in used_extra:
            fail(f"stale EXTRA_ROWS entry {key}")
    for key, sym in KNOWN_FACTS.items():
        if rows.get(key) != sym:
            fail(f"known fact violated: {key} -> {rows.get(key)}, expected {sym}")
    return sorted((name, ver, pt, sym) for (name, ver, pt), sym in rows.items())


# ---------------------------------------------------------------------------
# Enums
# ---------------------------------------------------------------------------


def enum_body(text: str, tag: str, typedef_name: str) -> str:
    m = re.search(r"typedef\s+enum\s+" + tag + r"\s*\{(.*?)\}\s*" + typedef_name + r"\s*;", text, re.S)
    if not m:
        fail(f"enum {typedef_name} not found")
    return m.group(1)


def parse_enum(body: str) -> list[tuple[str, int, str]]:
    """(name, value, leading doc comment) for each enumerator, in order."""
    out = []
    tokens = re.finditer(r"/\*\*<?(.*?)\*/|(\w+)\s*(?:=\s*([^,/]+?))?\s*(?:,|$)", body, re.S)
    doc = ""
    prev = -1
    values: dict[str, int] = {}
    for t in tokens:
        if t.group(1) is not None:
            doc = t.group(1)
            continue
        name, expr = t.group(2), t.group(3)
        if expr is None:
            val = prev + 1
        elif re.fullmatch(r"0[xX][0-9a-fA-F]+|\d+", expr.strip()):
            val = int(expr.strip(), 0)
        elif expr.strip() in values:
            val = values[expr.strip()]
        else:
            fail(f"cannot evaluate enumerator {name} = {expr!r}")
        values[name] = val
        out.append((name, val, doc))
        prev = val
        doc = ""
    return out


def first_sentence(doc: str) -> str:
    text = " ".join(line.strip().lstrip("*").strip() for line in doc.splitlines())
    text = re.sub(r"\\deprecated\b", "", text)
    text = re.sub(r"::(\w)", r"\1", text)  # doxygen cross-reference markers
    text = re.sub(r"\\[pec]\s+", "", text)  # doxygen inline markup
    text = " ".join(text.split())
    m = re.search(r"(?<!\be\.g)(?<!\bi\.e)\.(\s|$)", text)
    sentence = text[: m.start() + 1] if m else text
    if not sentence:
        fail(f"empty description from {doc!r}")
    return sentence


def parse_errors(cuda_h: str) -> list[tuple[int, str, str]]:
    enum = parse_enum(enum_body(cuda_h, "cudaError_enum", "CUresult"))
    errors = []
    seen = set()
    for name, val, doc in enum:
        if val in seen:
            fail(f"duplicate CUresult value {val}")
        seen.add(val)
        if not doc.strip():
            fail(f"{name} has no doc comment")
        desc = first_sentence(doc)
        if not desc.isascii() or any(ord(c) < 0x20 for c in desc):
            fail(f"{name}: non-ASCII/control characters in description")
        errors.append((val, name, desc))
    return sorted(errors)


def parse_device_attributes(cuda_h: str) -> tuple[list[tuple[int, str]], list[str]]:
    enum = parse_enum(enum_body(cuda_h, "CUdevice_attribute_enum", "CUdevice_attribute"))
    first: dict[int, str] = {}
    aliases = []
    for name, val, _ in enum:
        if name == "CU_DEVICE_ATTRIBUTE_MAX":
            continue
        if val in first:
            aliases.append(f"{name} = {val} (alias of {first[val]})")
        else:
            first[val] = name
    return sorted(first.items()), aliases


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def rs_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(entries, errors, attrs) -> str:
    syms = sorted({e[3] for e in entries})
    o = []
    w = o.append
    w("// @generated by scripts/gen_cuda_abi.py from the CUDA 12.9 driver API headers")
    w(f"// (cuda.h and cudaTypedefs.h of the PyPI wheel {WHEEL}).")
    w("// Do not edit by hand. Regenerate with:")
    w("//     python3 scripts/gen_cuda_abi.py [--include DIR_WITH_CUDA_H]")
    w("")
    w("use std::ffi::CStr;")
    w("")
    w("use crate::proc_address::EntryPoint;")
    w("")
    w("/// `CUDA_VERSION` of the headers this file was generated from.")
    w(f"pub const HEADER_CUDA_VERSION: i32 = {CUDA_VERSION};")
    w("")
    w("/// One row per `PFN_<name>_v<version>[_ptsz|_ptds]` typedef of cudaTypedefs.h,")
    w("/// sorted by name, version, per_thread.")
    w("pub static ENTRY_POINTS: &[EntryPoint] = &[")
    for name, ver, pt, sym in entries:
        w(f"    EntryPoint {{ name: {rs_str(name)}, version: {ver}, per_thread: {'true' if pt else 'false'}, symbol: {rs_str(sym)} }},")
    w("];")
    w("")
    w("/// Distinct `ENTRY_POINTS` symbols, sorted.")
    w("pub static SYMBOLS: &[&str] = &[")
    for s in syms:
        w(f"    {rs_str(s)},")
    w("];")
    w("")
    w("/// Every `CUresult` enumerator: (value, name, first sentence of its doc comment),")
    w("/// sorted by value.")
    w("pub static ERRORS: &[(u32, &str, &str)] = &[")
    for val, name, desc in errors:
        w(f"    ({val}, {rs_str(name)}, {rs_str(desc)}),")
    w("];")
    w("")
    w("/// `ERRORS` as NUL-terminated C strings, same order.")
    w("pub static ERROR_CSTRS: &[(u32, &CStr, &CStr)] = &[")
    for val, name, desc in errors:
        w(f"    ({val}, c{rs_str(name)}, c{rs_str(desc)}),")
    w("];")
    w("")
    w("/// `CUdevice_attribute` values (first name per value, without `CU_DEVICE_ATTRIBUTE_MAX`),")
    w("/// sorted by value.")
    w("pub static DEVICE_ATTRIBUTES: &[(u32, &str)] = &[")
    for val, name in attrs:
        w(f"    ({val}, {rs_str(name)}),")
    w("];")
    w("")
    w("/// `CUresult` values.")
    w("pub mod result {")
    for val, name, _ in errors:
        w(f"    pub const {name}: u32 = {val};")
    w("}")
    w("")
    return "\n".join(o)


def profiler_entry_points(inc: Path) -> list[tuple[str, int, bool, str]]:
    """The profiler control API (cuProfilerStart/Stop/Initialize), a separate header pair:
    cudaProfiler.h (not in the wheel) declares the functions, cudaProfilerTypedefs.h their
    PFN typedefs. Each has a single ABI version, exported under its plain name."""
    text = (inc / "cudaProfilerTypedefs.h").read_text(encoding="utf-8", errors="strict")
    rows, _ = parse_typedefs(text, unversioned=set())
    out = []
    for base, ver, pt in rows:
        if pt is not None or sum(1 for r in rows if r[0] == base) != 1:
            fail(f"cudaProfilerTypedefs.h: {base} has more than one ABI version; map it by hand")
        out.append((base, ver, False, base))
    if not out:
        fail("cudaProfilerTypedefs.h declares no entry points")
    return out


def generate(inc: Path) -> tuple[str, dict]:
    cuda_h = (inc / "cuda.h").read_text(encoding="utf-8", errors="strict")
    typedefs_h = (inc / "cudaTypedefs.h").read_text(encoding="utf-8", errors="strict")
    m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", cuda_h)
    if not m or int(m.group(1)) != CUDA_VERSION:
        fail(f"expected CUDA_VERSION {CUDA_VERSION}, headers say {m and m.group(1)}")

    base_defs = {"__GNUC__", "__LP64__"}
    app_syms, app_expand = declared_symbols(cuda_h, base_defs)
    drv_syms, _ = declared_symbols(cuda_h, base_defs | {"__CUDA_API_VERSION_INTERNAL"})
    symbols = app_syms | drv_syms

    typedefs, notes = parse_typedefs(typedefs_h)
    entries = build_entry_points(typedefs, symbols, app_expand, notes)
    entries = sorted(entries + profiler_entry_points(inc))
    errors = parse_errors(cuda_h)
    attrs, aliases = parse_device_attributes(cuda_h)
    used = {e[3] for e in entries}
    stats = {
        "entry points": len(entries),
        "per-thread rows": sum(1 for e in entries if e[2]),
        "distinct symbols": len(used),
        "errors": len(errors),
        "device attributes": len(attrs),
        "notes": notes,
        "attribute aliases skipped": aliases,
        "declared symbols without a typedef": sorted(symbols - used),
    }
    return render(entries, errors, attrs), stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--include", type=Path, help="directory holding cuda.h and cudaTypedefs.h")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="fail if --out differs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print header oddities")
    args = ap.parse_args()
    try:
        if args.include:
            text, stats = generate(args.include)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                text, stats = generate(fetch_headers(Path(tmp)))
    except GenError as exc:
        print(f"gen_cuda_abi: error: {exc}", file=sys.stderr)
        return 1
    for k, v in stats.items():
        if isinstance(v, list):
            if args.verbose:
                print(f"{k} ({len(v)}):", file=sys.stderr)
                for line in v:
                    print(f"  {line}", file=sys.stderr)
        else:
            print(f"{k}: {v}", file=sys.stderr)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"gen_cuda_abi: {args.out} is stale", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".rs.tmp")
    tmp_out.write_text(text)
    os.replace(tmp_out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
