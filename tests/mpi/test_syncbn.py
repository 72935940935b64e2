"""SyncBatchNorm on any number of ranks equals BatchNorm on the global batch in one process.

Every rank builds the same layer (or model) twice: the synchronised one sees only this
rank's share of each global batch, the single-process reference the whole batch.
Outputs, input gradients, weight gradients (summed over ranks, as data parallelism
does), running statistics (and their equality across ranks, bit for bit) are compared
in float64, with uneven shares and a rank with no samples. Then the signature test: the
reference cnn under DataParallel with SyncBatchNorm, N ranks x b == 1 rank x N b.
"""
from __future__ import annotations

import numpy
import pytest

from mpidl import functions as F
from mpidl.autograd import Tensor
from mpidl.comm import DistributedError
from mpidl.models import cnn
from mpidl.nn import BatchNorm1d, BatchNorm2d, BatchNorm3d, Sequential, ReLU
from mpidl.optim import SGD
from mpidl.parallel import DataParallel, SyncBatchNorm, convert_sync_batchnorm
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

F64 = numpy.float64
LAYERS = {2: BatchNorm1d, 3: BatchNorm1d, 4: BatchNorm2d, 5: BatchNorm3d}
SPATIAL = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}


def shares(size, kind):
    """Per-rank sample counts: uneven ("ascending": 1, 2, 3, ...) or with rank 0 empty."""
    if kind == "ascending":
        return [r + 1 for r in range(size)] if size > 1 else [3]
    return [0] + [2 + r for r in range(size - 1)] if size > 1 else [3]


def my_slice(comm, counts):
    start = sum(counts[:comm.rank])
    return slice(start, start + counts[comm.rank])


def assert_identical_across_ranks(comm, array, what):
    """Bit-for-bit the same array on every rank (running statistics by construction)."""
    mine = numpy.ascontiguousarray(array).view(numpy.uint8).tobytes()
    everyone = comm.allgather_obj(mine)
    assert_all_ranks(comm, all(e == everyone[0] for e in everyone),
                     f"{what} differs from rank 0's")


@pytest.mark.parametrize("ndim", [2, 3, 4, 5], ids=["BC", "BCL", "BCHW", "BCDHW"])
@pytest.mark.parametrize("kind", ["ascending", "rank0-empty"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batchnorm_equals_batchnorm_on_the_global_batch(comm, ndim, kind, momentum):
    counts = shares(comm.size, kind)
    n, c = sum(counts), 3
    ref = LAYERS[ndim](c, momentum=momentum, dtype=F64)
    sync = convert_sync_batchnorm(LAYERS[ndim](c, momentum=momentum, dtype=F64), comm)
    assert_all_ranks(comm, isinstance(sync, SyncBatchNorm), f"converted to {type(sync)}")
    rng = numpy.random.default_rng(0)  # the same global batches on every rank
    w, b = rng.standard_normal(c), rng.standard_normal(c)
    for layer in (ref, sync):
        layer.weight.data[...], layer.bias.data[...] = w, b
    mine = my_slice(comm, counts)
    for step, training in enumerate([True, True, False, True]):
        ref.train(training)
        sync.train(training)
        x = rng.standard_normal((n, c) + SPATIAL[ndim]) * (step + 1) + 10.0 * step
        gy = rng.standard_normal(x.shape)
        ref.zero_grad()
        sync.zero_grad()
        xr = Tensor(x, requires_grad=True)
        yr = ref(xr)
        yr.backward(gy)
        xs = Tensor(x[mine], requires_grad=True)
        ys = sync(xs)
        ys.backward(gy[mine])
        what = f"step {step} ({'train' if training else 'eval'})"
        assert_allclose_all_ranks(comm, ys.data, yr.data[mine], scale=100, what=f"{what} y")
        assert_allclose_all_ranks(comm, xs.grad, xr.grad[mine], scale=100,
                                  what=f"{what} input grad")
        for name in ("weight", "bias"):
            local = getattr(sync, name).grad
            total = comm.allreduce(numpy.ascontiguousarray(local))  # data parallelism's sum
            assert_allclose_all_ranks(comm, total, getattr(ref, name).grad.data, scale=100,
                                      what=f"{what} {name} grad")
        for name, buf in sync.named_buffers():
            assert_allclose_all_ranks(comm, buf, dict(ref.named_buffers())[name], scale=100,
                                      what=f"{what} {name}")
            assert_identical_across_ranks(comm, buf, f"{what} {name}")


def test_convert_keeps_names_parameters_and_buffers(comm):
    model = Sequential(BatchNorm1d(4), ReLU(), Sequential(BatchNorm2d(2), BatchNorm3d(3)))
    params = [p for p in model.parameters()]
    buffers = [b for b in model.buffers()]
    names = list(model.state_dict())
    model.eval()
    model[0].running_mean += comm.rank  # a rank that resumed elsewhere: rank 0's wins
    model[0].num_batches_tracked += 5 * comm.rank
    out = convert_sync_batchnorm(model, comm)
    assert_all_ranks(comm, not model[0].running_mean.any()
                     and int(model[0].num_batches_tracked) == 0, "rank 0's buffers")
    kinds = [type(m).__name__ for _, m in model.named_modules()]
    assert_all_ranks(comm, out is model and list(model.state_dict()) == names, "names")
    assert_all_ranks(comm, all(a is b for a, b in zip(model.parameters(), params))
                     and all(a is b for a, b in zip(model.buffers(), buffers)),
                     "the same Parameter objects and buffer arrays")
    assert_all_ranks(comm, kinds.count("SyncBatchNorm") == 3 and "BatchNorm1d" not in kinds,
                     f"converted layers: {kinds}")
    assert_all_ranks(comm, not model[0].training, "keeps the mode")
    # Evaluation mode communicates nothing: one rank alone may run it.
    if comm.rank == 0:
        model[0](numpy.ones((1, 4)))
    comm.barrier()


def test_models_with_different_batch_norm_counts_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs 2 or more ranks")
    layers = [BatchNorm1d(2)] + ([BatchNorm1d(2)] if comm.rank == 0 else [])
    with raises_all_ranks(comm, DistributedError, match="different numbers of batch norm"):
        convert_sync_batchnorm(Sequential(*layers), comm)


def small_cnn():
    return cnn(in_shape=(2, 6, 5), outputs=3, channels=(4, 6), dtype=F64, seed=7)


@pytest.mark.parametrize("per_rank", [3, "uneven"])
def test_cnn_with_sync_batchnorm_n_ranks_match_one_rank_with_the_global_batch(comm, per_rank):
    counts = [3] * comm.size if per_rank == 3 else shares(comm.size, "rank0-empty")
    n = sum(counts)
    model = convert_sync_batchnorm(small_cnn(), comm)
    dp = DataParallel(model, comm, bucket_mb=0.001)
    ref = small_cnn()
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rng = numpy.random.default_rng(1)
    mine = my_slice(comm, counts)
    for _ in range(3):
        x, y = rng.standard_normal((n, 2, 6, 5)) + 2.0, rng.integers(0, 3, size=n)
        loss = F.softmax_cross_entropy(dp(x[mine]), y[mine], reduction="sum")
        dp.backward(loss, global_count=n)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        F.softmax_cross_entropy(ref(x), y).backward()
        ref_opt.step()
    state, ref_state = model.state_dict(), ref.state_dict()
    for name, value in state.items():
        assert_allclose_all_ranks(comm, value, ref_state[name], scale=1000, what=name)
        assert_identical_across_ranks(comm, value, name)
    # Evaluation uses the (identical) running statistics: the same logits everywhere.
    x = rng.standard_normal((4, 2, 6, 5))
    assert_allclose_all_ranks(comm, model.eval()(x).data, ref.eval()(x).data, scale=1000,
                              what="eval logits")
    dp.close()
