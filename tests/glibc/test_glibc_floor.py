"""The shipped shim on an old glibc, loaded the way a node loads it.

The shim is preloaded into every program of a container, whatever glibc the
image has, so it is built for glibc 2.17 (`cargo zigbuild ... --target
x86_64-unknown-linux-gnu.2.17`). These tests check that build with
check_symbols.py, then run it from /etc/ld.so.preload in a Debian root older
than this machine's glibc (made by debootstrap and cached under .cache/):
ordinary programs start, a capped CUDA program on the simulated GPU is
refused past its cap, and a host build of the shim, preloaded the same way,
stops every program.

Needs root (chroot, debootstrap) and debootstrap; without them the chroot
tests skip, except under CI, where they fail.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "common"))
import debian_root as debian_roots  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECKER = pathlib.Path(__file__).resolve().parent / "check_symbols.py"
FLOOR = "2.17"
# What scripts/test builds with cargo-zigbuild, and the host build beside the tests.
ZIG_TARGET = ROOT / "target" / "x86_64-unknown-linux-gnu" / "release"
HOST_TARGET = pathlib.Path(os.environ.get("VGPU_TARGET_DIR", ROOT / "target" / "release")).resolve()
ZIGBUILD = (
    "PATH=$PWD/.venv/bin:$PATH cargo zigbuild --release -p vgpu-shim -p simgpu --target x86_64-unknown-linux-gnu.2.17"
)
# The oldest Debian suite the package mirror still serves (its glibc: 2.31).
SUITE = "bullseye"
MIB = 1 << 20


def version(text):
    return tuple(int(part) for part in text.split("."))


def unavailable(reason):
    # CI runs as root with debootstrap installed by scripts/test: a skip
    # there would hide a test that never ran.
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(reason)


def shipped_shim():
    """The library under test: $VGPU_SHIM_LIBRARY (as in testkit and
    tests/python) or the zigbuild output."""
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    path = pathlib.Path(named).resolve() if named else ZIG_TARGET / "libvgpu.so"
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with `{ZIGBUILD}`")
    return path


def built(path, how):
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with `{how}`")
    return path


def check(*libraries):
    return subprocess.run(
        [sys.executable, str(CHECKER), "--floor", FLOOR, *map(str, libraries)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# ---------------------------------------------------------------- the checker


def test_the_shipped_shim_and_simulated_gpu_need_nothing_past_the_floor():
    libraries = [shipped_shim(), built(ZIG_TARGET / "libsimgpu.so", ZIGBUILD)]
    result = check(*libraries)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    highest = re.findall(r"highest glibc symbol version GLIBC_([\d.]+)", result.stdout)
    assert len(highest) == len(libraries), result.stdout
    assert all(version(found) <= version(FLOOR) for found in highest), result.stdout


def test_the_checker_refuses_a_host_build():
    host = built(HOST_TARGET / "libvgpu.so", "cargo build --release -p vgpu-shim")
    result = check(host)
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    # Each too-new version is named with the symbols that need it.
    newer = re.findall(
        rf"^error: {re.escape(str(host))} needs GLIBC_([\d.]+), newer than the {FLOOR} floor, "
        r"for: (\w+)",
        result.stderr,
        re.MULTILINE,
    )
    assert newer, result.stderr
    assert all(version(found) > version(FLOOR) for found, _ in newer), result.stderr


def test_the_checker_refuses_a_library_outside_glibc(tmp_path):
    # A library that needs a library of its own: not there on a user's image.
    (tmp_path / "other.c").write_text("int other(void) { return 1; }\n")
    (tmp_path / "user.c").write_text("int other(void);\nint user(void) { return other(); }\n")
    for argv in (
        ["cc", "-shared", "-fPIC", "-o", "libother.so", "other.c"],
        ["cc", "-shared", "-fPIC", "-o", "libuser.so", "user.c", "-L.", "-lother"],
    ):
        subprocess.run(argv, cwd=tmp_path, check=True)
    result = check(tmp_path / "libuser.so")
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    assert f"error: {tmp_path / 'libuser.so'} needs libother.so, which is not one of glibc's libraries" in (
        result.stderr
    ), result.stderr


# ---------------------------------------------------------------- the old root


@pytest.fixture(scope="session")
def debian_root():
    """A minimal Debian root of SUITE (tests/common/debian_root.py)."""
    if os.geteuid() != 0:
        unavailable("chroot and debootstrap need root")
    if not shutil.which("debootstrap"):
        unavailable("debootstrap is not installed (apt-get install debootstrap)")
    try:
        return debian_roots.debian_root(SUITE)
    except debian_roots.DebootstrapError as error:
        pytest.fail(str(error))


class OldRoot:
    """A copy of the Debian root with the shim, the simulated GPU and the
    capped program in /opt/vgpu, as a node's init container puts them."""

    SHIM = "/opt/vgpu/libvgpu.so"
    HOST_SHIM = "/opt/vgpu/host/libvgpu.so"
    LIB = "/opt/vgpu/lib"
    PROBE = "/opt/vgpu/bin/probe"

    def __init__(self, path):
        self.path = path

    def inside(self, name):
        return self.path / name.lstrip("/")

    def preload(self, library):
        self.inside("/etc/ld.so.preload").write_text(f"{library}\n" if library else "")

    def run(self, argv, env=None):
        """Runs argv inside the root with only `env` (plus PATH)."""
        return subprocess.run(
            ["chroot", str(self.path), *argv],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


@pytest.fixture(scope="module")
def old_root(debian_root, tmp_path_factory):
    libraries = tmp_path_factory.mktemp("zig-programs")
    probe = libraries / "probe"
    # The capped program, built for the same glibc floor as the shim (the
    # test programs built by testkit need this machine's glibc).
    programs = ROOT / "testkit" / "programs"
    compiled = subprocess.run(
        [
            sys.executable,
            "-m",
            "ziglang",
            "cc",
            "-target",
            f"x86_64-linux-gnu.{FLOOR}",
            "-O2",
            "-Wall",
            "-Werror",
            "-Wno-deprecated-declarations",
            f"-I{programs}",
            "-o",
            str(probe),
            str(programs / "probe.c"),
            "-ldl",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert compiled.returncode == 0, (
        f"zig cc probe.c failed (pip install -r tests/glibc/requirements.txt):\n{compiled.stderr}"
    )

    # Outside pytest's kept temporary folders: a copy is 200+ MiB.
    copy = pathlib.Path(tempfile.mkdtemp(prefix="vgpu-old-root-"))
    try:
        subprocess.run(["cp", "-a", f"{debian_root}/.", str(copy)], check=True)
        root = OldRoot(copy)
        for directory in (root.LIB, "/opt/vgpu/bin", "/opt/vgpu/host"):
            root.inside(directory).mkdir(parents=True)
        shutil.copy2(shipped_shim(), root.inside(root.SHIM))
        shutil.copy2(built(HOST_TARGET / "libvgpu.so", "cargo build --release"), root.inside(root.HOST_SHIM))
        shutil.copy2(built(ZIG_TARGET / "libsimgpu.so", ZIGBUILD), root.inside(f"{root.LIB}/libsimgpu.so"))
        # The simulated GPU answers to the names of NVIDIA's driver libraries.
        for alias in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
            root.inside(f"{root.LIB}/{alias}").symlink_to("libsimgpu.so")
        shutil.copy2(probe, root.inside(root.PROBE))

        root.preload(None)
        glibc = root.run(["getconf", "GNU_LIBC_VERSION"])
        assert glibc.returncode == 0, glibc.stderr
        root.glibc = glibc.stdout.split()[-1]
        # The contrast below means something only on a glibc older than the
        # host build needs, and the floor must be at or below it.
        assert version(FLOOR) <= version(root.glibc) < (2, 34), f"{SUITE} has glibc {root.glibc}"
        yield root
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_ordinary_programs_start_with_the_shipped_shim_preloaded(old_root):
    old_root.preload(OldRoot.SHIM)
    # ld.so ignores a preload it cannot load and runs the program anyway:
    # its own trace shows the shim was loaded and its constructor ran.
    started = old_root.run(["/usr/bin/env", "LD_DEBUG=files", "/bin/sh", "-c", "true"])
    assert started.returncode == 0, started.stderr
    assert f"calling init: {OldRoot.SHIM}" in started.stderr, started.stderr

    listed = old_root.run(["/bin/ls", "/opt/vgpu"])
    assert (listed.returncode, listed.stderr) == (0, ""), listed
    assert "libvgpu.so" in listed.stdout.split(), listed.stdout
    # A C++ program, with libstdc++ and libgcc_s of that release.
    apt = old_root.run(["apt-get", "--version"])
    assert (apt.returncode, apt.stderr) == (0, ""), apt
    assert apt.stdout.startswith("apt "), apt.stdout


def test_a_host_build_preloaded_stops_every_program(old_root):
    old_root.preload(OldRoot.HOST_SHIM)
    result = old_root.run(["/bin/true"])
    assert result.returncode != 0, result
    missing = re.findall(
        rf"version `GLIBC_([\d.]+)' not found \(required by {re.escape(OldRoot.HOST_SHIM)}\)", result.stderr
    )
    assert missing, result.stderr
    assert all(version(found) > version(old_root.glibc) for found in missing), result.stderr


def fill(root, name, limit):
    """`probe dlsym fill 64MiB` on a 2 GiB simulated GPU, the shim coming
    from /etc/ld.so.preload alone (no LD_PRELOAD)."""
    env = {
        "LD_LIBRARY_PATH": OldRoot.LIB,
        "SIMGPU_DEVICES": "1",
        "SIMGPU_MEMORY": "2Gi",
        "SIMGPU_STATE": f"/tmp/{name}.simgpu",
        "CUDA_DEVICE_MEMORY_SHARED_CACHE": f"/tmp/{name}.region",
        "VGPU_CONTEXT_RESERVE": "0",
    }
    if limit:
        env["CUDA_DEVICE_MEMORY_LIMIT"] = limit
    result = root.run([OldRoot.PROBE, "dlsym", "fill", str(64 * MIB)], env=env)
    assert result.returncode == 0, result
    return {key: int(value) for key, value in (line.split("=", 1) for line in result.stdout.splitlines())}


def test_a_capped_program_is_refused_past_its_cap(old_root):
    old_root.preload(OldRoot.SHIM)
    capped = fill(old_root, "capped", "1Gi")
    assert capped["chunks"] == 16, capped
    assert capped["refusal"] == 2, f"CUDA_ERROR_OUT_OF_MEMORY: {capped}"
    assert capped["mem_total"] == 1024 * MIB, capped
    assert capped["free_after"] == 1024 * MIB, capped
    # Without a cap the same program fills the whole simulated device.
    uncapped = fill(old_root, "uncapped", None)
    assert uncapped["chunks"] == 32, uncapped
