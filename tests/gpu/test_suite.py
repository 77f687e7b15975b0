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
    """Collects what a check reports, as Suite.add does."""

    def __init__(self):
        self.rows = []

    def add(self, check, target, column, measured, outcome):
        self.rows.append(suite.Row(check, target, {column: suite.Cell(measured, outcome)}))

    def verdicts(self):
        return [next(iter(r.cells.values())).verdict for r in self.rows]

    def measured(self, index):
        return next(iter(self.rows[index].cells.values())).measured


def test_a_share_passes_only_within_three_points():
    rows = Rows()
    suite.share_row(rows, "at 50", "vgpu", 50, rate=52.9, uncapped=100, utilization=55)
    suite.share_row(rows, "at 50", "vgpu", 50, rate=46.9, uncapped=100, utilization=None)
    assert rows.verdicts() == ["pass", "fail"]
    assert "52.9 %" in rows.measured(0) and "NVML utilization 55 %" in rows.measured(0)


def test_a_share_with_device_time_is_judged_by_device_time():
    rows = Rows()
    # 29 % of the throughput but 25.5 % of the device's time: the capped
    # GPU ran at higher clocks than the loaded reference.
    suite.share_row(rows, "at 25", "vgpu", 25, rate=29, uncapped=100, utilization=26, time_share=25.5)
    suite.share_row(rows, "at 25", "vgpu", 25, rate=25, uncapped=100, utilization=30, time_share=30)
    assert rows.verdicts() == ["pass", "fail"]
    assert "25.5 % of the device's time (29.0 % of the uncapped throughput)" in rows.measured(0)


def test_small_kernels_fail_only_above_their_share():
    rows = Rows()
    suite.share_row(rows, "small", "vgpu", 50, rate=40, uncapped=100, utilization=40, known_limit=True)
    suite.share_row(rows, "small", "vgpu", 50, rate=54, uncapped=100, utilization=54, known_limit=True)
    assert rows.verdicts() == ["pass", "info", "fail", "info"]


def test_containers_running_one_kernel_split_the_device_time_by_their_rates():
    assert suite.split_by_rate(90, [100, 200]) == [30, 60]
    assert suite.split_by_rate(None, [1, 2]) == [None, None]
    assert suite.split_by_rate(90, [0, 0]) == [None, None]


def test_the_table_has_a_column_per_library_and_escapes_cells():
    rows = [suite.Row("a|b", "t", {suite.DRIVER: suite.Cell("line\nbreak", "info"),
                                   "vgpu": suite.Cell("1", "pass"), "peer": suite.Cell("2", "fail")}),
            suite.Row("swap", "t", {"vgpu": suite.Cell("3", "pass"), "peer": suite.Cell("none", "n/a")})]
    table = suite.markdown_table(rows, [suite.DRIVER, "vgpu", "peer"]).splitlines()
    assert table[0] == "| check | target | driver alone | vgpu | peer |"
    assert table[2] == "| a\\|b | t | line break | **pass**: 1 | **fail**: 2 |"
    assert table[3] == "| swap | t |  | **pass**: 3 | **n/a**: none |"
    # Only judged cells count; n/a and info do not.
    assert suite.tally(rows, "vgpu") == (2, 0)
    assert suite.tally(rows, "peer") == (1, 1)


def test_a_suite_merges_every_column_of_a_check_into_one_row(tmp_path):
    state = suite.Suite([suite.Library("vgpu", tmp_path / "a.so")], tmp_path, sys.executable, 4096, None, None)
    state.add("check", "target", suite.DRIVER, "10", "info")
    state.add("check", "target", "vgpu", "9", "pass")
    state.add("other", "target", "vgpu", "1", "fail")
    assert [r.check for r in state.rows] == ["check", "other"]
    assert set(state.rows[0].cells) == {suite.DRIVER, "vgpu"}


def test_overhead_is_judged_on_the_target_or_the_references_own_spread():
    steady = [100.0, 100.5, 99.5, 100.2, 99.8]
    noisy = [100.0, 80.0, 120.0, 90.0, 110.0]
    # Launch rates (higher is better): a steady reference keeps the target.
    assert suite.overhead_band(0.97, steady, True) == 0.97
    # A reference whose middle half reaches 10 % below its median widens it.
    assert suite.overhead_band(0.97, noisy, True) == pytest.approx(90 / 100)
    # Times (lower is better): the upper quartile is what widens it.
    assert suite.overhead_band(0.99, noisy, False) == pytest.approx(100 / 110)
    rows = Rows()
    suite.overhead_row(rows, "launch", 0.97, "vgpu", [95.0] * 5, steady, True, 1, "launches/s", 0)
    suite.overhead_row(rows, "launch", 0.97, "vgpu", [95.0] * 5, noisy, True, 1, "launches/s", 0)
    suite.overhead_row(rows, "step", 0.99, "vgpu", [2.2] * 5, [2.0] * 5, False, 1e3, "ms", 3)
    assert rows.verdicts() == ["fail", "pass", "fail"]
    assert rows.measured(2).startswith("0.909 (passes at 0.990): 2,200.000 ms")


def test_prometheus_text_is_parsed_or_refused():
    text = (
        "# HELP vgpu_container_memory_used_bytes Device memory.\n"
        "# TYPE vgpu_container_memory_used_bytes gauge\n"
        'vgpu_container_memory_used_bytes{namespace="",pod="p",container="holder",device_index="0"} 1.5e9\n'
        'vgpu_container_memory_used_bytes{namespace="",pod="p",container="spin\\"ner",device_index="0"} 7\n'
        "vgpu_monitor_regions 2\n"
    )
    samples = suite.parse_metrics(text)
    assert suite.metric(samples, "vgpu_container_memory_used_bytes", container="holder") == 1.5e9
    assert suite.metric(samples, "vgpu_monitor_regions") == 2
    # Two samples match, or none: no single answer.
    assert suite.metric(samples, "vgpu_container_memory_used_bytes") is None
    assert suite.metric(samples, "vgpu_nothing") is None
    for bad in ("vgpu_x{a=\"1\"} twelve", "{} 1"):
        with pytest.raises(ValueError):
            suite.parse_metrics(bad)


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
    ours = suite.Library("vgpu", tmp_path / "libvgpu.so")
    peer = suite.Library("peer", tmp_path / "peer.so", extra_env=(("PEER_ONLY", "1"),))
    state = suite.Suite([ours, peer], tmp_path, sys.executable, 4096, None, None)
    plain = state.plain_env()
    assert not [k for k in plain if suite.SHIM_VARIABLE.match(k)]
    assert plain["CUDA_VISIBLE_DEVICES"] == "0"
    capped = state.shim_env(ours, cap_mib=4096, share=30)
    assert capped["LD_PRELOAD"] == str(tmp_path / "libvgpu.so")
    assert capped["CUDA_DEVICE_MEMORY_LIMIT"] == "4096m" and capped["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert capped["CUDA_DEVICE_MEMORY_SHARED_CACHE"] != state.shim_env(ours)["CUDA_DEVICE_MEMORY_SHARED_CACHE"]
    assert "CUDA_DEVICE_MEMORY_SHARED_CACHE" not in state.shim_env(ours, container=False)
    assert "PEER_ONLY" not in capped
    with_peer = state.shim_env(peer, cap_mib=1024)
    assert with_peer["LD_PRELOAD"] == str(tmp_path / "peer.so") and with_peer["PEER_ONLY"] == "1"


def test_a_missing_peer_is_named(tmp_path):
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"")
    done = run("--lib", str(library), "--peer", str(tmp_path / "hami.so"), "--nvcc", str(NVCC_ROOT / "bin/nvcc"),
               "--arch", "sm_90", "--workdir", str(tmp_path), env=nvcc_env())
    assert done.returncode == 2 and "hami.so: no such file" in done.stderr


def test_skip_and_budget_are_checked():
    done = run("--skip", "nosuch")
    assert done.returncode == 2 and "--skip: unknown check nosuch" in done.stderr
    done = run("--budget-s", "0")
    assert done.returncode == 2 and "--budget-s must be a positive number" in done.stderr


def test_nvidia_smi_q_xml_gives_what_doctor_is_compared_with():
    # Written by nvidia-smi -q -x on an H200 (driver 580.159.04) in the run
    # recorded in bench/results/gpu/.
    facts = suite.parse_smi_xml((HERE / "fixtures/nvidia-smi-q-h200.xml").read_text())
    assert facts["driver_version"] == "580.159.04" and facts["cuda_version"] == "13.0"
    assert facts["gpus"] == [{"uuid": "GPU-389a632d-48b7-5a24-c3e0-ae1d148dab70", "name": "NVIDIA H200",
                              "memory_total_mib": 143771, "pci_bus_id": "00000000:00:06.0"}]
    with pytest.raises(ValueError, match="no driver_version"):
        suite.parse_smi_xml("<nvidia_smi_log></nvidia_smi_log>")
    with pytest.raises(ValueError, match="not XML"):
        suite.parse_smi_xml("No devices were found")


def test_bus_ids_compare_in_one_spelling():
    assert suite.bus_id_key("00000000:3B:00.0") == suite.bus_id_key("0000:3b:00.0") == "0000:3b:00.0"
    assert suite.bus_id_key(None) is None


def test_the_prepare_and_on_gpu_scripts_parse_and_explain_themselves():
    for script in ("prepare", "on-gpu"):
        done = subprocess.run(["bash", "-n", HERE / script], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    helped = subprocess.run([HERE / "prepare", "--help"], capture_output=True, text=True, check=False)
    assert helped.returncode == 0 and ".gpu-carry" in helped.stdout and "on-gpu" in helped.stdout
    refused = subprocess.run([HERE / "prepare", "--bogus"], capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "unknown option --bogus" in refused.stderr


def test_a_resource_slice_gives_each_devices_uuid_and_memory():
    devices = {"spec": {"devices": [
        {"name": "gpu-1", "attributes": {"uuid": {"string": "GPU-b"}}, "capacity": {"memory": {"value": "2097152"}}},
        {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-a"}}, "capacity": {"memory": {"value": "80Gi"}}},
    ]}}
    # A quantity in another spelling is not taken for a figure.
    assert suite.slice_devices(devices) == [("GPU-a", None), ("GPU-b", 2 * 1024 * 1024)]
    assert suite.slice_devices(None) == []
