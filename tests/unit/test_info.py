"""mpidl info: the report of one process, and the text format of a many-rank report."""
from __future__ import annotations

import json
import re

from mpidl import info
from mpidl.comm import SingleCommunicator


def rank(r, host, local_rank, local_size, device=None):
    return {"rank": r, "host": host, "pid": 100 + r, "local_rank": local_rank,
            "local_size": local_size, "omp_num_threads": "1", "cpus": 4,
            "cuda_visible_devices": None if device is None else "0,1", "gpus": None,
            "device": device, "device_name": None if device is None else "NVIDIA H200",
            "pci_bus_id": None if device is None else f"0000:0{device}:00.0", "error": None}


REPORT = {
    "mpidl": "0.1.0", "python": "3.11.7",
    "mpi": {"library": "Open MPI v5.0.11", "standard": "3.1", "in_use": True},
    "ranks": 3, "nodes": 2, "ranks_per_node": {"n01": 2, "n02": 1},
    "job": {"id": "4242", "launcher": "slurm", "seconds_left": 3725.0, "nodes": "2"},
    "cuda_aware": {"aware": True, "reason": "probe passed", "method": "functional",
                   "cases": {"sendrecv": "ok", "allreduce": "ok",
                             "iallreduce": "FAILED: the probe child died of SIGSEGV",
                             "node-local sendrecv": "ok: ranks 0/1 on n01"}},
    "versions": {"numpy": "2.4.6", "cupy": "13.3.0", "h5py": "3.16.0", "mpi4py": "4.1.2",
                 "hdf5": "2.0.0"},
    "blas": [{"name": "openblas", "version": "0.3.31", "threading": "pthreads", "threads": 1}],
    "per_rank": [rank(0, "n01", 0, 2, 0), rank(1, "n01", 1, 2, 1), rank(2, "n02", 0, 1, 0)],
}


def test_text_report_has_exactly_one_ranks_line():
    text = info.format_report(REPORT)
    assert re.findall(r"^ranks: (\d+)$", text, flags=re.M) == ["3"]


def test_text_report_shows_placement_job_and_binding():
    text = info.format_report(REPORT)
    assert "nodes: 2" in text.splitlines()
    assert "ranks per node: n01=2, n02=1" in text
    assert "slurm job: 4242, nodes 2, time left 1:02:05, launcher slurm" in text
    assert "rank 1 on n01: local 1/2, device 1 NVIDIA H200 [0000:01:00.0]" in text
    assert "CUDA-aware MPI: yes (probe passed)" in text
    assert "  iallreduce: FAILED: the probe child died of SIGSEGV" in text.splitlines()
    assert "  node-local sendrecv: ok: ranks 0/1 on n01" in text.splitlines()
    assert "BLAS: openblas 0.3.31, pthreads threading, 1 threads" in text
    assert "threads per rank: OMP_NUM_THREADS=1" in text


def test_text_report_elides_ranks_beyond_the_limit():
    many = dict(REPORT, ranks=200, per_rank=[rank(r, "n01", r, 200) for r in range(200)])
    text = info.format_report(many)
    assert f"... {200 - info.MAX_RANK_LINES} more ranks (see --json)" in text
    assert "rank 199 on" not in text


def test_one_process_report_is_a_world_of_one():
    report = info.collect(SingleCommunicator())
    assert report["ranks"] == 1 and report["nodes"] == 1
    assert report["per_rank"][0]["local_rank"] == 0
    assert report["versions"]["numpy"]
    assert report["mpi"]["library"]  # read without initialising MPI in this process
    assert re.findall(r"^ranks: 1$", info.format_report(report), flags=re.M) == ["ranks: 1"]


def test_json_report_is_machine_readable(capsys):
    assert info.main(["--json", "--no-probe"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == 1
    assert report["cuda_aware"]["reason"] == "not probed (--no-probe)"


def test_blas_kernel_hint_names_an_avx2_kernel_on_an_avx512_cpu_and_who_chose_it():
    avx512 = {"fma", "avx2", "avx512f", "avx512bw"}
    forced = info.blas_kernel_hint("Haswell", avx512, "Haswell")
    assert "Haswell kernels on a CPU with AVX-512" in forced
    assert "OPENBLAS_CORETYPE=Haswell is set" in forced
    assert "as OpenBLAS chose" in info.blas_kernel_hint("Zen", avx512, None)
    # Nothing to say: an AVX-512 kernel, a CPU without AVX-512, an unknown kernel.
    assert info.blas_kernel_hint("SkylakeX", avx512, None) is None
    assert info.blas_kernel_hint("Cooperlake", avx512, "Cooperlake") is None
    assert info.blas_kernel_hint("Haswell", {"fma", "avx2"}, "Haswell") is None
    assert info.blas_kernel_hint(None, avx512, "Haswell") is None


def test_text_report_shows_the_blas_kernel_and_its_note():
    blas = [{"name": "openblas", "version": "0.3.31", "threading": "pthreads", "threads": 1,
             "kernel": "Haswell", "hint": "OpenBLAS runs its Haswell kernels on a CPU ..."}]
    lines = info.format_report(dict(REPORT, blas=blas)).splitlines()
    at = lines.index("BLAS: openblas 0.3.31, pthreads threading, 1 threads, Haswell kernels")
    assert lines[at + 1] == "  note: OpenBLAS runs its Haswell kernels on a CPU ..."
    assert not any(line.startswith("  note:") for line in info.format_report(REPORT).splitlines())


def test_this_process_reports_the_kernel_openblas_runs():
    from threadpoolctl import threadpool_info  # a dependency (setup.cfg)

    blas = info._blas()
    expected = [p.get("architecture") for p in threadpool_info() if p.get("user_api") == "blas"]
    assert [b["kernel"] for b in blas] == expected
