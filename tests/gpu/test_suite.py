"""The real-GPU suite, checked without a GPU: so that a GPU, when one is
lent, is spent running it and not fixing typos. Its CUDA programs compile
with nvcc 13.0 (what the GPU machines' driver supports), its Python passes
ruff, its options and set-up errors say what is wrong, and the parts that
turn readings into verdicts are right."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RUN = HERE / "run.py"
# Where scripts/test installs requirements-nvcc.txt.
NVCC_ROOT = Path(os.environ.get("VGPU_NVCC_ROOT", REPO / ".cache/cuda-nvcc")) / "nvidia/cu13"

spec = importlib.util.spec_from_file_location("gpu_suite", RUN)
suite = importlib.util.module_from_spec(spec)
sys.modules["gpu_suite"] = suite  # dataclasses look their module up there
spec.loader.exec_module(suite)


def run(*args, env=None):
    return subprocess.run([sys.executable, str(RUN), *args], capture_output=True, text=True, env=env, check=False)


def nvcc_env():
    if not (NVCC_ROOT / "bin/nvcc").is_file():
        pytest.fail(f"nvcc 13.0 is not installed at {NVCC_ROOT}: scripts/test installs tests/gpu/requirements-nvcc.txt")
    env = dict(os.environ)
    # The wheels keep cudart's static library in lib/, where nvcc's own
    # profile does not look.
    env["LIBRARY_PATH"] = str(NVCC_ROOT / "lib")
    return env


def test_the_pinned_compiler_is_cuda_13_0():
    out = subprocess.run([NVCC_ROOT / "bin/nvcc", "--version"], capture_output=True, text=True, env=nvcc_env(),
                         check=True).stdout
    assert "release 13.0," in out, out


def test_every_cuda_program_compiles_for_hopper(tmp_path):
    done = run("--build-only", "--nvcc", str(NVCC_ROOT / "bin/nvcc"), "--arch", "sm_90", "--workdir", str(tmp_path),
               env=nvcc_env())
    assert done.returncode == 0, done.stderr
    for name in suite.CUDA_PROGRAMS:
        binary = tmp_path / "bin" / name
        assert binary.is_file() and os.access(binary, os.X_OK), name
        # nvcc's default: cudart linked in, no libcudart.so needed at run time.
        needed = subprocess.run(["readelf", "-d", binary], capture_output=True, text=True, check=True).stdout
        assert "libcudart" not in needed, needed


def test_a_compile_error_is_reported_with_the_compiler_output(tmp_path, monkeypatch):
    broken = tmp_path / "programs"
    broken.mkdir()
    for name in suite.CUDA_PROGRAMS:
        (broken / f"{name}.cu").write_text("int main() { return undeclared; }\n")
    monkeypatch.setattr(suite, "PROGRAMS", broken)
    monkeypatch.setenv("LIBRARY_PATH", str(NVCC_ROOT / "lib"))
    with pytest.raises(suite.SetupError, match="undeclared"):
        suite.build(str(NVCC_ROOT / "bin/nvcc"), "sm_90", tmp_path / "bin")


def test_python_passes_the_linter():
    # Every Python file under tests/, this suite's first (tests/ruff.toml).
    done = subprocess.run([Path(sys.executable).parent / "ruff", "check", str(HERE.parent)], capture_output=True,
                          text=True, cwd=HERE.parent, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_python_programs_explain_their_options():
    # They import their framework only when they run, so --help works here.
    for program, option in (("frameworks.py", "--framework"), ("torch_loop.py", "matmul")):
        done = subprocess.run([sys.executable, HERE / "programs" / program, "--help"], capture_output=True,
                              text=True, check=False)
        assert done.returncode == 0 and option in done.stdout, done.stdout + done.stderr


def test_help_and_list_name_every_check():
    helped = run("--help")
    listed = run("--list")
    assert helped.returncode == 0 and listed.returncode == 0
    for name in suite.CHECKS:
        assert name in helped.stdout and name in listed.stdout


def test_an_unknown_check_is_refused_with_the_valid_names():
    done = run("--only", "smi,nosuch")
    assert done.returncode == 2
    assert "unknown check nosuch" in done.stderr and "static-cudart" in done.stderr


def test_no_gpu_is_a_set_up_error_not_a_failure(tmp_path):
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"")
    env = nvcc_env()
    env["PATH"] = "/usr/bin:/bin"  # no nvidia-smi on this machine or in these folders
    done = run("--only", "smi", "--lib", str(library), "--nvcc", str(NVCC_ROOT / "bin/nvcc"), "--arch", "sm_90",
               "--workdir", str(tmp_path), env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no NVIDIA GPU here" in done.stderr


def test_a_missing_library_is_named(tmp_path):
    done = run("--lib", str(tmp_path / "nothing.so"), "--nvcc", str(NVCC_ROOT / "bin/nvcc"), "--arch", "sm_90",
               "--workdir", str(tmp_path), env=nvcc_env())
    assert done.returncode == 2 and "nothing.so: no such file" in done.stderr


def test_nvidia_smi_csv_is_parsed_or_refused():
    assert suite.parse_memory_csv("memory.total [MiB], memory.used [MiB]\n4096 MiB, 1280 MiB\n") == (4096, 1280)
    for bad in ("4096 MiB, 1280 MiB\n", "memory.total [MiB], memory.used [MiB]\n4096, 1280\n",
                "memory.total [MiB], memory.used [MiB]\n[vgpu] 4096 MiB, 1280 MiB\n", ""):
        with pytest.raises(ValueError):
            suite.parse_memory_csv(bad)
    assert suite.parse_compute_apps("123, 1280\n456, 64\nNo running processes found\n") == {123: 1280, 456: 64}


class Rows:
    def __init__(self):
        self.rows = []

    def add(self, check, target, measured, outcome):
        self.rows.append(suite.Row(check, target, measured, outcome))


def test_a_share_passes_only_within_three_points():
    rows = Rows()
    suite.share_row(rows, "at 50", 50, rate=52.9, uncapped=100, utilization=55)
    suite.share_row(rows, "at 50", 50, rate=46.9, uncapped=100, utilization=None)
    assert [r.verdict for r in rows.rows] == ["pass", "fail"]
    assert "52.9 %" in rows.rows[0].measured and "NVML utilization 55 %" in rows.rows[0].measured


def test_a_share_with_device_time_is_judged_by_device_time():
    rows = Rows()
    # 29 % of the throughput but 25.5 % of the device's time: the capped
    # GPU ran at higher clocks than the loaded reference.
    suite.share_row(rows, "at 25", 25, rate=29, uncapped=100, utilization=26, time_share=25.5)
    suite.share_row(rows, "at 25", 25, rate=25, uncapped=100, utilization=30, time_share=30)
    assert [r.verdict for r in rows.rows] == ["pass", "fail"]
    assert "25.5 % of the device's time (29.0 % of the uncapped throughput)" in rows.rows[0].measured


def test_small_kernels_fail_only_above_their_share():
    rows = Rows()
    suite.share_row(rows, "small", 50, rate=40, uncapped=100, utilization=40, known_limit=True)
    suite.share_row(rows, "small", 50, rate=54, uncapped=100, utilization=54, known_limit=True)
    assert [r.verdict for r in rows.rows] == ["pass", "info", "fail", "info"]


def test_the_table_escapes_cells():
    table = suite.markdown_table([suite.Row("a|b", "t", "line\nbreak", "pass")])
    assert table.splitlines()[2] == "| a\\|b | t | line break | pass |"


def test_a_sampler_without_readings_refuses_to_report_a_peak():
    class FakeNvml:
        class NVMLError(Exception):
            pass

        @staticmethod
        def nvmlDeviceGetMemoryInfo(handle):
            raise FakeNvml.NVMLError("gone")

    class Memory:
        used = 0

    nvml = FakeNvml()
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: Memory()
    sampler = suite.NvmlSampler(nvml, None)
    with pytest.raises(suite.SamplingFailed, match="no NVML reading"):
        sampler.peak_device_mib()
    nvml.nvmlDeviceGetMemoryInfo = FakeNvml.nvmlDeviceGetMemoryInfo
    sampler.sample()
    with pytest.raises(suite.SamplingFailed, match="gone"):
        sampler.peak_device_mib()


def test_shim_variables_never_leak_into_a_plain_run(monkeypatch, tmp_path):
    for name in ("LD_PRELOAD", "CUDA_DEVICE_MEMORY_LIMIT_1", "CUDA_DEVICE_SM_LIMIT", "VGPU_SWAP_LIMIT",
                 "PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MEMORY_SHARED_CACHE"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    state = suite.Suite(tmp_path / "libvgpu.so", tmp_path, sys.executable, 4096, None, None)
    plain = state.plain_env()
    assert not [k for k in plain if suite.SHIM_VARIABLE.match(k)]
    assert plain["CUDA_VISIBLE_DEVICES"] == "0"
    capped = state.shim_env(cap_mib=4096, share=30)
    assert capped["LD_PRELOAD"] == str(tmp_path / "libvgpu.so")
    assert capped["CUDA_DEVICE_MEMORY_LIMIT"] == "4096m" and capped["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert capped["CUDA_DEVICE_MEMORY_SHARED_CACHE"] != state.shim_env()["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    assert "CUDA_DEVICE_MEMORY_SHARED_CACHE" not in state.shim_env(container=False)
