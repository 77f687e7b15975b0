"""Container images made without a daemon or a registry, for the image test
and the real-node tests: buildah with vfs storage and chroot isolation in a
folder of the caller's own.

No registry is reachable here, so a base image is made from a debootstrap
root of the Debian release the Dockerfile names, and vgpu's image is built
from deploy/images/Dockerfile with the host build as its build stage's
output (`--build-context build=...`): the image then holds exactly the
binaries the tests test. Small images (a pause container, a program on the
Debian base) are assembled with `buildah from/copy/config/commit`."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess

import debian_root as debian_roots

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "images" / "Dockerfile"
TARGET = pathlib.Path(os.environ.get("VGPU_TARGET_DIR", ROOT / "target" / "release")).resolve()
ZIG_TARGET = ROOT / "target" / "x86_64-unknown-linux-gnu" / "release"
BINARIES = ("vgpu-device-plugin", "vgpu-dra", "vgpu-monitor", "vgpu-scheduler")


class ImageError(Exception):
    """A build step failed, or what it needs is missing."""


def runtime_release() -> str:
    """The Debian release of the Dockerfile's runtime stage."""
    found = re.search(r"^FROM debian:(\w+)-slim$", DOCKERFILE.read_text(), re.M)
    if not found:
        raise ImageError(f"{DOCKERFILE}'s runtime stage names no debian:<release>-slim image")
    return found.group(1)


def shipped_shim() -> pathlib.Path:
    named = os.environ.get("VGPU_SHIM_LIBRARY")
    return pathlib.Path(named).resolve() if named else ZIG_TARGET / "libvgpu.so"


def missing_tools() -> list[str]:
    return [tool for tool in ("buildah", "debootstrap", "tar") if not shutil.which(tool)]


class Buildah:
    """buildah with storage, registries and isolation of `folder`'s own."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
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
        if done.returncode != 0:
            raise ImageError(f"buildah {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done.stdout

    def debian_base(self) -> str:
        """docker.io/library/debian:<release>-slim, the Dockerfile's base,
        made from a debootstrap root of that release; returns its name."""
        release = runtime_release()
        name = f"docker.io/library/debian:{release}-slim"
        try:
            base_root = debian_roots.debian_root(release)
        except debian_roots.DebootstrapError as error:
            raise ImageError(str(error)) from error
        base_tar = self.folder / "base.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(base_root), "-cf", str(base_tar), "."], check=True)
        container = self("from", "scratch").strip()
        self("add", container, str(base_tar), "/")
        self("commit", "--rm", container, name)
        base_tar.unlink()
        return name

    def vgpu(self, name: str) -> str:
        """deploy/images/Dockerfile built as `name`, its build stage's output
        the host build (needs the base image: `debian_base` first)."""
        missing = [str(p) for p in [*(TARGET / b for b in BINARIES), shipped_shim()] if not p.is_file()]
        if missing:
            raise ImageError(f"build these first (scripts/test does): {', '.join(missing)}")
        context = self.folder / "build"
        release_dir = context / "src" / "target" / "release"
        zig_dir = context / "src" / "target" / "x86_64-unknown-linux-gnu" / "release"
        release_dir.mkdir(parents=True, exist_ok=True)
        zig_dir.mkdir(parents=True, exist_ok=True)
        for binary in BINARIES:
            shutil.copy2(TARGET / binary, release_dir / binary)
        shutil.copy2(shipped_shim(), zig_dir / "libvgpu.so")
        self("bud", "--pull-never", "--build-context", f"build={context}", "-f", str(DOCKERFILE),
             "-t", name, str(ROOT))
        return name

    def assemble(self, name: str, base: str, files: dict[str, pathlib.Path], entrypoint: list[str] | None = None,
                 user: str | None = None, env: dict[str, str] | None = None) -> str:
        """An image `name` of `base` ("scratch" for none) with `files` ({path
        in the image: file here}) added, executable as they are, and `env`
        in its configuration (as a Dockerfile's ENV)."""
        container = self("from", "--pull-never", base).strip()
        for inside, outside in files.items():
            self("copy", container, str(outside), inside)
        for key, value in (env or {}).items():
            self("config", "--env", f"{key}={value}", container)
        if entrypoint:
            self("config", "--entrypoint", json.dumps(entrypoint), container)
        if user:
            self("config", "--user", user, container)
        self("commit", "--rm", container, name)
        return name

    def remove_storage(self) -> None:
        """Every image and container of this storage, gone from disk."""
        self("rm", "--all")
        shutil.rmtree(self.folder / "graph", ignore_errors=True)
        shutil.rmtree(self.folder / "run", ignore_errors=True)
        shutil.rmtree(self.folder / "build", ignore_errors=True)

    def export(self, name: str, archive: pathlib.Path) -> pathlib.Path:
        """Image `name` as a docker-archive file, for `ctr images import`."""
        self("push", name, f"docker-archive:{archive}:{name}")
        return archive
