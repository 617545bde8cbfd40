"""SASS of a compiled kernel, without a GPU: the kernel's code section cut out of the cubin and
disassembled by nvdisasm as raw instructions.

nvdisasm comes from the `nvidia-cuda-nvdisasm` wheel (`pip install 'mlagen[sass]'`), a CUDA
toolkit on PATH, or $MLAGEN_NVDISASM. It is fed the raw code section rather than the cubin,
since the NVRTC 13 cubins carry an ELF header revision that the matching nvdisasm refuses; raw
mode prints the same instructions, with branch targets as offsets.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import struct
import subprocess
import tempfile

from ..codegen.compiler import wheel_dirs

_ENV = "MLAGEN_NVDISASM"
_OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


class SassError(RuntimeError):
    """nvdisasm is missing or failed, or the cubin has no such kernel."""


def find_nvdisasm() -> str:
    """Path of nvdisasm: $MLAGEN_NVDISASM, the nvidia-cuda-nvdisasm wheel, or PATH."""
    candidates = [os.environ[_ENV]] if os.environ.get(_ENV) else []
    candidates += [os.path.join(d, "bin", "nvdisasm") for d in wheel_dirs("cu13", "cu12", "cuda_nvdisasm")]
    on_path = shutil.which("nvdisasm")
    if on_path:
        candidates.append(on_path)
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise SassError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or 'mlagen[sass]'), or set "
                    f"{_ENV} (looked in: {', '.join(candidates) or 'nowhere'})")


def kernel_code(cubin: bytes, kernel: str) -> bytes:
    """The machine code of `kernel`: the cubin's `.text.<kernel>` section (ELF64, little endian)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise SassError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i: int) -> tuple[int, int, int]:   # (name offset, file offset, size)
        name, _type, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize)
        return name, offset, size

    _, names_at, _ = section(shstrndx)
    wanted = f".text.{kernel}".encode()
    for i in range(shnum):
        name, offset, size = section(i)
        end = cubin.index(b"\0", names_at + name)
        if cubin[names_at + name:end] == wanted:
            return cubin[offset:offset + size]
    raise SassError(f"no code section for kernel {kernel!r} in the cubin")


def disassemble(cubin: bytes, kernel: str, arch: str) -> str:
    """The SASS of `kernel` (compiled for `arch`, e.g. "sm_90a"), one instruction per line."""
    code = kernel_code(cubin, kernel)
    target = "SM" + arch.removeprefix("sm_")
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(code)
        f.flush()
        run = subprocess.run([find_nvdisasm(), "--binary", target, f.name], capture_output=True, text=True)
    if run.returncode != 0:
        raise SassError(f"nvdisasm failed on {kernel} ({target}): {run.stderr.strip()[:500]}")
    return "\n".join(line for line in run.stdout.splitlines() if _OPCODE.search(line)) + "\n"


def opcodes(sass: str) -> collections.Counter:
    """Static instruction count per opcode (the part before the first dot: HGMMA, LDGSTS, ...)."""
    return collections.Counter(m.group(1) for m in map(_OPCODE.search, sass.splitlines()) if m)


_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*)")
_TARGET = re.compile(r"0x([0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(byte offset, opcode with its modifiers, operands) of each instruction of `disassemble`'s text."""
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(_LINE.search, sass.splitlines()) if m]


def tile_loop(sass: str) -> tuple[int, int] | None:
    """[start, end) in bytes of the kernel's tile loop: the narrowest backward branch whose range
    holds nine tenths of its matrix instructions (HGMMA, or HMMA on mma.sync); None without one."""
    code = instructions(sass)
    matrix = [a for a, op, _ in code if op.startswith(("HGMMA", "HMMA"))]
    loops = [(int(t.group(1), 16), a + 16) for a, op, rest in code if op.startswith("BRA")
             if (t := _TARGET.search(rest)) and int(t.group(1), 16) < a]
    held = [(lo, hi) for lo, hi in loops if matrix and 10 * sum(lo <= m < hi for m in matrix) >= 9 * len(matrix)]
    return min(held, key=lambda r: r[1] - r[0], default=None)
