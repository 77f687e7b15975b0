"""Minimal Debian roots made by debootstrap, once per machine and suite,
kept under .cache/debootstrap/SUITE: the old root the glibc-floor tests
preload the shim in, and the base image the image is built on (no registry
is reachable here, so the base image is made from the same Debian release).
Callers copy a root; they never change it."""

import fcntl
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "debootstrap"


class DebootstrapError(Exception):
    """debootstrap failed, or no apt source names the mirror to use."""


def debian_mirror() -> str:
    """The Debian archive apt uses here: the source serving this machine's
    own release (not -updates or -security)."""
    release = dict(
        line.split("=", 1) for line in pathlib.Path("/etc/os-release").read_text().splitlines() if "=" in line
    )
    codename = release.get("VERSION_CODENAME", "").strip('"')
    sources = [pathlib.Path("/etc/apt/sources.list"), *sorted(pathlib.Path("/etc/apt/sources.list.d").glob("*"))]
    for source in sources:
        if not source.is_file():
            continue
        text = source.read_text()
        if source.suffix == ".sources":  # deb822 stanzas
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.MULTILINE))
                if "deb" in fields.get("Types", "").split() and codename in fields.get("Suites", "").split():
                    return fields["URIs"].split()[0]
        else:  # one-line entries: deb [options] URI suite components...
            for line in text.splitlines():
                words = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()
                if len(words) >= 3 and words[0] == "deb" and words[2] == codename:
                    return words[1]
    raise DebootstrapError(
        f"no apt source for Debian {codename or '(unknown release)'} in {', '.join(map(str, sources))}"
    )


def debian_root(suite: str) -> pathlib.Path:
    """A minimal Debian root of `suite` (made on first use; needs root and
    debootstrap)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / suite
    # Two test runs on one machine wait for one bootstrap.
    with open(CACHE / f"{suite}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not root.is_dir():
            # Made aside and renamed when complete: a killed run leaves no
            # half-made root behind under the cached name.
            partial = CACHE / f"{suite}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            mirror = debian_mirror()
            done = subprocess.run(
                ["debootstrap", "--variant=minbase", suite, str(partial), mirror],
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            if done.returncode != 0:
                log = (partial / "debootstrap" / "debootstrap.log").read_text()[-3000:] if partial.exists() else ""
                raise DebootstrapError(
                    f"debootstrap {suite} from {mirror} failed ({done.returncode}):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{log}"
                )
            partial.rename(root)
    return root
