#!/usr/bin/env python3
"""Build HAMi-core's libvgpu.so, pinned and reproducible, without CMake or nvcc.

HAMi-core (github.com/Project-HAMi/HAMi-core) is the in-container CUDA/NVML
interposer that HAMi ships. It reads the same CUDA_DEVICE_MEMORY_LIMIT,
CUDA_DEVICE_SM_LIMIT and CUDA_DEVICE_MEMORY_SHARED_CACHE variables as our
shim, so the real-GPU suite (tests/gpu/run.py) can run its checks with it
preloaded instead. The GPU machine has no network and no compiler: build
here, carry the .so there.

What this reproduces (learned from HAMi-core's CMakeLists.txt files, its
build.sh and static_config.h.in at the pinned commit):
  * the sources: libvgpu.c, utils.c, log_utils.c and the object libraries
    of src/{nvml,cuda,allocator,multiprocess} -- read from the CMakeLists.txt
    files of the tree being built, not hard-coded;
  * the flags of build.sh's build (CMAKE_BUILD_TYPE=Debug):
    -shared -fPIC -g -D_GNU_SOURCE -Wall, no -O (so -O0), not stripped;
  * static_config.h as CMake generates it with build.sh's options:
    MULTIPROCESS_LIMIT_ENABLE, DLSYM_HOOK_ENABLE, HOOK_MEMINFO_ENABLE and
    HOOK_NVML_ENABLE defined, the two debug switches not;
  * the include order: CUDA headers, src/, the generated config.
Differences, on purpose:
  * CUDA headers come from NVIDIA's PyPI wheels (CUDA 13.0, as scripts/test
    installs them), nvml.h from the nvidia-nvml-dev 13.0 wheel (downloaded
    once into .cache; HAMi-core's own nvml-subset.h does not stand in for
    it: four of its sources include <nvml.h> itself);
  * no -lcuda -lnvidia-ml: HAMi-core dlopens libcuda.so.1 and
    libnvidia-ml.so.1 at run time and references no driver symbol at link
    time, so the library needs only glibc (checked below);
  * zig cc targets glibc 2.17, so the library loads in any image; zig's
    default UBSan is turned off (-fno-sanitize=all) to match a gcc build;
    gcc is the fallback;
  * -ffile-prefix-map keeps the temporary tree's and the checkout's paths
    out of the debug info, so a rebuild in the same checkout gives the same
    bytes (zig's own libc_nonshared objects still name its install path).

The result is checked: an ELF shared object, NEEDED only glibc's libraries,
every undefined symbol versioned (bound to glibc), the entry points that
interposition needs exported; its size and sha256 are printed and written,
with the command, to build.json beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# The HAMi-core commit we build (main, "Merge pull request #212").
PINNED_COMMIT = "8f3a89c67b037d8fdfe6c4cd4d8c4f0cd6504811"
DEFAULT_SOURCE = Path("/work/.mirror/Project-HAMi+HAMi-core/repo")

REPO_ROOT = Path(__file__).resolve().parents[3]
CACHE = REPO_ROOT / ".cache" / "hami-core"
DEFAULT_CUDA_INCLUDE = REPO_ROOT / ".cache" / "cuda-nvcc" / "nvidia" / "cu13" / "include"

# nvml.h: not in the CUDA compiler wheels. The 13.0 release matches the
# CUDA 13.0 headers (and the GPU machines' 580 driver).
NVML_WHEEL = "nvidia-nvml-dev==13.0.87"
NVML_WHEEL_SHA256 = "082871368275cf6620fc900f55d8eaf2563b263a38a00a5168e9650bce963ba1"
NVML_HEADER_MEMBER = "nvidia/cu13/include/nvml.h"
NVML_HEADER_SHA256 = "28b51fbd44df16adf1e58229778414a4d1e7e05fdd4a74526ef0affb75f18416"
NVML_CACHE = CACHE / "nvidia-nvml-dev-13.0.87" / "include"

# build.sh passes these to CMake; static_config.h.in turns each into a #define.
CONFIG_DEFINES = ("MULTIPROCESS_LIMIT_ENABLE", "DLSYM_HOOK_ENABLE", "HOOK_MEMINFO_ENABLE", "HOOK_NVML_ENABLE")
# LIBRARY_COMPILE_FLAGS for CMAKE_BUILD_TYPE=Debug (build.sh's choice); CMake
# adds its own -g for Debug too.
COMPILE_FLAGS = ("-shared", "-fPIC", "-g", "-D_GNU_SOURCE", "-Wall")
ZIG_TARGET = "x86_64-linux-gnu.2.17"
GLIBC_FLOOR = (2, 17)
LINK_LIBS = ("-lpthread", "-ldl")

# glibc's own libraries (ld-linux is glibc's loader; zig may name it).
GLIBC_LIBRARIES = frozenset(
    {"libc.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "libm.so.6", "ld-linux-x86-64.so.2"}
)
# What interposition needs: the driver entry points an application or
# cudart reaches, cudart's route to them (cuGetProcAddress), NVML's memory
# view (nvidia-smi), and dlsym, which HAMi-core overrides.
REQUIRED_EXPORTS = (
    "cuInit",
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "cuLaunchKernel",
    "nvmlInit_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "dlsym",
)

TAIL_LINES = 25


class BuildError(Exception):
    """One line that says what is wrong; detail (a compiler's stderr tail) may follow."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def log(message: str) -> None:
    print(f"hami-core: {message}", flush=True)


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------- arguments


def default_out(commit: str | None) -> Path:
    return CACHE / (commit or "unpinned") / "libvgpu.so"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="build_hami_core.py",
        description=(
            "Build HAMi-core's libvgpu.so (the competitor's LD_PRELOAD library) at a pinned commit, "
            "with a plain C compiler: no CMake, no nvcc. CUDA headers come from the PyPI wheels that "
            "scripts/test installs; nvml.h from the nvidia-nvml-dev wheel (downloaded once into .cache). "
            "zig cc builds for glibc 2.17 first, gcc is the fallback. The result is checked (ELF shared "
            "object, only glibc NEEDED, interposition entry points exported) and its size and sha256 "
            "printed. Run it here, then carry the .so to the GPU machine."
        ),
        epilog=(
            "example: .venv/bin/python tests/gpu/peer/build_hami_core.py  "
            "(then LD_PRELOAD=.cache/hami-core/<commit>/libvgpu.so on the GPU machine). "
            "Exit status 1 with a one-line error when the source, commit, headers or compiler fail."
        ),
    )
    parser.add_argument(
        "--source",
        type=Path,
        default=DEFAULT_SOURCE,
        help=(
            "HAMi-core's git directory (a bare mirror or a .git), a checkout with .git (the commit is "
            "still taken with git archive), or a plain source tree (built as it is; the commit cannot be "
            f"checked). Default: {DEFAULT_SOURCE}"
        ),
    )
    parser.add_argument(
        "--commit",
        default=PINNED_COMMIT,
        help=f"the commit to build (resolved to its full hash). Default, pinned: {PINNED_COMMIT}",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where the library goes. Default: .cache/hami-core/<full commit hash>/libvgpu.so under the repo root",
    )
    parser.add_argument(
        "--cuda-include",
        type=Path,
        default=DEFAULT_CUDA_INCLUDE,
        help=f"folder with cuda.h (default: {DEFAULT_CUDA_INCLUDE.relative_to(REPO_ROOT)}, installed by scripts/test)",
    )
    parser.add_argument(
        "--nvml-include",
        type=Path,
        default=None,
        help=(
            f"folder with nvml.h. Default: taken from the {NVML_WHEEL} wheel (pip download, sha256-checked) "
            f"into {NVML_CACHE.relative_to(REPO_ROOT)}"
        ),
    )
    parser.add_argument(
        "--compiler",
        choices=("auto", "zig", "gcc"),
        default="auto",
        help="auto (default): zig cc for glibc 2.17, gcc if that fails; zig or gcc: that one only",
    )
    parser.add_argument("--cc", default="gcc", help="the gcc-like compiler for --compiler gcc/auto (default: gcc)")
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="build nothing: check the library at --out (or the default path) and print its size and sha256",
    )
    args = parser.parse_args(argv)
    return args


# ------------------------------------------------------------------- source


@dataclass
class Source:
    tree: Path  # the extracted (or given) source tree
    commit: str | None  # full hash, or None for a plain tree
    origin: str  # how it was obtained, for the log


def git(git_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", *args], capture_output=True, check=False, env={**os.environ, "LC_ALL": "C"}
    )


def git_dir_of(source: Path) -> Path | None:
    """The git directory behind SOURCE (itself, or SOURCE/.git), or None for a plain tree."""
    for candidate in (source, source / ".git"):
        if candidate.is_dir() and git(candidate, "rev-parse", "--git-dir").returncode == 0:
            return candidate
    return None


def resolve_commit(git_dir: Path, commit: str) -> str:
    result = git(git_dir, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    full = result.stdout.decode().strip()
    if result.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", full):
        raise BuildError(f"commit {commit} is not in {git_dir} (git rev-parse found no such commit)")
    return full


def export_tree(git_dir: Path, commit: str, dest: Path) -> None:
    result = git(git_dir, "archive", "--format=tar", commit)
    if result.returncode != 0:
        raise BuildError(f"git archive {commit} failed in {git_dir}", tail(result.stderr.decode(errors="replace")))
    with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
        for member in archive.getmembers():
            if member.name.startswith("/") or ".." in Path(member.name).parts:
                raise BuildError(f"git archive of {commit} holds an unsafe path: {member.name}")
        if hasattr(tarfile, "data_filter"):
            archive.extractall(dest, filter="data")
        else:
            archive.extractall(dest)


def obtain_source(source: Path, commit: str, workdir: Path) -> Source:
    if not source.exists():
        raise BuildError(f"source {source} does not exist (give --source: HAMi-core's git dir or source tree)")
    git_dir = git_dir_of(source)
    tree = workdir / "hami-core"
    tree.mkdir()
    if git_dir is not None:
        full = resolve_commit(git_dir, commit)
        export_tree(git_dir, full, tree)
        return Source(tree, full, f"git archive {full} of {git_dir}")
    if not (source / "src" / "CMakeLists.txt").is_file():
        raise BuildError(f"source {source} is neither a git directory nor a HAMi-core tree (no src/CMakeLists.txt)")
    shutil.copytree(source, tree, dirs_exist_ok=True, ignore=shutil.ignore_patterns("build", ".git"))
    return Source(tree, None, f"plain tree {source} (commit not checked)")


# ------------------------------------------------------ what CMake would do


def _cmake_calls(text: str, command: str) -> list[list[str]]:
    """The argument lists of every COMMAND(...) call in a CMakeLists.txt text."""
    text = re.sub(r"#[^\n]*", "", text)
    # The calls read here hold no parentheses inside ($<TARGET_OBJECTS:x>
    # uses angle brackets), so the first ")" closes the call.
    return [match.group(1).split() for match in re.finditer(rf"\b{command}\s*\(([^)]*)\)", text, re.IGNORECASE)]


def cmake_sources(tree: Path) -> list[str]:
    """The C sources of the vgpu shared library, as src/CMakeLists.txt and
    the object libraries it pulls in ($<TARGET_OBJECTS:name>) list them,
    relative to TREE, in order, without duplicates."""
    src = tree / "src"
    top = src / "CMakeLists.txt"
    if not top.is_file():
        raise BuildError(f"no {top.relative_to(tree)} in the source tree")
    shared = [call for call in _cmake_calls(top.read_text(), "add_library") if len(call) > 1 and call[1] == "SHARED"]
    if len(shared) != 1:
        raise BuildError(f"src/CMakeLists.txt has {len(shared)} SHARED libraries, expected 1 (the vgpu library)")
    objects: dict[str, list[str]] = {}
    for sub in sorted(src.glob("*/CMakeLists.txt")):
        for call in _cmake_calls(sub.read_text(), "add_library"):
            if len(call) > 2 and call[1] == "OBJECT":
                objects[call[0]] = [str((sub.parent / name).relative_to(tree)) for name in call[2:]]
    sources: list[str] = []
    for item in shared[0][2:]:
        target = re.fullmatch(r"\$<TARGET_OBJECTS:([^>]+)>", item)
        if target:
            name = target.group(1)
            if name not in objects:
                raise BuildError(
                    f"src/CMakeLists.txt uses object library {name}, which no src/*/CMakeLists.txt defines"
                )
            sources.extend(objects[name])
        elif item.endswith(".c"):
            sources.append(str((src / item).relative_to(tree)))
        else:
            raise BuildError(f"src/CMakeLists.txt: unexpected item {item!r} in the vgpu library's sources")
    unique = list(dict.fromkeys(sources))
    missing = [name for name in unique if not (tree / name).is_file()]
    if missing:
        raise BuildError(f"CMakeLists.txt names sources that are not in the tree: {' '.join(missing)}")
    return unique


def render_static_config(template: str, commit: str | None, defines=CONFIG_DEFINES) -> str:
    """static_config.h as CMake's configure_file makes it from static_config.h.in."""
    values = {"GIT_HASH": (commit or "unknown")[:7], "GIT_BRANCH": "unknown"}
    out = []
    for line in template.splitlines():
        match = re.fullmatch(r"#cmakedefine\s+(\w+)\s*", line)
        if match:
            name = match.group(1)
            out.append(f"#define {name}" if name in defines else f"/* #undef {name} */")
            continue
        if "#cmakedefine" in line:
            raise BuildError(f"static_config.h.in: unexpected line {line!r}")

        def substitute(placeholder: re.Match) -> str:
            key = placeholder.group(1)
            if key not in values:
                raise BuildError(f"static_config.h.in uses @{key}@, which this script does not know how to fill")
            return values[key]

        out.append(re.sub(r"@(\w+)@", substitute, line))
    return "\n".join(out) + "\n"


def write_static_config(tree: Path, commit: str | None) -> Path:
    template = tree / "src" / "static_config.h.in"
    if not template.is_file():
        raise BuildError("no src/static_config.h.in in the source tree")
    config_dir = tree / "build-config"
    config_dir.mkdir(exist_ok=True)
    (config_dir / "static_config.h").write_text(render_static_config(template.read_text(), commit))
    return config_dir


# ------------------------------------------------------------------ headers


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def venv_python() -> str:
    candidate = REPO_ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.is_file() else sys.executable


def check_cuda_include(folder: Path) -> Path:
    if not (folder / "cuda.h").is_file():
        raise BuildError(
            f"no cuda.h in {folder}: run scripts/test (it installs NVIDIA's CUDA 13.0 wheels into .cache/cuda-nvcc) "
            "or give --cuda-include"
        )
    return folder


def ensure_nvml_include(given: Path | None) -> Path:
    if given is not None:
        if not (given / "nvml.h").is_file():
            raise BuildError(f"no nvml.h in {given} (--nvml-include)")
        return given
    header = NVML_CACHE / "nvml.h"
    if header.is_file() and sha256_file(header) == NVML_HEADER_SHA256:
        return NVML_CACHE
    log(f"downloading {NVML_WHEEL} for nvml.h (once, into {NVML_CACHE})")
    with tempfile.TemporaryDirectory(prefix="nvml-wheel-") as scratch:
        result = subprocess.run(
            [
                venv_python(),
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--quiet",
                "--dest",
                scratch,
                NVML_WHEEL,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        wheels = sorted(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise BuildError(
                f"pip download {NVML_WHEEL} failed (nvml.h comes from it); give --nvml-include DIR instead",
                tail(result.stderr or result.stdout),
            )
        digest = sha256_file(wheels[0])
        if digest != NVML_WHEEL_SHA256:
            raise BuildError(f"{wheels[0].name} has sha256 {digest}, expected {NVML_WHEEL_SHA256}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            data = wheel.read(NVML_HEADER_MEMBER)
    NVML_CACHE.mkdir(parents=True, exist_ok=True)
    partial = header.with_suffix(".h.partial")
    partial.write_bytes(data)
    os.replace(partial, header)
    return NVML_CACHE


# ----------------------------------------------------------------- compiler


@dataclass
class Compiler:
    kind: str  # "zig" or "gcc"
    argv: list[str]  # how to invoke it ("python -m ziglang cc", "gcc")
    version: str = ""


def find_zig() -> Compiler | None:
    python = venv_python()
    probe = subprocess.run([python, "-m", "ziglang", "version"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return None
    return Compiler("zig", [python, "-m", "ziglang", "cc"], f"zig {probe.stdout.strip()}")


def find_gcc(cc: str) -> Compiler | None:
    path = shutil.which(cc)
    if path is None:
        return None
    probe = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    first = probe.stdout.splitlines()[0] if probe.stdout else cc
    return Compiler("gcc", [path], first)


def select_compilers(choice: str, cc: str) -> list[Compiler]:
    """The compilers to try, in order: zig then gcc for auto, or the one chosen."""
    candidates: list[Compiler] = []
    if choice in ("auto", "zig"):
        zig = find_zig()
        if zig is None and choice == "zig":
            raise BuildError("zig is not installed: `python -m ziglang` failed (scripts/test installs ziglang)")
        candidates += [zig] if zig else []
    if choice in ("auto", "gcc"):
        gcc = find_gcc(cc)
        if gcc is None and choice == "gcc":
            raise BuildError(f"no C compiler {cc!r} on PATH")
        candidates += [gcc] if gcc else []
    if not candidates:
        raise BuildError(f"no compiler: neither zig (python -m ziglang) nor {cc!r} is available")
    return candidates


def compose_command(
    compiler: Compiler,
    tree: Path,
    sources: list[str],
    include_dirs: list[Path],
    config_dir: Path,
    output: Path,
    prefix_maps: list[tuple[Path, str]] = (),
) -> list[str]:
    """The one compiler command that compiles and links the library.

    Sources are relative to TREE (the command runs there). include_dirs
    come first (CUDA, then nvml), then src/ and the generated config, in
    CMake's include_directories order."""
    command = list(compiler.argv)
    if compiler.kind == "zig":
        # zig cc's default (Debug) mode adds UBSan checks that trap and a
        # runtime of its own; HAMi-core's gcc build has neither.
        command += ["-target", ZIG_TARGET, "-fno-sanitize=all"]
    command += list(COMPILE_FLAGS)
    for old, new in prefix_maps:
        command.append(f"-ffile-prefix-map={old}={new}")
    for folder in [*include_dirs, tree / "src", config_dir]:
        command.append(f"-I{folder}")
    command += list(sources)
    command += ["-o", str(output)]
    command += list(LINK_LIBS)
    return command


def compiler_detail(stderr: str, errors: int = 10) -> str:
    """The compiler's error lines (HAMi-core's warnings can bury them), then its stderr tail."""
    lines = stderr.strip().splitlines()
    found = [line for line in lines if re.search(r"(^|: )(fatal )?error\b|undefined reference", line)]
    parts = []
    if found:
        parts += ["errors:", *found[:errors]]
    parts += ["stderr tail:", tail(stderr)]
    return "\n".join(parts)


def run_compiler(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


# ------------------------------------------------------------- the ELF check


@dataclass
class ElfInfo:
    elf_type: int
    needed: list[str] = field(default_factory=list)
    soname: str | None = None
    exports: set[str] = field(default_factory=set)
    # undefined, non-weak symbols without a version (bound to no library)
    unversioned_undefined: list[str] = field(default_factory=list)
    # versions required per library (from .gnu.version_r)
    version_needs: dict[str, set[str]] = field(default_factory=dict)


SHT_STRTAB, SHT_DYNAMIC, SHT_DYNSYM = 3, 6, 11
SHT_GNU_VERNEED, SHT_GNU_VERSYM = 0x6FFFFFFE, 0x6FFFFFFF
DT_NEEDED, DT_SONAME = 1, 14
ET_DYN = 3
STB_GLOBAL, STB_WEAK = 1, 2
STV_DEFAULT = 0


def read_elf(path: Path) -> ElfInfo:
    """The dynamic-linking facts of an x86-64 (ELF64 little-endian) file."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        raise BuildError(f"{path} is not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise BuildError(f"{path} is not a 64-bit little-endian ELF file")
    (e_type,) = struct.unpack_from("<H", data, 16)
    e_shoff = struct.unpack_from("<Q", data, 0x28)[0]
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for index in range(e_shnum):
        fields = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + index * e_shentsize)
        sections.append(
            {"type": fields[1], "offset": fields[4], "size": fields[5], "link": fields[6], "entsize": fields[9]}
        )

    def string(section: dict, offset: int) -> str:
        start = section["offset"] + offset
        return data[start : data.index(b"\0", start)].decode()

    info = ElfInfo(elf_type=e_type)
    for section in sections:
        if section["type"] == SHT_DYNAMIC:
            strtab = sections[section["link"]]
            for offset in range(section["offset"], section["offset"] + section["size"], 16):
                tag, value = struct.unpack_from("<qQ", data, offset)
                if tag == DT_NEEDED:
                    info.needed.append(string(strtab, value))
                elif tag == DT_SONAME:
                    info.soname = string(strtab, value)
    dynsym = next((s for s in sections if s["type"] == SHT_DYNSYM), None)
    versym = next((s for s in sections if s["type"] == SHT_GNU_VERSYM), None)
    if dynsym is not None:
        strtab = sections[dynsym["link"]]
        count = dynsym["size"] // 24
        for index in range(1, count):
            st_name, st_info, st_other, st_shndx = struct.unpack_from("<IBBH", data, dynsym["offset"] + index * 24)
            name = string(strtab, st_name)
            binding = st_info >> 4
            if not name:
                continue
            if st_shndx != 0:
                if binding in (STB_GLOBAL, STB_WEAK) and (st_other & 3) == STV_DEFAULT:
                    info.exports.add(name)
                continue
            version = struct.unpack_from("<H", data, versym["offset"] + index * 2)[0] & 0x7FFF if versym else 0
            if binding != STB_WEAK and version <= 1:
                info.unversioned_undefined.append(name)
    for section in sections:
        if section["type"] == SHT_GNU_VERNEED:
            strtab = sections[section["link"]]
            offset = section["offset"]
            while True:
                _, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, offset)
                library = string(strtab, vn_file)
                aux = offset + vn_aux
                for _ in range(vn_cnt):
                    _, _, _, vna_name, vna_next = struct.unpack_from("<IHHII", data, aux)
                    info.version_needs.setdefault(library, set()).add(string(strtab, vna_name))
                    aux += vna_next
                if vn_next == 0:
                    break
                offset += vn_next
    return info


def glibc_floor(info: ElfInfo) -> tuple[int, ...] | None:
    """The newest GLIBC_x.y version the library asks for."""
    versions = [
        tuple(int(part) for part in name[len("GLIBC_") :].split("."))
        for names in info.version_needs.values()
        for name in names
        if re.fullmatch(r"GLIBC_\d+(\.\d+)*", name)
    ]
    return max(versions) if versions else None


def check_library(path: Path, required=REQUIRED_EXPORTS, allowed=GLIBC_LIBRARIES) -> ElfInfo:
    """Raise BuildError unless PATH is a shared object that needs only
    glibc and exports REQUIRED; return what was read."""
    if not path.is_file():
        raise BuildError(f"no library at {path}")
    info = read_elf(path)
    if info.elf_type != ET_DYN:
        raise BuildError(f"{path} is not a shared object (ELF type {info.elf_type})")
    foreign = [name for name in info.needed if name not in allowed]
    if foreign:
        raise BuildError(f"{path} needs libraries beyond glibc: {' '.join(foreign)}")
    if info.unversioned_undefined:
        shown = " ".join(sorted(info.unversioned_undefined)[:10])
        raise BuildError(f"{path} has undefined symbols that no library provides: {shown}")
    missing = [name for name in required if name not in info.exports]
    if missing:
        raise BuildError(f"{path} does not export {' '.join(missing)}")
    return info


def check_loads(path: Path) -> None:
    """The dynamic loader here accepts PATH as a preload (HAMi-core does
    nothing at load time: no constructor, so this needs no GPU)."""
    true = shutil.which("true")
    if true is None:
        return
    result = subprocess.run(
        [true], env={**os.environ, "LD_PRELOAD": str(path.resolve())}, capture_output=True, text=True, check=False
    )
    if result.returncode != 0 or "LD_PRELOAD" in result.stderr:
        raise BuildError(f"{path} does not preload here: {tail(result.stderr, 1) or f'exit {result.returncode}'}")


def describe(path: Path, info: ElfInfo) -> dict:
    floor = glibc_floor(info)
    return {
        "path": str(path),
        "size": path.stat().st_size,
        "sha256": sha256_file(path),
        "needed": info.needed,
        "glibc_floor": ".".join(map(str, floor)) if floor else None,
        "exports": len(info.exports),
    }


def print_summary(summary: dict) -> None:
    log(f"library {summary['path']}")
    print(f"  size:    {summary['size']} bytes")
    print(f"  sha256:  {summary['sha256']}")
    print(f"  NEEDED:  {' '.join(summary['needed'])} (glibc only)")
    print(f"  glibc:   needs at most GLIBC_{summary['glibc_floor']}")
    print(f"  exports: {summary['exports']} symbols, including {' '.join(REQUIRED_EXPORTS)}")


# --------------------------------------------------------------------- build


def compile_with(compiler: Compiler, command: list[str], tree: Path) -> None:
    log(f"compiler: {compiler.version} ({compiler.kind})")
    log("$ " + " ".join(command))
    result = run_compiler(command, tree)
    if result.returncode != 0:
        raise BuildError(
            f"{compiler.kind} failed to build libvgpu.so (exit {result.returncode})",
            compiler_detail(result.stderr or result.stdout),
        )


def build(args: argparse.Namespace) -> dict:
    cuda_include = check_cuda_include(args.cuda_include)
    nvml_include = ensure_nvml_include(args.nvml_include)
    candidates = select_compilers(args.compiler, args.cc)
    with tempfile.TemporaryDirectory(prefix="hami-core-build-") as scratch:
        workdir = Path(scratch)
        source = obtain_source(args.source, args.commit, workdir)
        out = args.out or default_out(source.commit)
        log(f"source: {source.origin}")
        if source.commit is None:
            log("warning: a plain tree: the commit is not checked")
        sources = cmake_sources(source.tree)
        log(f"sources ({len(sources)}, from CMakeLists.txt): {' '.join(sources)}")
        config_dir = write_static_config(source.tree, source.commit)
        log(f"cuda.h from {cuda_include}; nvml.h from {nvml_include}")
        staged = workdir / "libvgpu.so"
        include_dirs = [cuda_include, nvml_include]
        prefix_maps = [(source.tree, "hami-core"), (REPO_ROOT, ".")]

        failure: BuildError | None = None
        used: Compiler | None = None
        command: list[str] = []
        for compiler in candidates:
            command = compose_command(compiler, source.tree, sources, include_dirs, config_dir, staged, prefix_maps)
            try:
                compile_with(compiler, command, source.tree)
            except BuildError as error:
                failure = error
                if compiler is not candidates[-1]:
                    log(f"{error}; falling back to the next compiler. Its stderr ended with:")
                    print(error.detail, file=sys.stderr)
                continue
            used = compiler
            break
        if used is None:
            assert failure is not None
            raise failure
        info = check_library(staged)
        check_loads(staged)
        floor = glibc_floor(info)
        if used.kind == "zig" and floor and floor > GLIBC_FLOOR:
            raise BuildError(f"built for glibc 2.17 but the library asks for GLIBC_{'.'.join(map(str, floor))}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        shutil.copyfile(staged, partial)
        os.chmod(partial, 0o755)
        os.replace(partial, out)
    summary = describe(out, info)
    summary.update(
        {
            "commit": source.commit,
            "source": source.origin,
            "compiler": used.version,
            "compiler_kind": used.kind,
            "sources": sources,
            "config_defines": list(CONFIG_DEFINES),
            "nvml_header": NVML_WHEEL if args.nvml_include is None else str(args.nvml_include),
            "command": command,
        }
    )
    (out.parent / "build.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.check_only:
            out = args.out or default_out(args.commit)
            info = check_library(out)
            check_loads(out)
            summary = describe(out, info)
        else:
            summary = build(args)
    except BuildError as error:
        print(f"build_hami_core: error: {error}", file=sys.stderr)
        if error.detail:
            print(error.detail, file=sys.stderr)
        return 1
    print_summary(summary)
    if "compiler" in summary:
        print(
            f"  built by {summary['compiler']} ({summary['compiler_kind']}) from {summary['commit'] or 'a plain tree'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
