"""The image, as a user builds it: deploy/images/Dockerfile built by buildah
(no daemon: vfs storage and chroot isolation in a folder of the test's own).

No container registry is reachable here, so the runtime stage's base image
is made locally from a debootstrap root of the same Debian release, and the
build stage's output is the host build the other tests test (buildah's
`--build-context build=...`): the image then holds exactly the binaries
tested, and the test checks that it does, byte for byte, and that each runs
in the image's own root.

Needs root, buildah and debootstrap (scripts/test installs them); without
them it skips, except under CI, where it fails.
"""

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "common"))
import debian_root as debian_roots  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "images" / "Dockerfile"
TARGET = pathlib.Path(os.environ.get("VGPU_TARGET_DIR", ROOT / "target" / "release")).resolve()
ZIG_TARGET = ROOT / "target" / "x86_64-unknown-linux-gnu" / "release"
BINARIES = ("vgpu-device-plugin", "vgpu-dra", "vgpu-monitor", "vgpu-scheduler")
IMAGE = "localhost/vgpu:test"


def unavailable(reason):
    # CI runs as root with buildah and debootstrap installed by
    # scripts/test: a skip there would hide a test that never ran.
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(reason)


def runtime_release() -> str:
    found = re.search(r"^FROM debian:(\w+)-slim$", DOCKERFILE.read_text(), re.M)
    assert found, "the runtime stage names no debian:<release>-slim image"
    return found.group(1)


def shipped_shim() -> pathlib.Path:
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    return pathlib.Path(named).resolve() if named else ZIG_TARGET / "libvgpu.so"


def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Buildah:
    """buildah with storage, registries and isolation of the test's own."""

    def __init__(self, folder: pathlib.Path):
        storage = folder / "storage.conf"
        storage.write_text(
            "[storage]\n"
            'driver = "vfs"\n'
            f'runroot = "{folder / "run"}"\n'
            f'graphroot = "{folder / "graph"}"\n'
        )
        registries = folder / "registries.conf"
        registries.write_text("unqualified-search-registries = []\n")
        self.env = dict(
            os.environ,
            CONTAINERS_STORAGE_CONF=str(storage),
            CONTAINERS_REGISTRIES_CONF=str(registries),
            BUILDAH_ISOLATION="chroot",
        )

    def __call__(self, *args: str, timeout: int = 600) -> str:
        done = subprocess.run(["buildah", *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        assert done.returncode == 0, f"buildah {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("buildah's vfs storage and chroot need root")
    for tool in ("buildah", "debootstrap", "tar"):
        if not shutil.which(tool):
            unavailable(f"{tool} is not installed")
    missing = [str(p) for p in [*(TARGET / b for b in BINARIES), shipped_shim()] if not p.is_file()]
    if missing:
        pytest.fail(f"build these first (scripts/test does): {', '.join(missing)}")
    folder = tmp_path_factory.mktemp("image")
    buildah = Buildah(folder)
    release = runtime_release()
    try:
        base_root = debian_roots.debian_root(release)
    except debian_roots.DebootstrapError as error:
        pytest.fail(str(error))

    # The base image the Dockerfile names, made from that root.
    base_tar = folder / "base.tar"
    subprocess.run(["tar", "--numeric-owner", "-C", str(base_root), "-cf", str(base_tar), "."], check=True)
    container = buildah("from", "scratch").strip()
    buildah("add", container, str(base_tar), "/")
    buildah("commit", "--rm", container, f"docker.io/library/debian:{release}-slim")

    # The build stage's output: the host build, where the stage puts it.
    context = folder / "build"
    release_dir = context / "src" / "target" / "release"
    zig_dir = context / "src" / "target" / "x86_64-unknown-linux-gnu" / "release"
    release_dir.mkdir(parents=True)
    zig_dir.mkdir(parents=True)
    for binary in BINARIES:
        shutil.copy2(TARGET / binary, release_dir / binary)
    shutil.copy2(shipped_shim(), zig_dir / "libvgpu.so")
    buildah("bud", "--pull-never", "--build-context", f"build={context}", "-f", str(DOCKERFILE),
            "-t", IMAGE, str(ROOT))

    container = buildah("from", "--pull-never", IMAGE).strip()
    mounted = pathlib.Path(buildah("mount", container).strip())
    yield buildah, mounted
    buildah("umount", container)
    buildah("rm", container)


def test_the_image_holds_exactly_the_tested_binaries(image):
    _, mounted = image
    for binary in BINARIES:
        shipped = mounted / "usr/local/bin" / binary
        assert shipped.is_file(), f"{binary} is not in the image"
        assert digest(shipped) == digest(TARGET / binary), f"{binary} in the image is not the one tested"
        assert os.access(shipped, os.X_OK), f"{binary} is not executable"
    shim = mounted / "usr/local/lib/vgpu/libvgpu.so"
    assert digest(shim) == digest(shipped_shim()), "the image's libvgpu.so is not the shipped build tested"


def test_each_binary_runs_in_the_image_root(image):
    # In the image's own root: its libraries (the runtime stage's Debian)
    # are enough for every binary.
    _, mounted = image
    for binary in BINARIES:
        done = subprocess.run(["chroot", str(mounted), f"/usr/local/bin/{binary}", "--help"],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, f"{binary} --help in the image: {done.returncode}\n{done.stderr[-2000:]}"
        assert "Usage" in done.stdout, done.stdout[:500]


def test_the_image_runs_as_root_with_no_entrypoint(image):
    buildah, _ = image
    config = json.loads(buildah("inspect", "--type", "image", IMAGE))
    docker = config.get("Docker", {}).get("config", {})
    assert docker.get("User") in ("0", None), docker
    assert not docker.get("Entrypoint"), docker
