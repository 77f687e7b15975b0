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
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "common"))
from images import BINARIES, TARGET, Buildah, ImageError, missing_tools, shipped_shim  # noqa: E402

IMAGE = "localhost/vgpu:test"


def unavailable(reason):
    # CI runs as root with buildah and debootstrap installed by
    # scripts/test: a skip there would hide a test that never ran.
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test")
    pytest.skip(reason)


def digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    if os.geteuid() != 0:
        unavailable("buildah's vfs storage and chroot need root")
    if missing_tools():
        unavailable(f"not installed: {', '.join(missing_tools())}")
    buildah = Buildah(tmp_path_factory.mktemp("image"))
    try:
        buildah.debian_base()
        buildah.vgpu(IMAGE)
    except ImageError as error:
        pytest.fail(str(error))
    container = buildah("from", "--pull-never", IMAGE).strip()
    mounted = pathlib.Path(buildah("mount", container).strip())
    yield buildah, mounted
    buildah("umount", container)
    buildah("rm", container)
    buildah.remove_storage()


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
