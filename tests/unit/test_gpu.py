"""hpc.gpu (device binding) and hpc.cuda_aware (the CUDA-aware-MPI verdict).

Runs without a GPU: binding is a pure decision from the environment; the probe's
child-process machinery is exercised on NumPy buffers and on children that crash or
hang. The device-buffer probe itself is marked ``gpu``.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from hpc import cuda_aware, gpu
from hpc.gpu import Verdict, choose_device, visible_devices


@pytest.mark.parametrize(
    "local_rank, visible, count, expected",
    [
        (0, None, None, None),  # nothing known: no decision
        (3, None, 0, None),  # CUDA says no device
        (0, [], None, None),  # CUDA_VISIBLE_DEVICES="" hides all
        (0, None, 4, 0),
        (5, None, 4, 1),  # more ranks than devices: round-robin
        (3, ["2"], None, 0),  # srun --gpus-per-task=1: its one device is device 0
        (7, ["5"], 1, 0),
        (1, ["0", "1"], None, 1),
        (2, ["0", "1"], None, 0),
        (2, ["0", "1", "2", "3"], None, 2),
        (1, ["GPU-aaa", "GPU-bbb"], None, 1),
        (3, ["0", "1", "2"], 2, 1),  # CUDA's count wins: one listed device does not exist
    ],
)
def test_choose_device_table(local_rank, visible, count, expected):
    assert choose_device(local_rank, visible, count) == expected


def test_choose_device_rejects_a_negative_local_rank():
    with pytest.raises(ValueError, match="local_rank=-1"):
        choose_device(-1, ["0"], None)


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),
        ("", []),
        ("0", ["0"]),
        ("0,1", ["0", "1"]),
        (" 2, 3 ", ["2", "3"]),
        ("GPU-8f2c,GPU-19ab", ["GPU-8f2c", "GPU-19ab"]),
        ("1,-1,0", ["1"]),  # CUDA hides everything after an invalid entry
        ("NoDevFiles", []),  # what Slurm exports to a task without GPUs
    ],
)
def test_visible_devices_reads_cuda_visible_devices_as_cuda_does(value, expected):
    environ = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_devices(environ) == expected


def test_bind_takes_the_local_rank_from_the_launcher():
    environ = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
               "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
               "CUDA_VISIBLE_DEVICES": "0,1"}
    if gpu.cupy_module() is not None:
        pytest.skip("bind would set a real CuPy device")
    assert gpu.bind(environ=environ) == 1
    assert gpu.bind(local_rank=2, environ=environ) == 0


def test_bind_without_visible_devices_or_cupy_decides_nothing():
    if gpu.cupy_module() is not None:
        pytest.skip("CuPy is installed: the device count comes from CUDA")
    assert gpu.bind(local_rank=0, environ={}) is None
    assert gpu.device_count({}) is None


def test_verdict_is_not_aware_without_cupy_or_gpu():
    if gpu.cupy_module() is not None and gpu.device_count({}) != 0:
        pytest.skip("this machine has CuPy and a GPU")
    assert gpu.cuda_aware_mpi(environ={}) == Verdict(False, "no CuPy/GPU", "none")


def test_hidden_devices_mean_no_gpu_even_with_cupy():
    assert gpu.cuda_aware_mpi(environ={"CUDA_VISIBLE_DEVICES": ""}).reason == "no CuPy/GPU"


@pytest.mark.parametrize("value, aware", [("1", True), ("0", False)])
def test_override_decides_without_probing(value, aware):
    verdict = gpu.cuda_aware_mpi(environ={"MPIDL_CUDA_AWARE": value})
    assert verdict == Verdict(aware, f"MPIDL_CUDA_AWARE={value}", "override")


def test_override_must_be_zero_or_one():
    with pytest.raises(ValueError, match="MPIDL_CUDA_AWARE='yes'"):
        gpu.cuda_aware_mpi(environ={"MPIDL_CUDA_AWARE": "yes"})


def test_cache_key_changes_with_mpi_host_and_cupy_version():
    base = cuda_aware.cache_key("Open MPI v5.0.11", "node01", "13.3.0")
    assert base == cuda_aware.cache_key("Open MPI v5.0.11", "node01", "13.3.0")
    others = {cuda_aware.cache_key("Open MPI v4.1.6", "node01", "13.3.0"),
              cuda_aware.cache_key("Open MPI v5.0.11", "node02", "13.3.0"),
              cuda_aware.cache_key("Open MPI v5.0.11", "node01", "12.3.0")}
    assert base not in others and len(others) == 3
    assert base.startswith("cuda-aware-node01-") and base.endswith(".json")
    assert "/" not in cuda_aware.cache_key("v", "odd/host name", "1")


def test_cache_lives_under_the_user_cache_directory():
    assert cuda_aware.cache_dir({"XDG_CACHE_HOME": "/x/cache"}) == Path("/x/cache/mpidl")
    assert cuda_aware.cache_dir({}) == Path.home() / ".cache" / "mpidl"


def test_cached_verdict_round_trips_and_says_it_came_from_the_cache(tmp_path):
    path = tmp_path / "mpidl" / "cuda-aware-x.json"
    cases = {"sendrecv": "ok", "allreduce": "ok", "iallreduce": "FAILED: died of SIGSEGV"}
    cuda_aware.save_verdict(path, Verdict(True, "probe passed", "functional", cases))
    assert cuda_aware.load_verdict(path) == Verdict(True, "probe passed", "cache", cases)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_unreadable_cache_is_ignored(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cuda_aware.load_verdict(bad) is None
    assert cuda_aware.load_verdict(tmp_path / "missing.json") is None


def test_mpi_library_version_is_read_without_initialising_mpi_here():
    version = cuda_aware.mpi_library_version()
    assert version and "\n" not in version


def test_probe_child_on_host_buffers_passes():
    verdict = cuda_aware.run_probe_child(cuda_aware.probe_command(None), timeout=60)
    assert verdict.aware and verdict.method == "functional", verdict.reason
    assert "numpy buffers" in verdict.reason


def test_probe_child_tests_what_mpidl_hands_mpi_and_names_each_case():
    verdict = cuda_aware.run_probe_child(cuda_aware.probe_command(None), timeout=60)
    assert verdict.cases == {"sendrecv": "ok", "allreduce": "ok", "iallreduce": "ok"}


def _child(lines, then="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"):
    """A probe child that reports ``lines`` (JSON) and then runs ``then``."""
    prints = "".join(f"print({line!r}, flush=True); " for line in lines)
    return [sys.executable, "-c", prints + then]


def test_a_crash_in_the_non_blocking_case_keeps_the_blocking_verdict():
    # mpidl stages non-blocking reductions anyway; the crash is named, not fatal.
    child = _child(['{"case": "sendrecv", "ok": true, "detail": ""}',
                    '{"case": "allreduce", "ok": true, "detail": ""}'])
    verdict = cuda_aware.run_probe_child(child, timeout=30)
    assert verdict.aware, verdict.reason
    assert verdict.cases["sendrecv"] == verdict.cases["allreduce"] == "ok"
    assert verdict.cases["iallreduce"].startswith("FAILED: the probe child died of SIGSEGV")


def test_a_crash_in_a_blocking_case_means_not_aware_and_names_the_case():
    child = _child(['{"case": "sendrecv", "ok": true, "detail": ""}'])
    verdict = cuda_aware.run_probe_child(child, timeout=30)
    assert not verdict.aware
    assert verdict.cases["allreduce"].startswith("FAILED: the probe child died of SIGSEGV")
    assert verdict.cases["iallreduce"].startswith("skipped")
    assert "allreduce FAILED" in verdict.reason


def test_a_wrong_result_fails_its_case():
    child = _child(['{"case": "sendrecv", "ok": false, "detail": "16 float64 came back wrong"}',
                    '{"case": "allreduce", "ok": true, "detail": ""}',
                    '{"case": "iallreduce", "ok": true, "detail": ""}',
                    '{"ok": false, "reason": "sendrecv: 16 float64 came back wrong"}'], then="")
    verdict = cuda_aware.run_probe_child(child, timeout=30)
    assert not verdict.aware
    assert verdict.cases["sendrecv"] == "FAILED: 16 float64 came back wrong"


def test_probe_child_runs_as_a_singleton_even_inside_a_launch():
    # Launcher variables of a 4-rank job must not reach the child, or its MPI_Init
    # would try to join that job.
    environ = {**os.environ, "PMIX_RANK": "3", "PMIX_NAMESPACE": "gone",
               "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMI_RANK": "3"}
    assert "PMIX_RANK" not in cuda_aware.singleton_environ(environ)
    assert cuda_aware.singleton_environ({"OMPI_MCA_opal_cuda_support": "true"}) == {
        "OMPI_MCA_opal_cuda_support": "true"}
    verdict = cuda_aware.run_probe_child(cuda_aware.probe_command(None), 60, environ)
    assert verdict.aware, verdict.reason


def test_a_crashing_probe_child_means_not_aware():
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    verdict = cuda_aware.run_probe_child(crash, timeout=30)
    assert not verdict.aware and "SIGSEGV" in verdict.reason


def test_a_hanging_probe_child_is_killed_and_means_not_aware():
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    verdict = cuda_aware.run_probe_child(hang, timeout=0.5)
    assert not verdict.aware and "did not finish within 0.5 s" in verdict.reason


def test_a_probe_child_without_a_verdict_means_not_aware():
    verdict = cuda_aware.run_probe_child([sys.executable, "-c", "raise SystemExit(3)"], 30)
    assert not verdict.aware and "exited 3 without a verdict" in verdict.reason


def test_static_hint_reads_vendor_variables():
    hint, notes = cuda_aware.static_hint({"MPICH_GPU_SUPPORT_ENABLED": "1"})
    assert "MPICH_GPU_SUPPORT_ENABLED=1" in notes
    assert hint in (True, False)  # ompi_info, when present, speaks first


def test_probe_child_command_is_runnable_as_a_module():
    out = subprocess.run([sys.executable, "-m", "hpc.cuda_aware", "--probe", "--host"],
                         capture_output=True, text=True, timeout=60,
                         env=cuda_aware.singleton_environ())
    assert out.returncode == 0, out.stderr
    assert '"ok": true' in out.stdout


def _has_gpu():
    return gpu.cupy_module() is not None and bool(gpu.device_count())


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs CuPy and a CUDA GPU")
def test_functional_probe_on_device_buffers_gives_a_definite_verdict():
    verdict = gpu.cuda_aware_mpi(cache=False, timeout=60)
    assert verdict.method == "functional"
    # Either outcome is legitimate; what matters is that the probe decided.
    assert "correct values" in verdict.reason or not verdict.aware, verdict.reason


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs CuPy and a CUDA GPU")
def test_bind_sets_the_current_cupy_device():
    # This rank's own device (the launcher's local rank), and the previous device back
    # afterwards: binding every rank to device 0 here moved all of them there for the
    # rest of the test session under mpiexec.
    from hpc import env

    cp = gpu.cupy_module()
    previous = cp.cuda.runtime.getDevice()
    try:
        local_rank = env.detect().local_rank
        expected = gpu.choose_device(local_rank, gpu.visible_devices(), gpu.device_count())
        device = gpu.bind()
        assert device == expected and cp.cuda.runtime.getDevice() == device
        assert gpu.describe_device(device)["name"]
    finally:
        cp.cuda.Device(previous).use()


def test_importing_hpc_initialises_nothing_and_never_imports_mpidl():
    code = ("import sys, hpc, hpc.env, hpc.gpu, hpc.cuda_aware, hpc.gpu_check; "
            "bad = [m for m in ('mpi4py', 'mpi4py.MPI', 'cupy', 'mpidl') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=cuda_aware.singleton_environ())
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU: gpu_check runs for real")
def test_gpu_check_without_a_gpu_skips_with_exit_0_unless_required():
    cmd = [sys.executable, "-m", "hpc.gpu_check"]
    env = cuda_aware.singleton_environ()
    skipped = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert "skip gpu: no GPU on ranks [0]" in skipped.stdout
    required = subprocess.run(cmd + ["--require-gpu"], capture_output=True, text=True,
                              timeout=60, env=env)
    assert required.returncode == 1
    assert "FAIL gpu: no GPU on ranks [0]" in required.stdout


def test_sync_counter_counts_each_host_wait_once_by_call_site(monkeypatch):
    # CuPy stand-ins: a fake cupy module (streams, events) and its syncdetect hook,
    # which ndarray.get calls before it synchronises its stream (one wait).
    import types

    from hpc.gpu_check import SyncCounter
    from mpidl.testing.fakedevice import FakeCupy

    cp = FakeCupy()
    syncdetect = types.ModuleType("cupy._core.syncdetect")
    syncdetect._declare_synchronize = lambda: None
    monkeypatch.setitem(sys.modules, "cupy._core.syncdetect", syncdetect)

    def get_like():  # what ndarray.get does: declare, then synchronise the stream
        syncdetect._declare_synchronize()
        cp.cuda.get_current_stream().synchronize()

    with SyncCounter(cp) as counter:
        cp.cuda.get_current_stream().synchronize()
        event = cp.cuda.Event()
        event.record()
        event.synchronize()
        get_like()
        assert event.done  # asking is not waiting
    assert len(counter.sites) == 3, counter.sites
    assert all("test_gpu.py" in site for site in counter.sites), counter.sites
    assert counter.summary(3).startswith("1 per step (unit/test_gpu.py:")
    cp.cuda.get_current_stream().synchronize()  # unwrapped again after the block
    assert len(counter.sites) == 3


def test_gpu_check_counts_the_host_syncs_of_each_phase_of_the_step(monkeypatch, capsys):
    # The plumbing of the GPU check's last checks, on the host: the step module's
    # phases run on NumPy (nothing to wait for), counted with a fake cupy's streams.
    import functools

    from hpc import gpu_check
    from mpidl.testing import device_step
    from mpidl.testing.fakedevice import FakeCupy

    monkeypatch.setattr(device_step, "build", functools.partial(device_step.build, numpy))
    checks = gpu_check._Checks(None)
    gpu_check._sync_checks(checks, FakeCupy(), "mpidl.testing.device_step:build", 1)
    out = capsys.readouterr().out
    assert not checks.failed, out
    assert "ok   host syncs (forward+backward): 0 per step; at most 0 expected" in out
    assert "ok   host syncs (step): 0 per step" in out
    gpu_check._sync_checks(checks, FakeCupy(), "no_such_module:build", 1)
    assert "skip host syncs: no_such_module does not import" in capsys.readouterr().out
