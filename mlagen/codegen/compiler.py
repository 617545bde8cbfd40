"""Compilation: CUDA C++ source -> cubin through NVRTC (via CuPy), cached on disk.

The cache key covers everything that changes the binary: the source text, the options, the
NVRTC version, the arch and this module's format version. Entries are written under a
temporary name and moved into place, the metadata file last, so a reader sees a whole entry
or none; an entry whose cubin does not match its recorded hash is rebuilt. A per-entry file
lock keeps two processes from compiling the same thing twice.

NVRTC needs no GPU: every arch compiles on a CPU-only machine.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

CACHE_FORMAT = 1
_ENV_CACHE = "MLAGEN_CACHE_DIR"
_ENV_INCLUDE = "MLAGEN_CUDA_INCLUDE"
_ENV_LINEINFO = "MLAGEN_LINEINFO"


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds its log and where the source was written."""


@dataclass(frozen=True)
class Resources:
    """ptxas's report for one kernel."""

    registers: int
    shared_static: int
    stack_frame: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass(frozen=True)
class CompiledModule:
    cubin: bytes
    log: str
    resources: dict[str, Resources]
    key: str
    source_path: Path
    cached: bool


def cache_dir() -> Path:
    root = os.environ.get(_ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlagen"
    )
    return Path(root) / f"v{CACHE_FORMAT}"


@functools.lru_cache(maxsize=1)
def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except Exception as e:  # pragma: no cover - depends on the machine
        raise CompileError(
            "mlagen needs CuPy with NVRTC to compile kernels: pip install cupy-cuda13x "
            f"nvidia-cuda-nvrtc nvidia-cuda-runtime ({e})"
        ) from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def wheel_dirs(*subs: str) -> list[str]:
    """Candidate folders nvidia/<sub> of the CUDA pip wheels (nvidia-cuda-runtime and friends:
    the `nvidia` namespace package), in `subs` order; empty without the wheels."""
    try:
        import nvidia
    except ImportError:
        return []
    return [os.path.join(base, sub) for base in nvidia.__path__ for sub in subs]


@functools.lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """A folder holding cuda_bf16.h: $MLAGEN_CUDA_INCLUDE, the pip wheels, or a toolkit."""
    candidates: list[str] = []
    if os.environ.get(_ENV_INCLUDE):
        candidates.append(os.environ[_ENV_INCLUDE])
    candidates += [os.path.join(d, "include") for d in wheel_dirs("cu13", "cu12", "cuda_runtime")]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cuda_bf16.h")):
            return c
    raise CompileError(
        "cuda_bf16.h not found; pip install nvidia-cuda-runtime or set "
        f"{_ENV_INCLUDE} to a folder that holds it (looked in: {', '.join(candidates)})"
    )


def compile_options(arch: str) -> list[str]:
    opts = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--use_fast_math",
        "--ptxas-options=-v",
        f"-I{cuda_include_dir()}",
    ]
    if os.environ.get(_ENV_LINEINFO):
        opts.append("-lineinfo")
    return opts


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, Resources]:
    """Registers, static shared memory, stack and spills per kernel from ptxas's -v log."""
    out: dict[str, Resources] = {}
    current: str | None = None
    fields: dict[str, int] = {}
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current, fields = m.group(1), {}
        elif current is None:
            continue
        elif m := _STACK.search(line):
            fields.update(stack_frame=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif m := _USED.search(line):
            smem = _SMEM.search(line)
            out[current] = Resources(
                registers=int(m[1]),
                shared_static=int(smem[1]) if smem else 0,
                stack_frame=fields.get("stack_frame", 0),
                spill_stores=fields.get("spill_stores", 0),
                spill_loads=fields.get("spill_loads", 0),
            )
            current = None
    return out


def cache_key(source: str, arch: str, options: list[str]) -> str:
    blob = json.dumps(
        {"format": CACHE_FORMAT, "source": source, "arch": arch, "options": options,
         "nvrtc": list(nvrtc_version())},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load_entry(folder: Path, key: str) -> CompiledModule | None:
    meta_path, cubin_path = folder / f"{key}.json", folder / f"{key}.cubin"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("sha256") != hashlib.sha256(cubin).hexdigest():
        return None   # half-written or corrupted: rebuilt by the caller
    resources = {k: Resources(**v) for k, v in meta["resources"].items()}
    return CompiledModule(cubin=cubin, log=meta["log"], resources=resources, key=key,
                          source_path=folder / f"{key}.cu", cached=True)


def _run_nvrtc(source: str, name: str, options: list[str], source_path: Path) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError as e:
            log = nvrtc.getProgramLog(prog)
            raise CompileError(
                f"NVRTC failed to compile {name} ({e}).\nsource: {source_path}\n"
                f"options: {' '.join(options)}\n{log}"
            ) from None
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_source(source: str, name: str, arch: str, *, use_cache: bool = True) -> CompiledModule:
    """Compile `source` for `arch` (e.g. "sm_90") to a cubin, through the disk cache."""
    options = compile_options(arch)
    key = cache_key(source, arch, options)
    folder = cache_dir() / key[:2]
    folder.mkdir(parents=True, exist_ok=True)
    if use_cache and (hit := _load_entry(folder, key)):
        return hit
    source_path = folder / f"{key}.cu"
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if use_cache and (hit := _load_entry(folder, key)):   # another process built it meanwhile
            return hit
        _atomic_write(source_path, source.encode())
        cubin, log = _run_nvrtc(source, name, options, source_path)
        resources = parse_resources(log)
        _atomic_write(folder / f"{key}.cubin", cubin)
        meta = {"name": name, "arch": arch, "options": options, "log": log,
                "nvrtc": list(nvrtc_version()), "sha256": hashlib.sha256(cubin).hexdigest(),
                "resources": {k: asdict(v) for k, v in resources.items()}}
        _atomic_write(folder / f"{key}.json", json.dumps(meta, indent=1).encode())
    return CompiledModule(cubin=cubin, log=log, resources=resources, key=key,
                          source_path=source_path, cached=False)
