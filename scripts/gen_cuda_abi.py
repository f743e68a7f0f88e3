#!/usr/bin/env python3
"""Generate cuda-abi/src/{generated,types,functions}.rs from the CUDA 12.9 driver API headers.

Usage:
    python3 scripts/gen_cuda_abi.py                 # pip-downloads the wheel
    python3 scripts/gen_cuda_abi.py --include DIR   # DIR holds cuda.h + cudaTypedefs.h
    python3 scripts/gen_cuda_abi.py --check         # fail if a generated file is stale

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

types.rs:
* every typedef of cuda.h, as an application sees it, plus those only the driver's
  own build sees (``CUdeviceptr_v1``, the ``_v1`` descriptors of the legacy ABIs):
  handles (``struct X_st *``) as ``*mut c_void``; each enum as ``c_uint``, or
  ``c_int`` if it has a negative value (gcc's choice); callbacks as
  ``Option<unsafe extern "C" fn(..)>``; scalars as the C types of std::ffi.
* every enumerator, and every ``#define (CU|CUDA)_*`` constant (typed by its cast,
  e.g. ``CU_STREAM_LEGACY: CUstream``; an integer literal as ``c_uint``, or
  ``c_int`` if negative).
* the records in STRUCTS, plus those passed by value or embedded in one, as
  ``#[repr(C)]`` structs with compile-time size/alignment/offset checks (LP64
  layout computed here); every other struct or union is only ever reached through
  a pointer, typed as a ``c_void`` pointer. LAYOUTS and CONSTANTS repeat the
  layouts and values for a test that compiles them against cuda.h with gcc.

functions.rs:
* ``PFN_<symbol>``: the function-pointer type of every exported symbol (every
  ``CUresult CUDAAPI cuX(..)`` of cuda.h in either configuration, and the
  profiler API), from its declaration; ``pfn::<symbol>`` is the same type by the
  symbol's own name, for macros. Every declaration of a symbol must agree, and
  every cudaTypedefs.h typedef must take the parameter types of the symbol it is
  mapped to (rule 5 below).

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
5. Cross-check: each ``PFN_cuX_vN`` typedef's parameter types, typedefs
   resolved, are those of cuda.h's declaration of the symbol it maps to.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import ChainMap, defaultdict
from pathlib import Path

WHEEL = "nvidia-cuda-runtime-cu12==12.9.79"
CUDA_VERSION = 12090
REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "cuda-abi" / "src"

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


def walk(text: str, defined: set[str]):
    """The active part of a header under one configuration, in order.

    Yields ``("code", line)`` for each active line outside directives,
    ``("define", name, params, body)`` (params None for an object-like macro)
    and ``("undef", name)`` for each active directive.
    """
    defined = set(defined)
    stack: list[tuple[bool, bool]] = []  # (active, any branch taken)

    def active() -> bool:
        return all(a for a, _ in stack)

    for line in join_continuations(strip_comments(text)):
        s = line.strip()
        if not s.startswith("#"):
            if active():
                yield ("code", line)
            continue
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
            defined.add(m.group(1))
            yield ("define", m.group(1), m.group(2), m.group(3).strip())
        elif kw == "undef":
            defined.discard(rest)
            yield ("undef", rest)
    if stack:
        fail("unbalanced #if")


def balanced(text: str, start: int) -> str:
    """The text from ``start`` (just after an opening parenthesis) to its closing one."""
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[start:i]
    fail(f"unbalanced parentheses after {text[max(0, start - 40):start]!r}")
    return ""


def declared_symbols(cuda_h: str, defined: set[str]):
    """Symbols declared by cuda.h under one configuration.

    Returns (symbols, expand, decls) where ``expand(name)`` applies the
    function-name macros still in force at the end of the file (what a caller's
    ``name(...)`` compiles to) and ``decls`` maps each symbol to the parameter
    lists it is declared with (the text between the parentheses).
    """
    pt_suffix = None  # resolved once __CUDA_API_PTDS is defined
    macros: dict[str, str] = {}
    symbols: set[str] = set()
    decls: dict[str, list[str]] = defaultdict(list)
    pending: list[str] = []

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
            sym = expand(m.group(1))
            symbols.add(sym)
            decls[sym].append(balanced(chunk, m.end()))

    for event in walk(cuda_h, defined):
        if event[0] == "code":
            pending.append(event[1])
            continue
        flush()
        if event[0] == "define":
            _, name, params, body = event
            if name == "__CUDA_API_PTDS":
                pt_suffix = "##" in body
            elif params is None and re.fullmatch(r"cu\w+", name):
                macros[name] = body
        else:
            macros.pop(event[1], None)
    flush()
    return symbols, expand, decls


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
# C types: cuda.h's typedefs, records, enums and constants, and their Rust form
# ---------------------------------------------------------------------------

# Records laid out in Rust (`#[repr(C)]` structs, with layout checks), by typedef
# name, each with the code that reads its fields. Records passed by value to a
# function, or embedded in one of these, are added to them; every other record is
# reached only through pointers, which are typed `c_void` pointers.
STRUCTS = {
    "CUlaunchConfig": "hook (the stream of cuLaunchKernelEx) and simulator",
    "CUDA_LAUNCH_PARAMS": "simulator (cuLaunchCooperativeKernelMultiDevice)",
    "CUDA_KERNEL_NODE_PARAMS_v1": "simulator (kernel graph nodes, legacy ABI)",
    "CUDA_KERNEL_NODE_PARAMS": "simulator (kernel graph nodes)",
    "CUDA_MEMSET_NODE_PARAMS": "simulator (memset graph nodes)",
    "CUDA_HOST_NODE_PARAMS": "simulator (host graph nodes)",
    "CUDA_GRAPH_INSTANTIATE_PARAMS": "simulator (cuGraphInstantiateWithParams)",
    "CUDA_ARRAY_DESCRIPTOR": "hook and simulator (array sizes, cuda-abi arrays.rs)",
    "CUDA_ARRAY3D_DESCRIPTOR": "hook and simulator (array sizes, cuda-abi arrays.rs)",
    "CUmemAllocationProp": "hook and simulator (cuMemCreate: where the memory lives)",
    "CUmemLocation": "hook and simulator",
    "CUmemPoolProps": "simulator (cuMemPoolCreate: where the pool lives)",
    "CUDA_MEMCPY2D": "simulator (cuMemcpy2D*: both sides of a 2D copy)",
    "CUuuid": "hook and simulator (device UUIDs, export tables)",
    "CUcheckpointLockArgs": "simulator (cuCheckpointProcessLock: the timeout, reserved fields)",
    "CUcheckpointCheckpointArgs": "simulator (cuCheckpointProcessCheckpoint: reserved fields)",
    "CUcheckpointRestoreArgs": "simulator (cuCheckpointProcessRestore: reserved fields)",
    "CUcheckpointUnlockArgs": "simulator (cuCheckpointProcessUnlock: reserved fields)",
}

# Declarations the wheel's headers use but do not contain, as C text, each
# justified. cudaProfilerTypedefs.h includes cudaProfiler.h, which the wheel does
# not ship; this is its declaration of the one type the typedefs need.
EXTRA_C_DECLARATIONS = """
typedef enum CUoutput_mode_enum {
    CU_OUT_KEY_VALUE_PAIR = 0x00,
    CU_OUT_CSV            = 0x01
} CUoutput_mode;
"""

# `#define (CU|CUDA)_*` macros of cuda.h that are not constants: the calling
# convention (empty here) and an include guard.
NOT_CONSTANTS = {"CUDA_CB", "CU_UUID_HAS_BEEN_DEFINED"}

C_KEYWORDS = {"void", "char", "short", "int", "long", "signed", "unsigned", "float", "double"}

# C's and <stddef.h>/<stdint.h>'s types: Rust type, size, alignment (LP64: x86_64, aarch64).
PRIMS = {
    "void": ("c_void", None, None),
    "char": ("c_char", 1, 1),
    "signed char": ("c_schar", 1, 1),
    "unsigned char": ("c_uchar", 1, 1),
    "short": ("c_short", 2, 2),
    "unsigned short": ("c_ushort", 2, 2),
    "int": ("c_int", 4, 4),
    "unsigned int": ("c_uint", 4, 4),
    "long": ("c_long", 8, 8),
    "unsigned long": ("c_ulong", 8, 8),
    "long long": ("c_longlong", 8, 8),
    "unsigned long long": ("c_ulonglong", 8, 8),
    "float": ("f32", 4, 4),
    "double": ("f64", 8, 8),
    "size_t": ("usize", 8, 8),
    "int8_t": ("i8", 1, 1),
    "uint8_t": ("u8", 1, 1),
    "int16_t": ("i16", 2, 2),
    "uint16_t": ("u16", 2, 2),
    "int32_t": ("i32", 4, 4),
    "uint32_t": ("u32", 4, 4),
    "int64_t": ("i64", 8, 8),
    "uint64_t": ("u64", 8, 8),
}

RUST_KEYWORDS = {
    "as", "break", "const", "continue", "crate", "else", "enum", "extern", "false", "fn", "for",
    "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return",
    "self", "Self", "static", "struct", "super", "trait", "true", "type", "unsafe", "use",
    "where", "while", "async", "await", "dyn", "abstract", "become", "box", "do", "final",
    "macro", "override", "priv", "typeof", "unsized", "virtual", "yield", "try", "gen",
}

TOKEN_RE = re.compile(r'"(?:\\.|[^"\\])*"|[A-Za-z_]\w*|0[xX][0-9a-fA-F]+[uUlL]*|\d+[uUlL]*|<<|>>|\.\.\.|\S')


def rust_ident(name: str) -> str:
    return name + "_" if name in RUST_KEYWORDS else name


def tokenize(text: str) -> list[str]:
    return TOKEN_RE.findall(text)


def split_top(tokens: list[str], sep: str) -> list[list[str]]:
    """Split at ``sep`` outside parentheses, brackets and braces."""
    out, cur, depth = [], [], 0
    for t in tokens:
        if t in "([{" and len(t) == 1:
            depth += 1
        elif t in ")]}" and len(t) == 1:
            depth -= 1
        if t == sep and depth == 0:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    if depth:
        fail(f"unbalanced: {' '.join(tokens[:20])}")
    out.append(cur)
    return out


def matching(tokens: list[str], i: int) -> int:
    """Index of the bracket closing the one at ``tokens[i]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    open_, close, depth = tokens[i], pairs[tokens[i]], 0
    for j in range(i, len(tokens)):
        if tokens[j] == open_:
            depth += 1
        elif tokens[j] == close:
            depth -= 1
            if depth == 0:
                return j
    fail(f"unbalanced {open_} in {' '.join(tokens[i:i + 20])}")
    return -1


def c_eval(tokens: list[str], env: dict[str, int]) -> int:
    """Value of an integer constant expression (literals, names in ``env``, + - * << >> | & ^ ~)."""
    expr = " ".join(re.sub(r"^(0[xX][0-9a-fA-F]+|\d+)[uUlL]+$", r"\1", t) for t in tokens)
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        fail(f"not a constant expression: {expr!r}")
    ops = {
        ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
        ast.BitOr: lambda a, b: a | b, ast.BitAnd: lambda a, b: a & b, ast.BitXor: lambda a, b: a ^ b,
    }

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in env:
                fail(f"unknown name {n.id} in {expr!r}")
            return env[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.UAdd):
            return ev(n.operand)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Invert):
            return ~ev(n.operand)
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.left), ev(n.right))
        fail(f"not a constant expression: {expr!r}")

    return ev(tree)


def prim_key(words: list[str]) -> str:
    unsigned, signed = "unsigned" in words, "signed" in words
    longs = words.count("long")
    rest = [w for w in words if w not in ("unsigned", "signed", "long", "int")]
    if not rest:
        base = ("int", "long", "long long")[longs]
    elif rest == ["short"] and longs == 0:
        base = "short"
    elif rest == ["char"] and longs == 0 and "int" not in words:
        base = "char"
    elif rest in (["float"], ["double"], ["void"]) and len(words) == 1:
        return rest[0]
    else:
        fail(f"unknown C type {' '.join(words)!r}")
    if unsigned:
        return "unsigned " + base
    return "signed char" if signed and base == "char" else base


class CTypes:
    """The typedefs, records, enums and constants of a header (one configuration)."""

    def __init__(self) -> None:
        self.typedefs: dict[str, tuple] = {}  # name -> definition, in header order
        self.records: dict[str, tuple] = {}  # tag -> (kind, body tokens or None)
        self.enums: dict[str, list[tuple[str, int]]] = {}  # typedef name -> enumerators
        self.enum_signed: dict[str, bool] = {}
        self.enum_tags: dict[str, str] = {}  # enum tag -> typedef name
        self.values: dict[str, int] = {}  # enumerators and integer macros
        self.macros: dict[str, str] = {}  # active object-like macros (first definition)
        self.macro_order: list[str] = []
        self.macro_values: dict[str, int] = {}  # integer-literal macros
        self.anon = 0
        self.internal_enums: set[str] = set()  # enums only the driver's own build sees

    # --- reading -----------------------------------------------------------

    def read(self, text: str, defined: set[str]) -> None:
        function_macros: dict[str, tuple[str, str]] = {}
        code: list[str] = []

        def flush() -> None:
            toks = tokenize("\n".join(code))
            code.clear()
            self.statements(toks)

        for event in walk(text, defined):
            if event[0] == "code":
                line = event[1]
                if "_CONCAT_OUTER" in line:
                    line = self.concat(line, function_macros)
                code.append(line)
                continue
            if event[0] == "define":
                _, name, params, body = event
                if params is not None:
                    function_macros[name] = (params, body)
                elif name not in self.macros:
                    self.macros[name] = body
                    self.macro_order.append(name)
                    if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)[uUlL]*", body):
                        self.macro_values[name] = c_eval(tokenize(body), {})
                elif self.macros[name] != body and re.fullmatch(r"(CU|CUDA)_\w+", name):
                    fail(f"#define {name} redefined: {self.macros[name]!r}, {body!r}")
            else:
                function_macros.pop(event[1], None)
        flush()

    def concat(self, line: str, function_macros) -> str:
        """cuda.h names CUdevResource_v<RESOURCE_ABI_VERSION> with a token-pasting macro."""
        if function_macros.get("_CONCAT_OUTER") != ("(x, y)", "_CONCAT_INNER(x, y)") or \
                function_macros.get("_CONCAT_INNER") != ("(x, y)", "x ## y"):
            fail("_CONCAT_OUTER is not the token-pasting macro it was")

        def paste(m):
            arg = m.group(2)
            return m.group(1) + self.macros.get(arg, arg)

        return re.sub(r"_CONCAT_OUTER\(\s*(\w+)\s*,\s*(\w+)\s*\)", paste, line)

    def drop_attributes(self, toks: list[str]) -> list[str]:
        """Drop calling-convention and attribute macros (empty, or __attribute__((..)))."""
        out = []
        for t in toks:
            body = self.macros.get(t)
            if body is not None and (body == "" or body.startswith("__attribute__")):
                continue
            out.append(t)
        return out

    def statements(self, toks: list[str]) -> None:
        for stmt in split_top(self.drop_attributes(toks), ";"):
            if stmt:
                self.statement(stmt)

    def statement(self, s: list[str]) -> None:
        if len(s) > 2 and s[0] == "CUresult" and re.fullmatch(r"cu\w+", s[1]) and s[2] == "(":
            return  # a function declaration: see declared_symbols
        if s[0] in ("struct", "union") and "{" in s[:3] and s[-1] == "}":
            self.record(s)
            return
        if s[0] != "typedef":
            fail(f"unrecognised declaration: {' '.join(s[:16])}")
        s = s[1:]
        if s[0] == "enum":
            i = s.index("{")
            j = matching(s, i)
            if j + 2 != len(s):
                fail(f"unrecognised enum typedef: {' '.join(s[:16])}")
            self.enum(s[j + 1], s[i + 1:j], s[1] if i == 2 else None)
        elif s[0] in ("struct", "union") and "{" in s[:3]:
            i = s.index("{")
            j = matching(s, i)
            tag = s[1] if i == 2 else None
            tag = self.record(s[:j + 1], tag)
            for decl in split_top(s[j + 1:], ","):
                ct, name = self.declarator(("rec", s[0], tag), False, decl)
                self.define(name, ("alias", ct))
        elif "(" in s:
            # typedef R (*Name)(params);
            i = s.index("(")
            j = matching(s, i)
            inner = s[i + 1:j]
            if len(inner) != 2 or inner[0] != "*" or s[j + 1] != "(" or matching(s, j + 1) != len(s) - 1:
                fail(f"unrecognised typedef: {' '.join(s[:16])}")
            ret, _ = self.decl(s[:i], named=False)
            self.define(inner[1], ("fn", ret, self.params(s[j + 2:-1])))
        else:
            ct, name = self.decl(s)
            if name is None:
                fail(f"typedef without a name: {' '.join(s)}")
            self.define(name, ("alias", ct))

    def define(self, name: str, definition: tuple) -> None:
        if name in self.typedefs and self.typedefs[name] != definition:
            fail(f"typedef {name} defined twice, differently")
        self.typedefs[name] = definition

    def record(self, s: list[str], tag: str | None = None) -> str:
        """Record a struct/union definition ``struct [tag] { .. }``; returns its tag."""
        i = s.index("{")
        if tag is None:
            if i == 2:
                tag = s[1]
            else:
                self.anon += 1
                tag = f"<anonymous {self.anon}>"
        body = s[i + 1:matching(s, i)]
        old = self.records.get(tag)
        if old is not None and old[1] is not None and old != (s[0], body):
            fail(f"{s[0]} {tag} defined twice, differently")
        self.records[tag] = (s[0], body)
        return tag

    def enum(self, name: str, body: list[str], tag: str | None) -> None:
        items = []
        prev = -1
        for item in split_top(body, ","):
            if not item:
                continue
            if len(item) == 1:
                val = prev + 1
            elif item[1] == "=":
                val = c_eval(item[2:], self.int_macros())
            else:
                fail(f"enum {name}: unrecognised enumerator {' '.join(item)}")
            if item[0] in self.values and self.values[item[0]] != val:
                fail(f"enumerator {item[0]} defined twice, differently")
            self.values[item[0]] = val
            items.append((item[0], val))
            prev = val
        vals = [v for _, v in items]
        signed = bool(vals) and min(vals) < 0
        lo, hi = (-(1 << 31), (1 << 31) - 1) if signed else (0, (1 << 32) - 1)
        if any(not lo <= v <= hi for v in vals):
            fail(f"enum {name} does not fit an int")
        if name in self.enums and self.enums[name] != items:
            fail(f"enum {name} defined twice, differently")
        self.enums[name] = items
        self.enum_signed[name] = signed
        if tag is not None:
            self.enum_tags[tag] = name
        self.define(name, ("enum",))

    # --- declarations ------------------------------------------------------

    def decl(self, toks: list[str], named: bool = True) -> tuple[tuple, str | None]:
        """Type and name of one declaration, e.g. ``const CUgraphNode *dependencies``."""
        i, const, words = 0, False, []
        while i < len(toks) and toks[i] not in ("*", "[", "("):
            t = toks[i]
            if t == "const":
                const = True
            elif t in ("struct", "union", "enum"):
                words.append((t, toks[i + 1]))
                i += 1
            elif t == "volatile":
                fail(f"volatile in {' '.join(toks)}")
            else:
                words.append(t)
            i += 1
        name = None
        if named and "*" not in toks[i:] and len(words) >= 2 \
                and isinstance(words[-1], str) and words[-1] not in C_KEYWORDS:
            name = words.pop()
        if not words:
            fail(f"no type in {' '.join(toks)}")
        if any(isinstance(w, tuple) for w in words):
            if len(words) != 1:
                fail(f"unrecognised type {' '.join(toks)}")
            kind, tag = words[0]
            base = ("enumtag", tag) if kind == "enum" else ("rec", kind, tag)
        elif all(w in C_KEYWORDS for w in words):
            base = ("prim", prim_key(words))
        elif len(words) == 1:
            base = ("prim", words[0]) if words[0] in PRIMS else ("name", words[0])
        else:
            fail(f"unrecognised type {' '.join(toks)}")
        ct, rest_name = self.declarator(base, const, toks[i:], named and name is None)
        return ct, name or rest_name

    def declarator(self, base: tuple, const: bool, toks: list[str], named: bool = True):
        """Apply ``* [const] ... [name] [N]...`` to ``base``."""
        ct, pointee_const, i = base, const, 0
        while i < len(toks) and toks[i] == "*":
            ct = ("ptr", ct, pointee_const)
            pointee_const = False
            i += 1
            while i < len(toks) and toks[i] == "const":
                pointee_const = True
                i += 1
        name = None
        if named and i < len(toks) and re.fullmatch(r"[A-Za-z_]\w*", toks[i]):
            name = toks[i]
            i += 1
        dims = []
        while i < len(toks) and toks[i] == "[":
            j = matching(toks, i)
            dims.append(c_eval(toks[i + 1:j], self.int_macros()))
            i = j + 1
        for n in reversed(dims):
            ct = ("array", ct, n)
        if i != len(toks):
            fail(f"unrecognised declarator {' '.join(toks)}")
        return ct, name

    def params(self, toks: list[str]) -> list[tuple[tuple, str | None]]:
        if toks == ["void"] or not toks:
            return []
        out = []
        for p in split_top(toks, ","):
            if p == ["..."]:
                fail("variadic function")
            ct, name = self.decl(p)
            if ct[0] == "array":
                fail(f"array parameter {' '.join(p)}")
            out.append((ct, name))
        return out

    def int_macros(self) -> ChainMap:
        """Names with integer values: enumerators, then integer-literal macros."""
        return ChainMap(self.values, self.macro_values)

    def merge(self, other: "CTypes") -> list[str]:
        """Add ``other``'s definitions missing here (this configuration's win)."""
        notes = []
        for name, d in other.typedefs.items():
            if name not in self.typedefs:
                self.typedefs[name] = d
                if name in other.enums:
                    self.enums[name] = other.enums[name]
                    self.enum_signed[name] = other.enum_signed[name]
                    self.internal_enums.add(name)
                notes.append(f"typedef {name} only in the driver's own configuration")
        for tag, name in other.enum_tags.items():
            self.enum_tags.setdefault(tag, name)
        for tag, r in other.records.items():
            if tag not in self.records or self.records[tag][1] is None:
                self.records[tag] = r
        return notes

    # --- resolution --------------------------------------------------------

    def resolve(self, ct: tuple) -> tuple:
        """Follow typedef aliases: a prim, ptr, array, rec, enum or fn type."""
        seen = set()
        while ct[0] == "name":
            name = ct[1]
            if name in seen or name not in self.typedefs:
                fail(f"unknown type {name}")
            seen.add(name)
            d = self.typedefs[name]
            if d[0] == "alias":
                ct = d[1]
            elif d[0] == "enum":
                return ("enum", name)
            else:
                return ("fn", name)
        if ct[0] == "enumtag":
            if ct[1] not in self.enum_tags:
                fail(f"enum tag {ct[1]} without a typedef")
            return ("enum", self.enum_tags[ct[1]])
        return ct

    def canon(self, ct: tuple) -> str:
        """A type with every typedef resolved, for comparing declarations."""
        ct = self.resolve(ct)
        if ct[0] == "prim":
            return PRIMS[ct[1]][0]
        if ct[0] == "ptr":
            return ("*const " if ct[2] else "*mut ") + self.canon(ct[1])
        if ct[0] == "array":
            return f"[{self.canon(ct[1])}; {ct[2]}]"
        if ct[0] == "rec":
            return f"{ct[1]} {ct[2]}"
        if ct[0] == "enum":
            return "c_int" if self.enum_signed[ct[1]] else "c_uint"
        _, ret, params = self.typedefs[ct[1]]
        return "fn(" + ", ".join(self.canon(p) for p, _ in params) + ") -> " + self.canon(ret)

    def record_of(self, ct: tuple) -> str | None:
        """The record tag of a by-value record type, else None."""
        r = self.resolve(ct)
        return r[2] if r[0] == "rec" else None


class Layout:
    """Which records are laid out in Rust, their Rust names, sizes and offsets."""

    def __init__(self, types: CTypes, roots: set[str], readers: dict[str, str]) -> None:
        self.t = types
        self.readers = readers  # tag -> the code that reads its fields (STRUCTS)
        self.names: dict[str, str] = {}  # tag -> Rust name
        self.order: list[str] = []
        self.parent: dict[str, tuple[str, str]] = {}  # anonymous nested tag -> (outer tag, field)
        self.fields: dict[str, list[tuple[str, tuple]]] = {}
        for tag in sorted(roots):
            self.add(tag)

    def add(self, tag: str, name: str | None = None) -> None:
        if tag in self.names:
            return
        kind, body = self.t.records.get(tag, (None, None))
        if body is None:
            fail(f"record {tag} is needed by value but cuda.h does not define it")
        if kind != "struct":
            fail(f"{kind} {tag} is needed by value: unions are not laid out here")
        if name is None:
            name = self.rust_name(tag)
        self.names[tag] = name
        self.order.append(tag)
        fields = []
        for member in split_top(body, ";"):
            if not member:
                continue
            if member[0] in ("struct", "union") and "{" in member[:3]:
                i = member.index("{")
                j = matching(member, i)
                if len(member) != j + 2:
                    fail(f"{tag}: unnamed or multiple nested members")
                field = member[j + 1]
                inner = self.t.record(member[:j + 1]) if i == 1 else member[1]
                if i == 2:
                    self.t.record(member[:j + 1])
                self.parent[inner] = (tag, field)
                self.add(inner, f"{name}_{field}")
                fields.append((field, ("rec", member[0], inner)))
                continue
            if len(split_top(member, ",")) != 1:
                fail(f"{tag}: several declarators in one member")
            ct, field = self.t.decl(member)
            if field is None:
                fail(f"{tag}: unnamed member {' '.join(member)}")
            fields.append((field, ct))
            self.embed(ct)
        self.fields[tag] = fields

    def embed(self, ct: tuple) -> None:
        r = self.t.resolve(ct)
        while r[0] == "array":
            r = self.t.resolve(r[1])
        if r[0] == "rec":
            self.add(r[2])

    def rust_name(self, tag: str) -> str:
        """The first typedef naming the record itself."""
        for name, d in self.t.typedefs.items():
            if d == ("alias", ("rec", "struct", tag)):
                return name
        return tag

    def generated(self, tag: str) -> bool:
        return tag in self.names

    def size_align(self, ct: tuple) -> tuple[int, int]:
        r = self.t.resolve(ct)
        if r[0] == "prim":
            _, size, align = PRIMS[r[1]]
            if size is None:
                fail("void has no size")
            return size, align
        if r[0] in ("ptr", "fn"):
            return 8, 8
        if r[0] == "enum":
            return 4, 4
        if r[0] == "array":
            size, align = self.size_align(r[1])
            return size * r[2], align
        size, align, _ = self.record_layout(r[2])
        return size, align

    def record_layout(self, tag: str) -> tuple[int, int, list[tuple[str, int]]]:
        off, align, offsets = 0, 1, []
        for field, ct in self.fields[tag]:
            s, a = self.size_align(ct)
            off = (off + a - 1) // a * a
            offsets.append((field, off))
            off += s
            align = max(align, a)
        return (off + align - 1) // align * align, align, offsets


# ---------------------------------------------------------------------------
# Function signatures
# ---------------------------------------------------------------------------


def read_types(cuda_h: str, base_defs: set[str]) -> tuple[CTypes, list[str]]:
    """cuda.h's types as an application sees them, plus those only the driver's
    own build (``__CUDA_API_VERSION_INTERNAL``) declares, used by legacy ABIs."""
    app = CTypes()
    app.read(cuda_h, base_defs)
    app.read(EXTRA_C_DECLARATIONS, set())
    drv = CTypes()
    drv.read(cuda_h, base_defs | {"__CUDA_API_VERSION_INTERNAL"})
    return app, app.merge(drv)


def parse_params(t: CTypes, text: str) -> list[tuple[tuple, str | None]]:
    return t.params(t.drop_attributes(tokenize(text)))


def signatures(t: CTypes, decls: dict[str, list[str]], extra: dict[str, str]):
    """symbol -> (C parameter text, parsed parameters): cuda.h's declarations, every
    declaration of a symbol the same after typedefs are resolved."""
    out = {}
    for sym in sorted(set(decls) | set(extra)):
        texts = decls.get(sym) or [extra[sym]]
        parsed = [parse_params(t, x) for x in texts]
        canon = {tuple(t.canon(ct) for ct, _ in p) for p in parsed}
        if len(canon) != 1:
            fail(f"{sym} is declared with different parameter types: {texts}")
        out[sym] = (" ".join(texts[0].split()), parsed[0])
    return out


def typedef_params(text: str) -> dict[str, str]:
    """``PFN_<name>`` typedef name (without PFN_) -> its parameter text."""
    clean = strip_comments(text)
    return {m.group(1): balanced(clean, clean.index("(", m.end() - 1) + 1)
            for m in TYPEDEF_RE.finditer(clean)}


def check_typedef_signatures(t: CTypes, entries, sigs, pfn_params: dict[str, str]) -> int:
    """Each cudaTypedefs.h typedef names the same parameter types as cuda.h's
    declaration of the symbol it is mapped to. Returns the number checked."""
    checked = 0
    for name, ver, pt, sym in entries:
        cands = [f"{name}_v{ver}_ptsz", f"{name}_v{ver}_ptds"] if pt else [f"{name}_v{ver}", name]
        typedef = next((c for c in cands if c in pfn_params), None)
        if typedef is None:
            if (name, ver, pt) in EXTRA_ROWS:
                continue
            fail(f"no typedef for {name} v{ver}")
        theirs = [t.canon(ct) for ct, _ in parse_params(t, pfn_params[typedef])]
        mine = [t.canon(ct) for ct, _ in sigs[sym][1]]
        if theirs != mine:
            fail(f"PFN_{typedef} takes ({', '.join(theirs)}) but cuda.h declares {sym}({', '.join(mine)})")
        checked += 1
    return checked


# ---------------------------------------------------------------------------
# Rust rendering of types and functions
# ---------------------------------------------------------------------------


class Rust:
    def __init__(self, t: CTypes, lay: Layout) -> None:
        self.t, self.lay = t, lay

    def emitted(self, name: str) -> bool:
        """Whether typedef ``name`` is a Rust type (records not laid out here are not)."""
        r = self.t.resolve(("name", name))
        return r[0] != "rec" or self.lay.generated(r[2])

    def ty(self, ct: tuple, behind_ptr: bool = False) -> str:
        kind = ct[0]
        if kind == "prim":
            r = PRIMS[ct[1]][0]
            if r == "c_void" and not behind_ptr:
                fail("void by value")
            return r
        if kind == "name":
            if self.emitted(ct[1]):
                return ct[1]
        elif kind == "enumtag":
            return self.t.resolve(ct)[1]
        elif kind == "rec":
            if self.lay.generated(ct[2]):
                return self.lay.names[ct[2]]
        elif kind == "ptr":
            return ("*const " if ct[2] else "*mut ") + self.ty(ct[1], True)
        elif kind == "array":
            return f"[{self.ty(ct[1])}; {ct[2]}]"
        if behind_ptr:
            return "c_void"  # a record not laid out here
        fail(f"record {ct} by value is not laid out")
        return ""

    def fn(self, params, ret: tuple | None, opt: bool) -> str:
        args = ", ".join((f"{rust_ident(n)}: " if n else "") + self.ty(ct) for ct, n in params)
        r = "" if ret is None or ret == ("prim", "void") else f" -> {self.ty(ret)}"
        f = f'unsafe extern "C" fn({args}){r}'
        return f"Option<{f}>" if opt else f


def int_type(v: int) -> str:
    if 0 <= v < 1 << 32:
        return "c_uint"
    if -(1 << 31) <= v < 0:
        return "c_int"
    if 0 <= v < 1 << 64:
        return "c_ulonglong"
    fail(f"constant {v} fits no C integer type")
    return ""


def fits(v: int, rust: str) -> bool:
    bits = {"c_char": 8, "c_schar": 8, "c_uchar": 8, "c_short": 16, "c_ushort": 16, "c_int": 32,
            "c_uint": 32, "c_long": 64, "c_ulong": 64, "c_longlong": 64, "c_ulonglong": 64,
            "usize": 64, "u32": 32, "u64": 64, "i32": 32, "i64": 64}[rust]
    signed = not (rust.startswith("c_u") or rust.startswith("u"))
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return lo <= v <= hi


def constants(t: CTypes, rs: Rust) -> list[tuple[str, str, str, int, bool]]:
    """Every enumerator and ``#define (CU|CUDA)_*`` constant of cuda.h:
    (name, Rust type, Rust value, value, pointer?), enumerators first."""
    out = []
    enum_of = {}
    for name, items in t.enums.items():
        for item, v in items:
            enum_of[item] = name
            out.append((item, name, str(v), v, False))
    types = {c[0]: c[1] for c in out}
    values = ChainMap(t.values, t.macro_values)
    for name in t.macro_order:
        if not re.fullmatch(r"(CU|CUDA)_\w+", name) or name in NOT_CONSTANTS:
            continue
        body = t.macros[name]
        cast = re.fullmatch(r"\(\(\s*(\w+)\s*(\*?)\s*\)\s*(.+?)\s*\)", body)
        if cast:
            ct, _ = t.decl(tokenize(cast.group(1) + cast.group(2)), named=False)
            v = c_eval(tokenize(cast.group(3)), values)
            rty = rs.ty(ct)
            r = t.resolve(ct)
            if r[0] == "ptr":
                if v < 0:
                    fail(f"{name}: negative pointer")
                out.append((name, rty, f"std::ptr::without_provenance_mut({v:#x})", v, True))
            elif r[0] in ("prim", "enum"):
                if not fits(v, t.canon(ct)):
                    fail(f"{name} = {v} does not fit {rty}")
                out.append((name, rty, str(v), v, False))
            else:
                fail(f"{name}: cast to {rty}")
        elif body in types:
            out.append((name, types[body], body, next(c[3] for c in out if c[0] == body), False))
        else:
            v = c_eval(tokenize(body), values)
            out.append((name, int_type(v), str(v), v, False))
        types[name] = out[-1][1]
    seen = set()
    for c in out:
        if c[0] in seen:
            fail(f"constant {c[0]} twice")
        seen.add(c[0])
    return out


def header(what: str) -> list[str]:
    return [
        "// @generated by scripts/gen_cuda_abi.py from the CUDA 12.9 driver API headers",
        f"// (cuda.h of the PyPI wheel {WHEEL}): {what}.",
        "// Do not edit by hand. Regenerate with:",
        "//     python3 scripts/gen_cuda_abi.py [--include DIR_WITH_CUDA_H]",
        "",
    ]


def render_types(t: CTypes, lay: Layout, rs: Rust, consts) -> str:
    o = header("types, records and constants")
    w = o.append
    w("#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]")
    w("")
    w("pub use std::ffi::{")
    w("    c_char, c_int, c_long, c_longlong, c_schar, c_short, c_uchar, c_uint, c_ulong, c_ulonglong,")
    w("    c_ushort, c_void,")
    w("};")
    w("")
    w("/// The `CUresult` values (`CUDA_SUCCESS`, `CUDA_ERROR_*`).")
    w("pub use crate::generated::result::*;")
    w("")
    w("// --- typedefs, in header order -----------------------------------------------------------")
    w("//")
    w("// Handles (`struct X_st *`) are `*mut c_void`; an enum is `c_uint` (`c_int` if it has a")
    w("// negative value), as gcc lays it out; a function pointer is an `Option` (it may be null);")
    w("// a struct or union not laid out below has no Rust type: pointers to it are `c_void`")
    w("// pointers.")
    w("")
    consts_by_enum = defaultdict(list)
    for c in consts:
        consts_by_enum[c[1]].append(c)
    for name, d in t.typedefs.items():
        if d[0] == "enum":
            signed = t.enum_signed[name]
            w(f"/// enum `{name}`.")
            w(f"pub type {name} = {'c_int' if signed else 'c_uint'};")
            if name == "CUresult":
                continue
            for c, _, val, _, _ in consts_by_enum[name]:
                if t.values.get(c) is not None or name in t.internal_enums:
                    w(f"pub const {c}: {name} = {val};")
            continue
        if d[0] == "fn":
            w(f"pub type {name} = {rs.fn(d[2], d[1], True)};")
            continue
        r = t.resolve(d[1])
        if r[0] == "rec" and (not lay.generated(r[2]) or lay.names[r[2]] == name):
            continue  # not laid out, or the record itself (below)
        w(f"pub type {name} = {rs.ty(d[1])};")
    w("")
    w("// --- constants: `#define (CU|CUDA)_*` -----------------------------------------------------")
    w("")
    for c, ty, val, _, _ in consts:
        if c in t.macros:
            w(f"pub const {c}: {ty} = {val};")
    w("")
    w("// --- records laid out in Rust (scripts/gen_cuda_abi.py STRUCTS), with their C layout ----")
    w("")
    for tag in sorted(lay.order, key=lambda g: lay.names[g]):
        name = lay.names[tag]
        size, align, offsets = lay.record_layout(tag)
        parent = lay.parent.get(tag)
        if parent:
            w(f"/// Member `{parent[1]}` of `{lay.names[parent[0]]}`.")
        else:
            w(f"/// `struct {tag}`; " + (f"read by the {lay.readers[tag]}." if tag in lay.readers
                                         else "passed by value, or part of a record that is."))
        w("#[repr(C)]")
        w("#[derive(Debug, Clone, Copy)]")
        w(f"pub struct {name} {{")
        for field, ct in lay.fields[tag]:
            w(f"    pub {rust_ident(field)}: {rs.ty(ct)},")
        w("}")
        w("")
        w("const _: () = {")
        w(f"    assert!(size_of::<{name}>() == {size});")
        w(f"    assert!(align_of::<{name}>() == {align});")
        for field, off in offsets:
            w(f"    assert!(core::mem::offset_of!({name}, {rust_ident(field)}) == {off});")
        w("};")
        w("")
    w("/// The layout of each record above as the generator computed it from cuda.h (C type,")
    w("/// size, alignment, member offsets; nested members by path), for a test to check against a")
    w("/// C compiler.")
    w("#[cfg(test)]")
    w("#[allow(clippy::type_complexity)]")
    w("pub(crate) static LAYOUTS: &[(&str, usize, usize, &[(&str, usize)])] = &[")
    for tag in sorted(lay.order, key=lambda g: lay.names[g]):
        if tag in lay.parent:
            continue
        name = lay.names[tag]
        size, align, _ = lay.record_layout(tag)
        w(f"    ({rs_str(name)}, {size}, {align}, &[")
        for path, off in flat_offsets(lay, tag):
            w(f"        ({rs_str(path)}, {off}),")
        w("    ]),")
    w("];")
    w("")
    w("/// Every constant above an application compiled against cuda.h sees: name, value, whether")
    w("/// it is a pointer; for a test to check against a C compiler.")
    w("#[cfg(test)]")
    w("pub(crate) static CONSTANTS: &[(&str, i128, bool)] = &[")
    app_visible = {c for n, items in t.enums.items() if n not in t.internal_enums and n != "CUoutput_mode"
                   for c, _ in items}
    for c, _, _, v, ptr in consts:
        if c in t.macros or c in app_visible:
            w(f"    ({rs_str(c)}, {v}, {'true' if ptr else 'false'}),")
    w("];")
    w("")
    return "\n".join(o)


def flat_offsets(lay: Layout, tag: str, prefix: str = "", base: int = 0):
    _, _, offsets = lay.record_layout(tag)
    for (field, ct), (_, off) in zip(lay.fields[tag], offsets):
        yield prefix + field, base + off
        r = lay.t.resolve(ct)
        if r[0] == "rec" and r[2] in lay.parent:
            yield from flat_offsets(lay, r[2], prefix + field + ".", base + off)


def render_functions(rs: Rust, sigs) -> str:
    o = header("one function-pointer type per exported driver symbol")
    w = o.append
    w("#![allow(non_camel_case_types, non_snake_case)]")
    w("")
    w("use crate::types::*;")
    w("")
    for sym, (text, params) in sigs.items():
        w(f"/// `{sym}({text})`")
        w(f"pub type PFN_{sym} = {rs.fn(params, ('name', 'CUresult'), False)};")
    w("")
    w("/// The `PFN_` types by symbol name (`pfn::cuMemAlloc_v2` is `PFN_cuMemAlloc_v2`), for")
    w("/// macros that have the symbol's name as an identifier.")
    w("pub mod pfn {")
    for sym in sigs:
        w(f"    pub type {sym} = super::PFN_{sym};")
    w("}")
    w("")
    return "\n".join(o)


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


def generate(inc: Path) -> tuple[dict[str, str], dict]:
    """The generated files (name under cuda-abi/src -> text) and statistics."""
    cuda_h = (inc / "cuda.h").read_text(encoding="utf-8", errors="strict")
    typedefs_h = (inc / "cudaTypedefs.h").read_text(encoding="utf-8", errors="strict")
    profiler_h = (inc / "cudaProfilerTypedefs.h").read_text(encoding="utf-8", errors="strict")
    m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", cuda_h)
    if not m or int(m.group(1)) != CUDA_VERSION:
        fail(f"expected CUDA_VERSION {CUDA_VERSION}, headers say {m and m.group(1)}")

    base_defs = {"__GNUC__", "__LP64__"}
    app_syms, app_expand, app_decls = declared_symbols(cuda_h, base_defs)
    drv_syms, _, drv_decls = declared_symbols(cuda_h, base_defs | {"__CUDA_API_VERSION_INTERNAL"})
    symbols = app_syms | drv_syms

    typedefs, notes = parse_typedefs(typedefs_h)
    entries = build_entry_points(typedefs, symbols, app_expand, notes)
    profiler = profiler_entry_points(inc)
    entries = sorted(entries + profiler)
    errors = parse_errors(cuda_h)
    attrs, aliases = parse_device_attributes(cuda_h)
    used = {e[3] for e in entries}

    # Types, and one signature per exported symbol.
    types, type_notes = read_types(cuda_h, base_defs)
    decls = defaultdict(list)
    for d in (app_decls, drv_decls):
        for sym, texts in d.items():
            decls[sym].extend(texts)
    pfn_params = typedef_params(typedefs_h) | typedef_params(profiler_h)
    extra = {sym: pfn_params[f"{name}_v{ver}"] for name, ver, _, sym in profiler}
    sigs = signatures(types, decls, extra)
    checked = check_typedef_signatures(types, entries, sigs, pfn_params)
    listed = {}
    for name, readers in STRUCTS.items():
        tag = types.record_of(("name", name))
        if tag is None:
            fail(f"STRUCTS entry {name} is not a struct")
        listed[tag] = readers
    by_value = {tag for _, params in sigs.values() for ct, _ in params
                if (tag := types.record_of(ct)) is not None}
    lay = Layout(types, set(listed) | by_value, listed)
    rs = Rust(types, lay)
    consts = constants(types, rs)

    stats = {
        "entry points": len(entries),
        "per-thread rows": sum(1 for e in entries if e[2]),
        "distinct symbols": len(used),
        "errors": len(errors),
        "device attributes": len(attrs),
        "function types": len(sigs),
        "typedef signatures checked": checked,
        "records laid out": len(lay.order),
        "constants": len(consts),
        "notes": notes + type_notes,
        "attribute aliases skipped": aliases,
        "declared symbols without a typedef": sorted(symbols - used),
        "records laid out as passed by value or embedded": sorted(
            lay.names[t] for t in lay.order if t not in listed),
    }
    files = {
        "generated.rs": render(entries, errors, attrs),
        "types.rs": render_types(types, lay, rs, consts),
        "functions.rs": render_functions(rs, sigs),
    }
    return files, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--include", type=Path, help="directory holding cuda.h and cudaTypedefs.h")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="fail if a generated file differs")
    ap.add_argument("-v", "--verbose", action="store_true", help="print header oddities")
    args = ap.parse_args()
    try:
        if args.include:
            files, stats = generate(args.include)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                files, stats = generate(fetch_headers(Path(tmp)))
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
        stale = [n for n, text in files.items()
                 if not (args.out_dir / n).exists() or (args.out_dir / n).read_text() != text]
        for n in stale:
            print(f"gen_cuda_abi: {args.out_dir / n} is stale", file=sys.stderr)
        return 1 if stale else 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for n, text in files.items():
        out = args.out_dir / n
        tmp_out = out.with_suffix(".rs.tmp")
        tmp_out.write_text(text)
        os.replace(tmp_out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
