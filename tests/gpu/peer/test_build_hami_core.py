"""build_hami_core.py without HAMi-core's sources or the network: its
options, the compiler command it composes, what it reads from CMake files,
the static_config.h it writes, the ELF checks (on tiny libraries compiled
here with cc), its one-line errors, and a whole build of a stand-in tree."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "build_hami_core.py"

spec = importlib.util.spec_from_file_location("build_hami_core", SCRIPT)
bhc = importlib.util.module_from_spec(spec)
sys.modules["build_hami_core"] = bhc  # dataclasses look their module up there
spec.loader.exec_module(bhc)

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")


def compile_so(tmp_path: Path, name: str, code: str, *flags: str) -> Path:
    source = tmp_path / f"{name}.c"
    source.write_text(textwrap.dedent(code))
    out = tmp_path / f"{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(source), *flags], check=True, capture_output=True)
    return out


def all_exports_code() -> str:
    return "".join(f"int {name}(void) {{ return 0; }}\n" for name in bhc.REQUIRED_EXPORTS)


# ------------------------------------------------------------------ options


def test_defaults_pin_a_full_commit_and_put_the_library_under_cache():
    args = bhc.parse_args([])
    assert args.source == bhc.DEFAULT_SOURCE
    assert args.commit == bhc.PINNED_COMMIT
    assert len(bhc.PINNED_COMMIT) == 40 and int(bhc.PINNED_COMMIT, 16) >= 0
    assert args.out is None
    assert bhc.default_out(args.commit) == bhc.REPO_ROOT / ".cache/hami-core" / bhc.PINNED_COMMIT / "libvgpu.so"
    assert args.compiler == "auto"
    assert args.cuda_include == bhc.REPO_ROOT / ".cache/cuda-nvcc/nvidia/cu13/include"
    assert args.nvml_include is None
    assert not args.check_only


def test_options_are_taken():
    args = bhc.parse_args(
        ["--source", "/s", "--commit", "abc123", "--out", "/o/x.so", "--compiler", "gcc", "--cc", "clang"]
    )
    assert (args.source, args.commit, args.out) == (Path("/s"), "abc123", Path("/o/x.so"))
    assert (args.compiler, args.cc) == ("gcc", "clang")
    assert bhc.default_out(None).parent.name == "unpinned"


def test_an_unknown_compiler_is_refused():
    with pytest.raises(SystemExit):
        bhc.parse_args(["--compiler", "clang"])


def test_help_explains_what_it_builds():
    env = {**os.environ, "COLUMNS": "1000"}  # argparse wraps at hyphens otherwise
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=False, env=env
    )
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for word in ("--source", "--commit", "--out", "--check-only", "no CMake", "glibc 2.17", "sha256", bhc.NVML_WHEEL):
        assert word in text, word


# ------------------------------------------------------------ the command


def command_for(kind: str, argv: list[str]) -> list[str]:
    compiler = bhc.Compiler(kind, argv)
    return bhc.compose_command(
        compiler,
        Path("/t/hami"),
        ["src/a.c", "src/m/b.c"],
        [Path("/cuda/include"), Path("/nvml/include")],
        Path("/t/hami/build-config"),
        Path("/o/libvgpu.so"),
        [(Path("/t/hami"), "hami-core")],
    )


def test_zig_command_targets_glibc_217_without_sanitizers():
    command = command_for("zig", ["py", "-m", "ziglang", "cc"])
    assert command[:4] == ["py", "-m", "ziglang", "cc"]
    target = command.index("-target")
    assert command[target + 1] == "x86_64-linux-gnu.2.17"
    assert "-fno-sanitize=all" in command


def test_command_reproduces_the_cmake_debug_build():
    command = command_for("gcc", ["/usr/bin/gcc"])
    assert command[0] == "/usr/bin/gcc"
    assert "-target" not in command and "-fno-sanitize=all" not in command
    flags = list(bhc.COMPILE_FLAGS)
    start = command.index(flags[0])
    assert command[start : start + len(flags)] == ["-shared", "-fPIC", "-g", "-D_GNU_SOURCE", "-Wall"]
    # No optimisation and no hidden visibility: build.sh builds Debug.
    assert not [arg for arg in command if arg.startswith("-O") or arg.startswith("-fvisibility")]
    includes = [arg for arg in command if arg.startswith("-I")]
    assert includes == ["-I/cuda/include", "-I/nvml/include", "-I/t/hami/src", "-I/t/hami/build-config"]
    assert "-ffile-prefix-map=/t/hami=hami-core" in command
    # Sources after the includes, then the output, then glibc's libraries only.
    assert command.index("src/a.c") > command.index("-I/t/hami/build-config")
    assert command[-5:] == ["src/m/b.c", "-o", "/o/libvgpu.so", "-lpthread", "-ldl"]
    assert "-lcuda" not in command and "-lnvidia-ml" not in command


def test_compiler_detail_puts_the_error_before_the_warnings():
    stderr = "\n".join([*(f"w.c:{i}: warning: noise" for i in range(60)), "x.c:3:1: error: broken", "1 error"])
    detail = bhc.compiler_detail(stderr)
    assert detail.startswith("errors:\nx.c:3:1: error: broken")
    assert detail.splitlines()[-1] == "1 error"
    assert len(detail.splitlines()) <= bhc.TAIL_LINES + 3


# -------------------------------------------------------- CMake's knowledge


def write_tree(root: Path, shared_items: str, modules: dict[str, str], files: dict[str, str]) -> Path:
    src = root / "src"
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(
        "# comment with add_library(fake SHARED nope.c)\n"
        "set(LIBVGPU vgpu)\n"
        f"add_library(${{LIBVGPU}} SHARED {shared_items})\n"
        "target_link_libraries(${LIBVGPU} PUBLIC -lcuda -lnvidia-ml)\n"
    )
    for folder, text in modules.items():
        (src / folder).mkdir()
        (src / folder / "CMakeLists.txt").write_text(text)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_sources_follow_the_cmake_files_in_order_without_duplicates(tmp_path):
    tree = write_tree(
        tmp_path,
        "lib.c util.c $<TARGET_OBJECTS:cuda_mod> $<TARGET_OBJECTS:mp_mod>",
        {
            "cuda": "add_library(cuda_mod OBJECT hook.c mem.c hook.c)\n",
            "mp": "add_library(mp_mod OBJECT\n  a.c b.c)\nadd_executable(tool tool.c)\n",
        },
        {f"src/{name}": "" for name in ("lib.c", "util.c", "cuda/hook.c", "cuda/mem.c", "mp/a.c", "mp/b.c")},
    )
    assert bhc.cmake_sources(tree) == [
        "src/lib.c",
        "src/util.c",
        "src/cuda/hook.c",
        "src/cuda/mem.c",
        "src/mp/a.c",
        "src/mp/b.c",
    ]


def test_sources_missing_or_unknown_are_errors(tmp_path):
    tree = write_tree(tmp_path / "a", "lib.c $<TARGET_OBJECTS:gone>", {}, {"src/lib.c": ""})
    with pytest.raises(bhc.BuildError, match="object library gone"):
        bhc.cmake_sources(tree)
    tree = write_tree(tmp_path / "b", "lib.c other.c", {}, {"src/lib.c": ""})
    with pytest.raises(bhc.BuildError, match="not in the tree: src/other.c"):
        bhc.cmake_sources(tree)


@pytest.mark.skipif(not bhc.DEFAULT_SOURCE.is_dir(), reason="no HAMi-core mirror here")
def test_the_pinned_commit_lists_fifteen_sources(tmp_path):
    source = bhc.obtain_source(bhc.DEFAULT_SOURCE, bhc.PINNED_COMMIT, tmp_path)
    assert source.commit == bhc.PINNED_COMMIT
    sources = bhc.cmake_sources(source.tree)
    assert len(sources) == 15 and sources.count("src/cuda/hook.c") == 1
    assert sources[:3] == ["src/libvgpu.c", "src/utils.c", "src/log_utils.c"]
    config = bhc.render_static_config((source.tree / "src/static_config.h.in").read_text(), source.commit)
    assert "#define HOOK_NVML_ENABLE" in config and "/* #undef MEMORY_LIMIT_DEBUG */" in config


def test_static_config_is_what_cmake_makes_with_build_sh_options():
    template = textwrap.dedent(
        """\
        #cmakedefine MULTIPROCESS_LIMIT_ENABLE
        #cmakedefine MEMORY_LIMIT_DEBUG
        #cmakedefine DLSYM_HOOK_ENABLE
        #cmakedefine DLSYM_HOOK_DEBUG
        #cmakedefine HOOK_MEMINFO_ENABLE
        #cmakedefine HOOK_NVML_ENABLE
        extern size_t GIT_HASH_@GIT_HASH@;
        extern size_t GIT_BRANCH_@GIT_BRANCH@;
        """
    )
    assert bhc.render_static_config(template, "8f3a89c67b037d8fdfe6c4cd4d8c4f0cd6504811").splitlines() == [
        "#define MULTIPROCESS_LIMIT_ENABLE",
        "/* #undef MEMORY_LIMIT_DEBUG */",
        "#define DLSYM_HOOK_ENABLE",
        "/* #undef DLSYM_HOOK_DEBUG */",
        "#define HOOK_MEMINFO_ENABLE",
        "#define HOOK_NVML_ENABLE",
        "extern size_t GIT_HASH_8f3a89c;",
        "extern size_t GIT_BRANCH_unknown;",
    ]
    with pytest.raises(bhc.BuildError, match="@CUDA_HOME@"):
        bhc.render_static_config("#include <@CUDA_HOME@/x.h>\n", None)


# ------------------------------------------------------------- ELF checks


@needs_cc
def test_a_library_with_the_entry_points_and_only_glibc_passes(tmp_path):
    lib = compile_so(
        tmp_path,
        "good",
        all_exports_code()
        + '#include <math.h>\n#include <stdlib.h>\ndouble r(double x){return sqrt(x) + !getenv("X");}\n',
        "-lm",
    )
    info = bhc.check_library(lib)
    assert "libc.so.6" in info.needed and "libm.so.6" in info.needed
    assert set(info.needed) <= bhc.GLIBC_LIBRARIES
    assert set(bhc.REQUIRED_EXPORTS) <= info.exports
    assert info.unversioned_undefined == []
    floor = bhc.glibc_floor(info)
    assert floor is not None and floor >= (2, 2, 5)
    bhc.check_loads(lib)
    summary = bhc.describe(lib, info)
    assert summary["size"] == lib.stat().st_size and len(summary["sha256"]) == 64


@needs_cc
def test_a_missing_entry_point_is_named(tmp_path):
    lib = compile_so(tmp_path, "partial", "int cuInit(void){return 0;}\nstatic int dlsym(void){return 0;}\n")
    with pytest.raises(bhc.BuildError, match="does not export cuGetProcAddress .*dlsym"):
        bhc.check_library(lib)


@needs_cc
def test_a_hidden_entry_point_does_not_count(tmp_path):
    code = all_exports_code().replace("int cuInit(", '__attribute__((visibility("hidden"))) int cuInit(')
    lib = compile_so(tmp_path, "hidden", code)
    with pytest.raises(bhc.BuildError, match="does not export cuInit$"):
        bhc.check_library(lib)


@needs_cc
def test_a_library_beyond_glibc_is_refused(tmp_path):
    dep = compile_so(tmp_path, "libpeerdep", "int peer_dep(void){return 1;}\n")
    code = all_exports_code() + "int peer_dep(void);\nint use(void){return peer_dep();}\n"
    lib = compile_so(tmp_path, "needsdep", code, "-Wl,--no-as-needed", f"-L{tmp_path}", "-lpeerdep")
    assert dep.is_file()
    with pytest.raises(bhc.BuildError, match="beyond glibc: libpeerdep.so"):
        bhc.check_library(lib)


@needs_cc
def test_an_undefined_symbol_no_library_provides_is_refused(tmp_path):
    code = all_exports_code() + "int not_defined_anywhere(void);\nint use(void){return not_defined_anywhere();}\n"
    with pytest.raises(bhc.BuildError, match="no library provides: not_defined_anywhere"):
        bhc.check_library(compile_so(tmp_path, "undef", code))
    # A weak reference may stay unresolved: it is not an error.
    weak = all_exports_code() + "int maybe(void) __attribute__((weak));\nint use(void){return maybe ? maybe() : 0;}\n"
    assert bhc.check_library(compile_so(tmp_path, "weak", weak)).unversioned_undefined == []


@needs_cc
def test_not_a_shared_object(tmp_path):
    text = tmp_path / "text.so"
    text.write_text("not elf")
    with pytest.raises(bhc.BuildError, match="not an ELF file"):
        bhc.check_library(text)
    source = tmp_path / "main.c"
    source.write_text(all_exports_code() + "int main(void){return 0;}\n")
    exe = tmp_path / "main"
    subprocess.run([CC, "-no-pie", "-o", str(exe), str(source)], check=True, capture_output=True)
    with pytest.raises(bhc.BuildError, match="not a shared object"):
        bhc.check_library(exe)
    with pytest.raises(bhc.BuildError, match="no library at"):
        bhc.check_library(tmp_path / "absent.so")


# ----------------------------------------------------------- whole runs


def headers(tmp_path: Path) -> list[str]:
    cuda = tmp_path / "cuda"
    nvml = tmp_path / "nvml"
    for folder, name in ((cuda, "cuda.h"), (nvml, "nvml.h")):
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(f"#define STAND_IN_{name[:-2].upper()} 1\n")
    return ["--cuda-include", str(cuda), "--nvml-include", str(nvml)]


def stand_in_tree(root: Path, body: str) -> Path:
    """A tree shaped like HAMi-core's whose sources check the generated
    config and the include order, and export what interposition needs."""
    return write_tree(
        root,
        "libvgpu.c $<TARGET_OBJECTS:cuda_mod>",
        {"cuda": "add_library(cuda_mod OBJECT hook.c)\n"},
        {
            "src/static_config.h.in": "#cmakedefine DLSYM_HOOK_ENABLE\n#cmakedefine DLSYM_HOOK_DEBUG\n",
            "src/libvgpu.c": textwrap.dedent(
                """\
                #include <cuda.h>
                #include <nvml.h>
                #include "static_config.h"
                #if !defined(DLSYM_HOOK_ENABLE) || defined(DLSYM_HOOK_DEBUG) || !STAND_IN_CUDA || !STAND_IN_NVML
                #error the generated config or the include folders are wrong
                #endif
                """
            )
            + body,
            "src/cuda/hook.c": "#include <pthread.h>\nint cu_hook_thread(void){return (int)pthread_self();}\n",
        },
    )


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    code = bhc.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@needs_cc
def test_a_stand_in_tree_builds_and_is_checked(tmp_path, capsys):
    tree = stand_in_tree(tmp_path / "tree", all_exports_code())
    out = tmp_path / "out" / "libvgpu.so"
    argv = ["--source", str(tree), "--out", str(out), "--compiler", "gcc", "--cc", CC, *headers(tmp_path)]
    code, stdout, stderr = run_main(argv, capsys)
    assert code == 0, stderr
    assert out.is_file()
    info = json.loads((out.parent / "build.json").read_text())
    assert info["sha256"] == bhc.sha256_file(out) and info["size"] == out.stat().st_size
    assert info["sources"] == ["src/libvgpu.c", "src/cuda/hook.c"]
    assert info["compiler_kind"] == "gcc" and info["commit"] is None
    assert f"sha256:  {info['sha256']}" in stdout
    assert "commit is not checked" in stdout
    code, stdout, _ = run_main(["--check-only", "--out", str(out)], capsys)
    assert code == 0 and info["sha256"] in stdout


@pytest.mark.skipif(bhc.find_zig() is None, reason="no ziglang here")
def test_zig_builds_for_glibc_217(tmp_path, capsys):
    tree = stand_in_tree(
        tmp_path / "tree", all_exports_code() + '#include <stdio.h>\nint say(void){return puts("x");}\n'
    )
    out = tmp_path / "libvgpu.so"
    code, stdout, stderr = run_main(
        ["--source", str(tree), "--out", str(out), "--compiler", "zig", *headers(tmp_path)], capsys
    )
    assert code == 0, stderr
    info = bhc.check_library(out)
    assert bhc.glibc_floor(info) <= bhc.GLIBC_FLOOR
    assert "-fno-sanitize=all" in json.loads((tmp_path / "build.json").read_text())["command"]
    assert "(zig)" in stdout


@needs_cc
def test_a_compiler_failure_is_one_line_then_the_error(tmp_path, capsys):
    tree = stand_in_tree(tmp_path / "tree", "int broken(void) { return undeclared_thing; }\n")
    argv = ["--source", str(tree), "--out", str(tmp_path / "o.so"), "--compiler", "gcc", "--cc", CC]
    code, _, stderr = run_main([*argv, *headers(tmp_path)], capsys)
    assert code == 1
    lines = stderr.splitlines()
    assert lines[0] == "build_hami_core: error: gcc failed to build libvgpu.so (exit 1)"
    assert lines[1] == "errors:" and "undeclared_thing" in lines[2]
    assert not (tmp_path / "o.so").exists()


@needs_cc
def test_a_library_that_lacks_entry_points_is_not_installed(tmp_path, capsys):
    tree = stand_in_tree(tmp_path / "tree", "int cuInit(void){return 0;}\n")
    out = tmp_path / "o.so"
    argv = ["--source", str(tree), "--out", str(out), "--compiler", "gcc", "--cc", CC, *headers(tmp_path)]
    code, _, stderr = run_main(argv, capsys)
    assert code == 1 and "does not export cuGetProcAddress" in stderr
    assert not out.exists()


def test_setup_errors_are_one_line(tmp_path, capsys):
    hdr = headers(tmp_path)
    cases = [
        (["--source", str(tmp_path / "absent"), *hdr], "source .*absent does not exist"),
        (["--cuda-include", str(tmp_path)], "no cuda.h in"),
        (["--nvml-include", str(tmp_path), "--cuda-include", hdr[1]], "no nvml.h in"),
        (["--compiler", "gcc", "--cc", "no-such-cc-here", *hdr], "no C compiler 'no-such-cc-here'"),
        (["--source", str(tmp_path), *hdr], "neither a git directory nor a HAMi-core tree"),
        (["--check-only", "--out", str(tmp_path / "none.so")], "no library at"),
    ]
    for argv, pattern in cases:
        code, _, stderr = run_main(argv, capsys)
        assert code == 1, argv
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert stderr.startswith("build_hami_core: error: ")
        assert re.search(pattern, stderr), (pattern, stderr)


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_a_commit_the_repository_lacks_is_an_error(tmp_path, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    git = ["git", "-C", str(repo), "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "README").write_text("x\n")
    subprocess.run([*git, "add", "README"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True, env={**os.environ, **env})
    absent = "0" * 40
    code, _, stderr = run_main(["--source", str(repo), "--commit", absent, *headers(tmp_path)], capsys)
    assert code == 1
    assert (
        stderr.strip()
        == f"build_hami_core: error: commit {absent} is not in {repo}/.git (git rev-parse found no such commit)"
    )
    # The commit that is there resolves; the tree then lacks HAMi-core's CMake files.
    code, _, stderr = run_main(["--source", str(repo), "--commit", "HEAD", *headers(tmp_path)], capsys)
    assert code == 1 and "no src/CMakeLists.txt in the source tree" in stderr
