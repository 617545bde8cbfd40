"""Targets mlagen can compile for, and what each one allows."""

from __future__ import annotations

from dataclasses import dataclass

MAX_ACCUMULATORS = 128     # fp32 output accumulators per thread a kernel may hold (of 255 registers)
ACCUMULATOR_RESERVE = 64   # registers a thread needs beside them: scores, fragments, addresses
REGS_PER_SM = 65536        # 32-bit registers per SM, on every arch here


def accumulator_budget(warps: int) -> int:
    """fp32 output accumulators one thread of a `warps`-warp block may hold without spilling:
    MAX_ACCUMULATORS, less where the register file gives each thread fewer than that plus the
    reserve (16 warps: 512 threads of 128 registers, so 64; ptxas spills 60-1000 bytes a
    thread above it, in both tiled families)."""
    return min(MAX_ACCUMULATORS, REGS_PER_SM // (32 * warps) - ACCUMULATOR_RESERVE)


@dataclass(frozen=True)
class Arch:
    name: str             # "sm_90"
    capability: int       # 90
    smem_per_block: int   # largest dynamic shared memory a block may opt into, bytes
    smem_per_sm: int      # shared memory of one SM, bytes
    threads_per_sm: int
    regs_per_sm: int = REGS_PER_SM
    mma: bool = True      # mma.sync m16n8k16 with bf16/fp16 inputs

    def blocks_per_sm(self, threads: int, smem: int, registers: int) -> int:
        """Blocks of a kernel that fit on one SM at once (1 KB of shared memory per block is
        reserved by the hardware)."""
        by_smem = self.smem_per_sm // (smem + 1024)
        by_threads = self.threads_per_sm // threads
        by_regs = self.regs_per_sm // max(1, registers * threads)
        return max(1, min(by_smem, by_threads, by_regs))


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 80, 163 * 1024, 164 * 1024, 2048),
        Arch("sm_86", 86, 99 * 1024, 100 * 1024, 1536),
        Arch("sm_89", 89, 99 * 1024, 100 * 1024, 1536),
        Arch("sm_90", 90, 227 * 1024, 228 * 1024, 2048),
        Arch("sm_90a", 90, 227 * 1024, 228 * 1024, 2048),
        Arch("sm_120", 120, 99 * 1024, 100 * 1024, 1536),
    )
}

# The archs CI compiles every preset for.
CI_ARCHS: tuple[str, ...] = ("sm_80", "sm_89", "sm_90", "sm_120")


def get_arch(name: str) -> Arch:
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(
            f"arch: got {name!r}, expected one of {', '.join(ARCHS)}"
        ) from None


def runs_on(arch: str, device_arch: str) -> bool:
    """Whether a cubin built for `arch` loads on a device whose target is `device_arch`: the same
    major revision, an equal or lower minor; the arch-specific sm_90a only on compute 9.0."""
    a, d = get_arch(arch), get_arch(device_arch)
    if arch == "sm_90a":
        return d.capability == 90
    return a.capability // 10 == d.capability // 10 and a.capability <= d.capability


def specializations(arch: str) -> tuple[str, ...]:
    """Arch-specific targets a device of target `arch` also runs (wgmma needs sm_90a)."""
    return ("sm_90a",) if arch in ("sm_90", "sm_90a") else ()


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for a device of compute capability major.minor."""
    name = f"sm_{major}{minor}"
    if name in ARCHS:
        return name
    # Same-major devices run cubins built for a lower minor of that major.
    cap = major * 10 + minor
    same_major = [a for a in ARCHS.values() if a.capability // 10 == major and a.capability <= cap]
    if not same_major:
        raise ValueError(f"no mlagen target for compute capability {major}.{minor}")
    return max(same_major, key=lambda a: a.capability).name


def nvcc_arch_flags(arch: str) -> str:
    """nvcc's target flags for `arch`: -arch=sm_XX, or for an arch-specific target such as sm_90a
    a -gencode without PTX (-arch=sm_90a also embeds compute_90 PTX, which has no wgmma)."""
    if arch.endswith("a"):
        return f"-gencode arch={arch.replace('sm_', 'compute_')},code={arch}"
    return f"-arch={arch}"
