"""Compile rendered source to a binary: NVRTC for CUDA (any named arch, no GPU needed), clang for
HIP offline checks. Compile errors raise CompileError carrying the spec name, the options, the
compiler log and the numbered source lines around each reported error."""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

_ERROR_LINE = re.compile(r"\((\d+)\): (?:error|catastrophic error)|:(\d+):\d+: error")
_CONTEXT = 3


class CompileError(RuntimeError):
    def __init__(self, spec_name: str, options: list[str], log: str, source: str):
        self.spec_name, self.options, self.log, self.source = spec_name, list(options), log, source
        super().__init__(f"failed to compile {spec_name}\noptions: {' '.join(options)}\n"
                         f"--- compiler log ---\n{log.strip()}\n--- source ---\n{numbered_excerpt(source, log)}")


def numbered_excerpt(source: str, log: str) -> str:
    """Source lines around each line the log blames (all lines when it blames none), numbered."""
    lines = source.splitlines()
    blamed = sorted({int(a or b) for a, b in _ERROR_LINE.findall(log)})
    keep = sorted({i for n in blamed for i in range(max(1, n - _CONTEXT), min(len(lines), n + _CONTEXT) + 1)})
    if not keep:
        keep = list(range(1, len(lines) + 1))
    width = len(str(len(lines)))
    out, prev = [], 0
    for n in keep:
        if prev and n != prev + 1:
            out.append("...")
        mark = ">" if n in blamed else " "
        out.append(f"{mark}{n:>{width}} | {lines[n - 1]}")
        prev = n
    return "\n".join(out)


@dataclass
class Binary:
    """A compiled kernel image plus what the compiler reported about it."""

    data: bytes
    log: str
    resources: dict = field(default_factory=dict)
    ptx: str = ""


# Where the nvidia-cuda-nvrtc wheels keep the library, under a sys.path entry.
_NVRTC_WHEEL_LIBS = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.13")


@functools.cache
def _preload_nvrtc() -> None:
    """Load NVRTC from its wheel wherever that is on sys.path. CuPy looks for the wheel in the
    interpreter's own site-packages only, which misses one on a path a venv inherits or is given (a
    venv made inside another, PYTHONPATH); a library already loaded is the one CuPy then takes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    for base in sys.path:
        for rel in _NVRTC_WHEEL_LIBS:
            lib = Path(base or ".", rel)
            if lib.is_file():  # the builtins first: NVRTC opens them by name when it compiles
                for builtins in sorted(lib.parent.glob("libnvrtc-builtins.so.13.*")):
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
                return


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc

    _preload_nvrtc()
    major, minor = nvrtc.getVersion()
    return f"nvrtc-{major}.{minor}"


def cuda_options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-lineinfo"]


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _first_numbers(log: str, patterns: dict) -> dict:
    """Each pattern's first number in the log (0 where absent)."""
    found = {}
    for key, pattern in patterns.items():
        m = pattern.search(log)
        found[key] = int(m.group(1)) if m else 0
    return found


def parse_ptxas(log: str) -> dict:
    return _first_numbers(log, _PTXAS)


def entry_resources(log: str, entry: str) -> dict:
    """The ptxas figures of one entry point of a module that holds several; {} when the log does
    not mention it."""
    start = log.find(f"Compiling entry function '{entry}'")
    if start < 0:
        return {}
    end = log.find("Compiling entry function", start + 1)
    return parse_ptxas(log[start:end if end >= 0 else len(log)])


def compile_cuda(source: str, arch: str, spec_name: str, options: list[str] | None = None,
                 entry: str | None = None) -> Binary:
    """NVRTC -> cubin for a named arch (sm_80 ... sm_120, sm_90a). The resources are those of
    `entry` (the module's main kernel) when given, else of the first kernel ptxas reports."""
    from cupy.cuda import nvrtc

    _preload_nvrtc()
    options = options or cuda_options(arch)
    program = nvrtc.createProgram(source, spec_name + ".cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError:
            raise CompileError(spec_name, options, nvrtc.getProgramLog(program), source) from None
        log = nvrtc.getProgramLog(program)
        cubin = _complete_elf(nvrtc.getCUBIN(program))
        ptx = nvrtc.getPTX(program)
        ptx = ptx.decode(errors="replace") if isinstance(ptx, (bytes, bytearray)) else str(ptx)
        resources = (entry_resources(log, entry) if entry else {}) or parse_ptxas(log)
        return Binary(data=cubin, log=log, resources=resources, ptx=ptx)
    finally:
        nvrtc.destroyProgram(program)


def _complete_elf(image: bytes) -> bytes:
    """CuPy's getCUBIN drops the image's final (NUL) byte, which the driver tolerates but
    disassemblers reject; pad back to the extent the ELF headers declare."""
    import struct

    if image[:4] != b"\x7fELF" or image[4] != 2:
        return image
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for i in range(shnum):
        sh_type, = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 0x18)
        if sh_type != 8:  # SHT_NOBITS occupies no file space
            end = max(end, offset + size)
    return image + b"\0" * max(0, end - len(image))


def find_tool(*names: str) -> str | None:
    """A compiler or disassembler on PATH, in CUDA_HOME, or shipped by an nvidia-* wheel."""
    import os

    for name in names:
        hit = shutil.which(name)
        if hit:
            return hit
    dirs = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"]
    try:
        import nvidia

        dirs += [Path(p) / "cu13" / "bin" for p in nvidia.__path__]
    except ImportError:
        pass
    for d in dirs:
        for name in names:
            if (d / name).is_file():
                return str(d / name)
    return None


def hip_options(arch: str) -> list[str]:
    return ["-x", "hip", f"--offload-arch={arch}", "-nogpulib", "-nogpuinc", "--offload-device-only",
            "--no-gpu-bundle-output", "-O3", "-std=c++17", "-DQATTN_OFFLINE_HIP=1",
            "-Rpass-analysis=kernel-resource-usage"]


# clang's kernel-resource-usage remarks, named like the ptxas fields where they mean the same.
_CLANG_REMARKS = {
    "registers": re.compile(r"remark:\s+VGPRs: (\d+)"),
    "sgprs": re.compile(r"remark:\s+SGPRs: (\d+)"),
    "scratch": re.compile(r"remark:\s+ScratchSize \[bytes/lane\]: (\d+)"),
    "vgpr_spills": re.compile(r"remark:\s+VGPRs Spill: (\d+)"),
    "sgpr_spills": re.compile(r"remark:\s+SGPRs Spill: (\d+)"),
    "occupancy_waves": re.compile(r"remark:\s+Occupancy \[waves/SIMD\]: (\d+)"),
}


def parse_clang_remarks(log: str) -> dict:
    return _first_numbers(log, _CLANG_REMARKS)


def hip_entry_resources(log: str, entry: str) -> dict:
    """clang's resource remarks of one kernel of a module that holds several; {} when the log does not name it."""
    m = re.search(rf"remark: Function Name: {re.escape(entry)}\b", log)
    if m is None:
        return {}
    end = log.find("remark: Function Name:", m.end())
    return parse_clang_remarks(log[m.start():end if end >= 0 else len(log)])


def compile_hip_offline(source: str, arch: str, spec_name: str, entry: str | None = None) -> Binary:
    """clang (19 or newer) -> AMDGPU code object, no ROCm needed; for CI checks and `qattn compile`. The resources
    are those of `entry` (the module's main kernel) when given, else of the first kernel clang reports."""
    clang = find_tool("clang++-19", "clang++-20", "clang++")
    if clang is None:
        raise RuntimeError("backend hip: offline compiles need clang-19 "
                           "(apt-get install --no-install-recommends clang-19 lld-19 llvm-19)")
    options = hip_options(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / f"{spec_name}.hip", Path(tmp) / f"{spec_name}.co"
        src.write_text(source)
        run = subprocess.run([clang, *options, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
        log = run.stdout + run.stderr
        if run.returncode != 0 or not obj.exists():
            raise CompileError(spec_name, options, log.replace(str(src), spec_name + ".hip"), source)
        resources = (hip_entry_resources(log, entry) if entry else {}) or parse_clang_remarks(log)
        return Binary(data=obj.read_bytes(), log=log, resources=resources)


def disassemble(binary: bytes, backend: str) -> str | None:
    """SASS (nvdisasm) or AMDGPU assembly (llvm-objdump) text, or None where no tool is found."""
    tool = find_tool("nvdisasm") if backend == "cuda" else find_tool("llvm-objdump-19", "llvm-objdump-20", "llvm-objdump")
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("k.cubin" if backend == "cuda" else "k.co")
        path.write_bytes(binary)
        args = [tool, str(path)] if backend == "cuda" else [tool, "-d", str(path)]
        run = subprocess.run(args, capture_output=True, text=True)
        return run.stdout if run.returncode == 0 else None


def functions_by_symbol(asm: str) -> dict:
    """llvm-objdump text split per symbol: {name: its disassembly}."""
    out = {}
    for part in re.split(r"\n(?=[0-9a-f]+ <)", asm):
        m = re.match(r"[0-9a-f]+ <([\w.]+)>:", part)
        if m:
            out[m.group(1)] = part
    return out


def resource_remarks(log: str) -> dict:
    """clang's kernel-resource-usage remarks per function: {name: {"VGPRs": n, "ScratchSize": n, ...}}."""
    out, name = {}, None
    for line in log.splitlines():
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = {}
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[[^\]]*\])?: (\d+)", line)
        if m and name:
            out[name][m.group(1)] = int(m.group(2))
    return out
