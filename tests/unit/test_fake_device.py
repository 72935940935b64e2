"""The fake device that computes and counts (:mod:`mpidl.testing.fakedevice`), its step
command, and #48's points that it checks: bf16 on CuPy 13 refused (1), 16-bit GEMMs and
TF32 as the job's choice, priced as run (2), a pipeline's host reads (3) and its
checkpoint-time gathers kept off the device (7)."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy
import pytest

from mpidl import backend
from mpidl.testing import run_ranks
from mpidl.testing.fakedevice import FakeDeviceArray, fake_cupy


def test_the_fake_computes_with_device_arrays_as_cupy_does():
    a = numpy.arange(6.0).reshape(2, 3)
    with fake_cupy() as cp:
        d = cp.asarray(a)
        for got, want in ((d * 2 + 1, a * 2 + 1), (cp.exp(d), numpy.exp(a)),
                          (numpy.exp(d), numpy.exp(a)), (d @ d.T, a @ a.T),
                          (cp.matmul(d, d.T), a @ a.T), (d[:, 1], a[:, 1]),
                          (d[cp.asarray([1, 0])], a[[1, 0]]), (d.max(axis=1), a.max(axis=1))):
            assert isinstance(got, FakeDeviceArray)
            numpy.testing.assert_array_equal(got.get(), want)
        total = d.sum()  # a 0-d device array, as CuPy's reductions give
        assert isinstance(total, FakeDeviceArray) and total.shape == ()
        draw = cp.random.RandomState(3).random_sample((2, 2), dtype=numpy.float32)
        assert isinstance(draw, FakeDeviceArray) and draw.dtype == numpy.float32
        cp.add.at(d, cp.asarray([0, 0]), 1.0)
        assert d.get()[0, 0] == 2.0
        # What CuPy 13 refuses: the host mix-ups a GPU run would hit first.
        with pytest.raises(TypeError, match="Implicit conversion"):
            numpy.asarray(d)
        with pytest.raises(TypeError, match="Unsupported type"):
            d + numpy.ones(3)
        with pytest.raises(TypeError, match="CuPy 13.6.0 has no bfloat16"):
            d.astype(backend.bfloat16())
        assert pickle.loads(pickle.dumps(d)).__class__ is FakeDeviceArray


def test_the_fake_counts_launches_reads_syncs_and_gemms_per_phase():
    with fake_cupy() as cp:
        d = cp.asarray(numpy.ones((2, 2), dtype=numpy.float16))
        cp.reset_counts()
        wide = d.astype(numpy.float32)                  # 1 launch
        _ = wide @ wide                                  # 1 launch, a widened GEMM
        _ = d @ d                                        # 1 launch, a half GEMM
        assert float(wide.sum()) == 4.0                  # 1 launch, 1 host read
        assert bool((wide > 0).all())                    # 2 launches, 1 host read
        cp.cuda.get_current_stream().synchronize()       # 1 sync
        forward = cp.counts()["forward"]
        assert (forward.launches, forward.host_reads, forward.syncs) == (6, 2, 1)
        assert forward.gemm_dtypes == {"float32,float32": 1, "float16,float16": 1}
        assert forward.widened_gemms == 1

        def backward_of_something():  # a function named *backward* of mpidl's: backward
            return d + 1

        backward_of_something.__code__ = backward_of_something.__code__.replace(
            co_filename="/x/mpidl/functions/some.py")
        backward_of_something()
        assert cp.counts()["backward"].launches == 1
        # Thread ranks count apart.
        others = run_ranks(2, lambda comm: (cp.reset_counts(), cp.asarray(numpy.ones(2)) + 1,
                                            cp.counts()["forward"].launches)[2])
        assert others == [1, 1]
        assert cp.counts()["forward"].launches == 6


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mpidl.testing.fakedevice", *args],
                          capture_output=True, text=True, timeout=300)


def test_the_command_prints_one_json_line_of_counts_per_phase():
    done = _cli("--model", "reviews", "--optimizer", "sgd")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("launches", "host_reads", "syncs", "gemm_dtypes"):
        assert set(result[key]) == {"forward", "backward", "exchange", "optimizer",
                                    "checkpoint"}, key
    assert result["launches"]["forward"] > 0 and result["host_reads"]["checkpoint"] > 0
    assert result["optimizer"] == "sgd" and result["ranks"] == 2


@pytest.mark.parametrize("args,message,before_data", [
    (["--model", "nosuch"], "--model 'nosuch' is not a preset", True),
    (["--model", "gpt", "--precision", "bf16"], "needs CuPy 14 or later", True),
    # mpidl train's own check, when the run is built (after its corpus)
    (["--model", "reviews", "--tensor-parallel", "2"], "tensor", False),
])
def test_the_command_refuses_bad_input_with_status_2(args, message, before_data):
    done = _cli(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr
    assert ("generating" not in done.stdout) == before_data  # before any step


def test_bf16_on_cupy_13_is_refused_by_mpidl_train_before_any_work(capsys):
    # Point 1: refused (exit 2) naming the version and the fix; CuPy 14 has bfloat16.
    from mpidl.train import command

    with fake_cupy():
        got = run_ranks(1, lambda comm: command._resolve(
            ["gpt", "--backend=cupy", "--precision=bf16"], comm))
    assert got == [(None, 2)]
    err = capsys.readouterr()
    assert "CuPy 14 or later" in err.out + err.err and "13.6.0" in err.out + err.err
    with fake_cupy("14.0.0"):
        assert backend.precision_problem("cupy", "bf16") is None
    with fake_cupy():
        assert backend.precision_problem("cupy", "fp16") is None
        assert backend.precision_problem("numpy", "bf16") is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_operands_reach_the_device_gemm_as_16_bit(dtype):
    # Point 2: on the device no widening (tensor cores, fp32 accumulation in cuBLAS);
    # a float32 operand beside a half one is narrowed; the host still widens.
    dtype = backend.precision_dtype("bf16" if dtype == "bfloat16" else "fp16")
    rng = numpy.random.default_rng(1)
    a = rng.standard_normal((4, 8)).astype(dtype)
    b = rng.standard_normal((8, 3)).astype(dtype)
    want = backend.matmul(a, b)  # the host's: widened, rounded once
    with fake_cupy("14.0.0") as cp:
        da, db = cp.asarray(a), cp.asarray(b)
        y = backend.matmul(da, db)
        out = cp.zeros((4, 3), dtype=numpy.float32)
        backend.matmul(da, db, out=out)
        mixed = backend.matmul(cp.asarray(a.astype(numpy.float32)), db)
        counts = cp.counts()["forward"]
    assert y.dtype == dtype and out.dtype == numpy.float32 and mixed.dtype == numpy.float32
    assert counts.gemm_dtypes == {f"{dtype.name},{dtype.name}": 3}
    assert counts.widened_gemms == 0
    assert numpy.allclose(y.get().astype(numpy.float32), want.astype(numpy.float32),
                          rtol=2e-2, atol=2e-2)
    assert backend.gemm_dtype(cp, dtype) == dtype.name
    assert backend.gemm_dtype(numpy, dtype) == "float32"


def test_tf32_is_the_jobs_choice_and_the_planner_prices_what_runs(monkeypatch):
    from hpc import costmodel
    from mpidl.plan_layouts import _rates

    monkeypatch.setenv("CUPY_TF32", "1")  # left in the environment: the job decides
    with fake_cupy() as cp:
        backend.use_tf32(cp, False)
        import os

        assert os.environ["CUPY_TF32"] == "0" and cp.compute_types == {"float32": 1}
        backend.use_tf32(cp, True)
        assert os.environ["CUPY_TF32"] == "1" and cp.compute_types == {"float32": 7}
    h100 = costmodel.load_device("h100")
    fp32, _ = _rates(h100, "fp32")
    tf32, _ = _rates(h100, "fp32", tf32=True)
    half, _ = _rates(h100, "bf16")
    assert fp32 == pytest.approx(26.8e12) and tf32 == pytest.approx(198e12)
    assert half == pytest.approx(593.6e12)
    assert _rates(costmodel.load_device("cpu-core"), "fp32") == (0.025e12, None)


def test_a_pipeline_step_reads_the_host_once_not_per_microbatch():
    # Point 3: loss and hits were read per microbatch on the last stage (8 reads at 4
    # microbatches) and the clipping norm once: now one read for the pipeline's loss.
    from mpidl.testing.fake_step import count_step

    result = count_step("gpt", pipeline=2, microbatches=4)
    sites = result["read_sites"]["forward"]
    assert not any("parallel/pipeline.py" in s for s in sites), sites
    assert result["host_reads"]["forward"] <= 3, sites


def test_a_pipelines_full_state_is_gathered_on_the_host_not_on_every_device():
    # Point 7: allgather_obj unpickles CuPy arrays as device arrays, so every rank held
    # every stage's parameters on its own GPU.
    from mpidl.parallel import pipeline_state
    from mpidl.train.build import build_run
    from mpidl.train.config import load_config
    from mpidl.train.log import Logger
    from mpidl.train.task import prepare_data
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config("gpt", ["--data.num-train=32", "--data.num-test=8",
                                     f"--data.cache-dir={tmp}", "--backend=cupy",
                                     "--pipeline-parallel=2", "--microbatches=2",
                                     "--global-batch=4"])
        with fake_cupy():
            def rank(comm):
                data = prepare_data(config, comm, Logger(comm.rank, comm.size))
                run = build_run(config, comm, data)
                state = pipeline_state.full_state_dict(run.model)
                opt = pipeline_state.full_optimizer_state(run.model, run.optimizer)
                run.close()
                return state, opt

            (state, opt), _ = run_ranks(2, rank, timeout=120)
    assert state and all(isinstance(a, numpy.ndarray) for a in state.values())
    assert all(not isinstance(v, FakeDeviceArray) for v in opt.values())


def test_gpu_check_runs_its_budget_step_on_the_fake_device(capsys):
    # hpc.gpu_check's host-sync checks, their CPU side: the default step module's phases
    # (the data-parallel probe and mpidl train gpt's step) built on the fake device and
    # counted by SyncCounter through the fake's cupy._core.syncdetect, as on a GPU.
    from hpc import gpu_check

    with fake_cupy() as cp:
        checks = gpu_check._Checks(None)
        gpu_check._sync_checks(checks, cp, "mpidl.testing.device_step:build", 1)
    out = capsys.readouterr().out
    assert not checks.failed, out
    assert "ok   host syncs (forward+backward): 0 per step; at most 0 expected" in out
    line = next(x for x in out.splitlines() if "host syncs (budget step)" in x)
    assert line.startswith("ok ") and "at most 2 expected" in line, line
    assert "train/objective.py" in line  # the open read, counted and shown, not judged


@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_layerwise_optimizers_under_tensor_parallelism_upload_nothing_per_step(optimizer):
    # Point 5: the excluded and the replicated tensors' masks were copied from the host
    # every step.
    from mpidl.testing.fake_step import count_step

    result = count_step("gpt", tensor=2, optimizer=optimizer)
    assert result["uploads"]["optimizer"] == 0, result["uploads"]


def test_a_pipeline_posts_its_receives_an_action_ahead():
    # Point 3: every receive was posted just before it was waited for, so MPI had no
    # buffer to match a neighbour's send into while the stage computed.
    from mpidl.train.build import build_run
    from mpidl.train.config import load_config
    from mpidl.train.log import Logger
    from mpidl.train.step import TrainStep
    from mpidl.train.task import prepare_data
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config("gpt", ["--data.num-train=32", "--data.num-test=8",
                                     f"--data.cache-dir={tmp}", "--backend=cupy",
                                     "--pipeline-parallel=2", "--microbatches=4",
                                     "--global-batch=8"])
        with fake_cupy():
            def rank(comm):
                log = Logger(comm.rank, comm.size)
                run = build_run(config, comm, prepare_data(config, comm, log), log)
                x = next(iter(run.loader))
                TrainStep(run, log)(x[0], None, x[-1], 0)
                pipeline = run.layout.pipeline
                got = (pipeline.posted_ahead, pipeline.messages.received)
                run.close()
                return got

            counts = run_ranks(2, rank, timeout=120)
    for ahead, received in counts:  # 4 receives a stage: 1 waits for the first forward
        assert received == 4 and ahead >= 3, counts
