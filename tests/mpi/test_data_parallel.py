"""DataParallel on any number of ranks: N ranks x batch b == 1 rank x batch N*b.

Every rank also trains a local single-process reference on the whole global batch and
compares; verdicts are collective. Models are small versions of the reference models,
in float64 so that "the same up to float tolerance" is a tight statement.
"""
from __future__ import annotations

import contextlib

import numpy
import pytest

from mpidl.comm import DistributedError, split_counts
import mpidl.functions as F
from mpidl.functions import softmax_cross_entropy
from mpidl.models import bow, linear, mlp, transformer
from mpidl.nn import Linear, Module, Parameter
from mpidl.optim import SGD, AdamW
from mpidl.parallel import DataParallel
from mpidl.parallel.transport import WindowTransport
from mpidl.testing import assert_all_ranks, assert_allclose_all_ranks, raises_all_ranks
from mpidl.testing.models import TwoHeads

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

VOCAB, SEQ = 40, 6


def small_mlp(dtype="float64"):
    return mlp(sizes=(12, 16, 16, 3), seed=7, dtype=dtype)


def small_transformer(dtype="float64"):
    return transformer(vocab=VOCAB, seq_len=SEQ, dim=8, layers=1, heads=2, ffn=16,
                       classes=3, seed=7, dtype=dtype)


def small_bow(dtype="float64", vocab=500):
    return bow(vocab=vocab, dim=8, hidden=8, classes=3, seed=7, dtype=dtype)


def small_linear_tokens(dtype="float64"):
    """Logistic regression on the token counts of a vocabulary of VOCAB, 0 the padding."""
    return linear(vocab=VOCAB, classes=3, pad_id=0, seed=7, dtype=dtype)


def small_linear_features(dtype="float64"):
    """Logistic regression on 12 standardised features (the data's statistics made up)."""
    stats = (numpy.linspace(-1, 1, 12), numpy.linspace(0.5, 2, 12))
    return linear(in_shape=(12,), classes=3, input_stats=stats, seed=7, dtype=dtype)


def batches(kind, steps, global_batch, seed=0, vocab=VOCAB):
    """The same global batches on every rank (a function of the seed only)."""
    rng = numpy.random.default_rng(seed)
    for _ in range(steps):
        if kind == "mlp":
            x = rng.standard_normal((global_batch, 12))
        else:  # "padded": some ids are the padding id 0, which the counts leave out
            x = rng.integers(0 if kind == "padded" else 1, vocab, size=(global_batch, SEQ))
        yield x, rng.integers(0, 3, size=global_batch)


def my_share(comm, x, y):
    counts = split_counts(len(x), comm.size)
    start = sum(counts[:comm.rank])
    return x[start:start + counts[comm.rank]], y[start:start + counts[comm.rank]]


def train_reference(model, opt, data):
    for x, y in data:
        loss = softmax_cross_entropy(model(x), y, reduction="mean")
        opt.zero_grad()
        loss.backward()
        opt.step()


def train_parallel(comm, dp, opt, data):
    for x, y in data:
        xs, ys = my_share(comm, x, y)
        loss = softmax_cross_entropy(dp(xs), ys, reduction="sum")
        dp.backward(loss, global_count=len(x))
        opt.step()
        opt.zero_grad()


def assert_same_parameters(comm, model, reference, scale=1.0):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert_allclose_all_ranks(comm, p.data, q.data, scale=scale, what=name)


def make_opt(kind, params):
    return SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else \
        AdamW(params, lr=0.01, weight_decay=0.01)


@pytest.mark.parametrize("model_fn, kind", [(small_mlp, "mlp"), (small_transformer, "tokens"),
                                             (small_linear_tokens, "padded"),
                                             (small_linear_features, "mlp")])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("overlap", [True, False])
def test_n_ranks_match_one_rank_with_the_global_batch(comm, model_fn, kind, optim, overlap):
    steps, global_batch = 3, 4 * comm.size
    model, ref = model_fn(), model_fn()
    dp = DataParallel(model, comm, bucket_mb=0.001, overlap=overlap)
    data = list(batches(kind, steps, global_batch))
    train_parallel(comm, dp, make_opt(optim, model.parameters()), data)
    train_reference(ref, make_opt(optim, ref.parameters()), data)
    assert_same_parameters(comm, model, ref, scale=100)


@pytest.mark.parametrize("global_batch", [7, 2])
def test_uneven_and_empty_rank_batches_give_the_global_gradient(comm, global_batch):
    # 7 over 3 ranks is 3+2+2; 2 over 3 ranks leaves rank 2 with nothing.
    model, ref = small_transformer(), small_transformer()
    dp = DataParallel(model, comm)
    train_parallel(comm, dp, make_opt("sgd", model.parameters()),
                   batches("tokens", 2, global_batch))
    train_reference(ref, make_opt("sgd", ref.parameters()), batches("tokens", 2, global_batch))
    assert_same_parameters(comm, model, ref, scale=100)


@pytest.mark.parametrize("options", [{"overlap": False}, {"overlap": True},
                                     {"overlap": False, "shared_memory": False}],
                         ids=["blocking", "overlap", "mpi-allreduce"])
def test_backward_without_global_count_averages_the_ranks_mean_losses(comm, options):
    # The documented default: each rank's loss is its own mean, the gradient the mean of
    # the ranks' gradients (the sum over ranks over N). Equal shares: the global mean.
    model, ref = small_mlp(), small_mlp()
    dp = DataParallel(model, comm, **options)
    opt = make_opt("sgd", model.parameters())
    data = list(batches("mlp", 2, 4 * comm.size))
    for x, y in data:
        xs, ys = my_share(comm, x, y)
        dp.backward(softmax_cross_entropy(dp(xs), ys, reduction="mean"))
        opt.step()
        opt.zero_grad()
    dp.close()
    train_reference(ref, make_opt("sgd", ref.parameters()), data)
    assert_same_parameters(comm, model, ref, scale=100)


@pytest.mark.parametrize("transport", ["mpi", "hierarchical"])
def test_a_bucket_sent_in_several_messages_is_summed_whole(comm, transport):
    # A bucket larger than a message (piece_bytes) travels in pieces: every element of
    # every piece, the last one short, must be summed. 10 float64 in messages of 3.
    from mpidl.parallel.transport import HierarchicalTransport, MpiTransport

    t = (MpiTransport(comm, piece_bytes=24) if transport == "mpi" else
         HierarchicalTransport(comm, piece_bytes=24, ranks_per_node=2, wire_dtype=None))
    flat = numpy.arange(10.0) * (comm.rank + 1)
    t.allreduce_(flat)
    t.close()
    ranks = comm.size * (comm.size + 1) / 2
    assert_allclose_all_ranks(comm, flat, numpy.arange(10.0) * ranks, what=transport)


def test_data_parallel_sums_gradients_sent_in_several_messages(comm):
    # bucket_mb=0.0002: messages of 26 float64, so the 16x12 weight's bucket goes in 8
    # pieces; blocking MPI allreduces (no shared window, no overlap) are the path that
    # splits a bucket into messages.
    model, ref = small_mlp(), small_mlp()
    dp = DataParallel(model, comm, bucket_mb=0.0002, shared_memory=False, overlap=False)
    data = list(batches("mlp", 2, 2 * comm.size + 1))
    train_parallel(comm, dp, make_opt("adamw", model.parameters()), data)
    dp.close()
    train_reference(ref, make_opt("adamw", ref.parameters()), data)
    assert_same_parameters(comm, model, ref, scale=100)


@pytest.mark.parametrize("options", [
    {"overlap": False}, {"overlap": True}, {"overlap": True, "compression": "bfloat16"},
    {"overlap": True, "hierarchical": 1}, {"overlap": False, "hierarchical": 2},
], ids=["blocking", "overlap", "overlap-bf16", "overlap-hierarchical", "hierarchical"])
def test_a_parameter_only_rank_0_reaches_gets_its_gradient_on_every_rank(comm, options):
    # Only rank 0's batch goes through head b: elsewhere b gets no gradient in backward
    # (so its hook never fires), its bucket slice must sum zeros (not the previous step's
    # values, as zero_grad drops .grad), and every rank must still issue the same
    # collectives and receive rank 0's contribution.
    dp = DataParallel(TwoHeads(), comm, **options)
    x = numpy.full((2, 4), comm.rank + 1.0)
    n = 2 * comm.size
    wire = options.get("compression")  # the tolerance of the dtype gradients travel in
    for _ in range(2):
        dp.backward(F.sum(dp(x, comm.rank == 0)), global_count=n)
        # d sum(x W^T + b) / dW[j, k] = sum_i x[i, k]
        assert_allclose_all_ranks(comm, dp.module.b.weight.grad, numpy.full((3, 4), 2 / n),
                                  dtype=wire)
        assert_allclose_all_ranks(comm, dp.module.b.bias.grad, numpy.full(3, 2 / n), dtype=wire)
        total = sum(2 * (r + 1) for r in range(comm.size)) / n
        assert_allclose_all_ranks(comm, dp.module.a.weight.grad, numpy.full((3, 4), total),
                                  dtype=wire)
        dp.module.zero_grad()
    dp.remove_hooks()


def test_shared_memory_buckets_train_like_mpi_allreduce(comm):
    # On one node the buckets live in a shared window by default; the MPI path must give
    # the same parameters, and removing the hooks moves the gradients out of the window.
    if comm.local_size != comm.size:
        pytest.skip("the ranks span several nodes")
    runs = {}
    for shared in (None, False):
        model = small_mlp()
        dp = DataParallel(model, comm, shared_memory=shared)
        windowed = isinstance(dp.transport, WindowTransport)
        assert_all_ranks(comm, windowed == (shared is None and comm.size > 1),
                         f"shared_memory={shared}: transport {dp.transport.name}")
        train_parallel(comm, dp, SGD(model.parameters(), lr=0.1, momentum=0.9),
                       batches("mlp", 3, 4 * comm.size))
        x, y = next(batches("mlp", 1, 4 * comm.size, seed=9))
        xs, ys = my_share(comm, x, y)
        dp.backward(softmax_cross_entropy(dp(xs), ys, reduction="sum"), global_count=len(x))
        grads = [p.grad.copy() for p in model.parameters()]
        dp.remove_hooks()
        kept = all(numpy.array_equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        summing = dp.transport.sums_all_at_once
        assert_all_ranks(comm, not summing and kept,
                         f"after remove_hooks: window still summing {summing}, gradients "
                         f"kept {kept}")
        runs[shared] = model
    assert_same_parameters(comm, runs[None], runs[False])


def test_grads_kept_across_remove_hooks_stay_readable_until_close(comm):
    # The .grad arrays a user took point into the shared window; remove_hooks() keeps
    # it mapped (reading them after the window was unmapped killed the process), and
    # close() releases its memory.
    import mpidl.parallel.transport as transport_module

    model = Linear(512, 1024, seed=3, dtype="float64")  # 4 MiB of gradients
    dp = DataParallel(model, comm)
    x = numpy.random.default_rng(comm.rank).standard_normal((2, 512))
    dp.backward(F.sum(dp(x)), global_count=2 * comm.size)
    kept = [p.grad for p in model.parameters()]
    expected = [g.copy() for g in kept]
    dp.remove_hooks()
    dp.remove_hooks()  # again: nothing
    ok = all(numpy.array_equal(k, e) for k, e in zip(kept, expected))
    ok &= all(numpy.array_equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    with raises_all_ranks(comm, RuntimeError, match="after remove_hooks"):
        dp.backward(F.sum(dp(x)), global_count=2 * comm.size)
    shared = getattr(dp.transport, "retired", None) is not None
    assert_all_ranks(comm, ok and shared == (comm.size > 1 and comm.local_size == comm.size),
                     f"kept grads intact and window retired: {ok}, {shared}")
    free_before = transport_module._shm_free_bytes()
    dp.close()
    comm.barrier()
    free_after = transport_module._shm_free_bytes()
    if shared and free_before is not None:
        released = free_after - free_before  # the window holds every rank's 4 MiB copy
        assert_all_ranks(comm, released >= 0.9 * comm.size * 4 * 2**20,
                         f"close() released {released} bytes of /dev/shm")


def test_wrapping_a_model_again_replaces_the_old_wrapper(comm):
    model, ref = small_mlp(), small_mlp()
    first = DataParallel(model, comm)
    second = DataParallel(model, comm)
    assert_all_ranks(comm, first._detached and not first._handles and not second._detached)
    data = list(batches("mlp", 2, 4 * comm.size))
    train_parallel(comm, second, SGD(model.parameters(), lr=0.1), data)
    train_reference(ref, SGD(ref.parameters(), lr=0.1), data)
    assert_same_parameters(comm, model, ref)


def test_a_rewrap_that_fails_leaves_the_old_wrapper_working_and_a_good_one_frees_its_window(
        comm):
    model, ref = small_mlp(), small_mlp()
    first = DataParallel(model, comm)
    with raises_all_ranks(comm, ValueError, match="shared_memory=True"):
        DataParallel(model, comm, shared_memory=True, compression="bfloat16")
    data = list(batches("mlp", 2, 4 * comm.size))
    train_parallel(comm, first, SGD(model.parameters(), lr=0.1), data)  # still works
    train_reference(ref, SGD(ref.parameters(), lr=0.1), data)
    assert_same_parameters(comm, model, ref)
    window = first.transport
    second = DataParallel(model, comm)
    freed = getattr(window, "window", None) is None and getattr(window, "retired", None) is None
    assert_all_ranks(comm, first._detached and freed and not second._detached,
                     f"old wrapper detached {first._detached}, its window freed {freed}")
    second.close()


def test_shared_memory_that_cannot_be_used_is_an_error_on_every_rank(comm):
    with raises_all_ranks(comm, ValueError, match="shared_memory=True"):
        DataParallel(small_mlp(), comm, shared_memory=True, compression="bfloat16")


def test_a_full_dev_shm_falls_back_to_allreduce(comm, monkeypatch):
    # A container's 64 MiB /dev/shm would SIGBUS a window that does not fit in it.
    import mpidl.parallel.transport as transport_module

    if comm.size == 1 or comm.local_size != comm.size:
        pytest.skip("needs several ranks on one node")
    monkeypatch.setattr(transport_module, "_shm_free_bytes", lambda: 1024)
    dp = DataParallel(small_mlp(), comm)
    assert_all_ranks(comm, not isinstance(dp.transport, WindowTransport))
    with raises_all_ranks(comm, ValueError, match="/dev/shm has 0 MiB free"):
        DataParallel(small_mlp(), comm, shared_memory=True)


def test_replicas_stay_identical(comm):
    model = small_mlp("float32")
    dp = DataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=0.01)
    train_parallel(comm, dp, opt, batches("mlp", 4, 3 * comm.size + 1))
    sums = comm.allgather_obj(dp.checksum())
    assert_all_ranks(comm, len(set(sums)) == 1, f"checksums differ: {sums}")
    # One node (as in CI): nothing to overlap with, so the blocking path is chosen.
    assert_all_ranks(comm, dp.overlap is (comm.local_size < comm.size), f"overlap {dp.overlap}")


def test_no_sync_accumulation_equals_one_larger_batch(comm):
    m = 3
    model, ref = small_mlp(), small_mlp()
    dp = DataParallel(model, comm)
    opt, ref_opt = SGD(model.parameters(), lr=0.1), SGD(ref.parameters(), lr=0.1)
    (x, y), = batches("mlp", 1, m * 2 * comm.size)
    micro = numpy.array_split(numpy.arange(len(x)), m)
    for k, idx in enumerate(micro):
        xs, ys = my_share(comm, x[idx], y[idx])
        loss = softmax_cross_entropy(dp(xs), ys, reduction="sum")
        if k < m - 1:
            with dp.no_sync():
                dp.backward(loss, global_count=len(x))
        else:
            dp.backward(loss, global_count=len(x))
    opt.step()
    train_reference(ref, ref_opt, [(x, y)])
    assert_same_parameters(comm, model, ref)


@pytest.mark.parametrize("bucket_mb", [1e-5, 0.002, 1000])
@pytest.mark.parametrize("overlap", [True, False])
def test_bucket_size_does_not_change_the_result(comm, bucket_mb, overlap):
    model, ref = small_mlp(), small_mlp()
    dp = DataParallel(model, comm, bucket_mb=bucket_mb, overlap=overlap)
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.1), batches("mlp", 2, 5))
    train_reference(ref, SGD(ref.parameters(), lr=0.1), batches("mlp", 2, 5))
    expected = len(list(model.parameters())) if bucket_mb == 1e-5 else None
    ok = expected is None or len(dp.buckets) == expected
    assert_all_ranks(comm, ok, f"{len(dp.buckets)} buckets")
    assert_same_parameters(comm, model, ref)


def test_a_rank_with_a_different_model_gets_a_clear_error_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    sizes = (12, 16, 16, 3) if comm.rank != comm.size - 1 else (12, 16, 17, 3)
    with raises_all_ranks(comm, DistributedError) as info:
        DataParallel(mlp(sizes=sizes, seed=7), comm)
    text = str(info.value)
    ok = f"rank {comm.size - 1} has" in text and "rank 0 has" in text and "shape" in text
    assert_all_ranks(comm, ok, text)


def test_ranks_with_different_options_get_a_clear_error_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    compression = "bfloat16" if comm.rank == 1 else None
    with raises_all_ranks(comm, DistributedError,
                          match="compression: rank 0 None, rank 1 'bfloat16'"):
        DataParallel(small_mlp(), comm, compression=compression)


@pytest.mark.parametrize("option, mine, theirs", [
    ("hierarchical", True, 1),   # equal in Python, not to DataParallel
    ("bucket_mb", 4.0, 0),       # invalid on one rank only: still agreed on first
], ids=["true-vs-1", "invalid-on-one-rank"])
def test_options_that_only_look_alike_or_fail_on_one_rank_are_errors_everywhere(
        comm, option, mine, theirs):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    value = theirs if comm.rank == comm.size - 1 else mine
    with raises_all_ranks(comm, DistributedError, match=f"{option}: rank 0 {mine!r}"):
        DataParallel(small_mlp(), comm, **{option: value})


def test_an_option_wrong_on_every_rank_is_a_value_error_everywhere(comm):
    with raises_all_ranks(comm, ValueError, match="bucket_mb=0 must be > 0"):
        DataParallel(small_mlp(), comm, bucket_mb=0)
    dp = DataParallel(small_mlp(), comm, bucket_mb=4 if comm.rank % 2 else 4.0)  # agree
    assert_all_ranks(comm, dp.bucket_mb == 4)


def test_parameters_are_broadcast_from_rank_0(comm):
    model = mlp(sizes=(4, 5, 2), seed=comm.rank)  # different weights on every rank
    DataParallel(model, comm)
    root = mlp(sizes=(4, 5, 2), seed=0)
    assert_same_parameters(comm, model, root)


@pytest.mark.parametrize("compression", ["float16", "bfloat16"])
def test_compressed_gradients_stay_close_to_full_precision(comm, compression):
    model, ref = small_mlp("float32"), small_mlp("float32")
    dp = DataParallel(model, comm, compression=compression)
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.1), batches("mlp", 2, 2 * comm.size))
    train_reference(ref, SGD(ref.parameters(), lr=0.1), batches("mlp", 2, 2 * comm.size))
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_allclose_all_ranks(comm, p.data, q.data, dtype=compression, what=name)


class _Scaled(Module):
    """loss = sum(w * c): the gradient of ``w`` is ``c``, bit pattern and all."""

    def __init__(self, n):
        super().__init__()
        self.w = Parameter(numpy.ones(n, dtype="float32"))

    def forward(self, c):
        return F.sum(self.w * c)


@pytest.mark.parametrize("compression", [None, "float16", "bfloat16"])
def test_a_nan_gradient_on_one_rank_is_a_nan_on_every_rank(comm, compression):
    # Quiet NaNs whose payload bfloat16 rounding carried into the exponent or past 2**32
    # (-0.0 and 0.0 on the wire): the other ranks' sum came back finite and the NaN was
    # lost to the non-finite gradient policy.
    nans = numpy.array([0x7FFFFFFF, 0xFFFF8000, 0xFFFFFFFF], dtype=numpy.uint32)
    c = numpy.full(len(nans) + 2, comm.rank + 1.0, dtype=numpy.float32)
    if comm.rank == comm.size - 1:
        c[:len(nans)] = nans.view(numpy.float32)
    dp = DataParallel(_Scaled(c.size), comm, compression=compression)
    dp.backward(dp(c), global_count=comm.size)
    expected = numpy.full(c.size, sum(r + 1.0 for r in range(comm.size)) / comm.size,
                          dtype=numpy.float32)
    expected[:len(nans)] = numpy.nan
    assert_allclose_all_ranks(comm, dp.module.w.grad, expected, dtype=compression or "float32")
    dp.remove_hooks()


@pytest.mark.parametrize("per_node", [True, 2])
def test_hierarchical_allreduce_matches_flat(comm, per_node):
    model, ref = small_mlp(), small_mlp()
    dp = DataParallel(model, comm, hierarchical=per_node)
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.1), batches("mlp", 2, 3 * comm.size))
    train_reference(ref, SGD(ref.parameters(), lr=0.1), batches("mlp", 2, 3 * comm.size))
    assert_same_parameters(comm, model, ref)
    dp.remove_hooks()


@pytest.mark.parametrize("per_node", [1, 2, "node"])
def test_hierarchical_with_compression_compresses_between_nodes_only(comm, per_node):
    """Node sums stay full precision; only the leaders' allreduce travels in 16 bits.
    With one rank per node every rank is a leader: exactly the flat compressed result."""
    data = list(batches("mlp", 2, 2 * comm.size))
    model, flat, ref = small_mlp("float32"), small_mlp("float32"), small_mlp("float32")
    hierarchical = True if per_node == "node" else per_node  # True: the real nodes
    dp = DataParallel(model, comm, compression="bfloat16", hierarchical=hierarchical)
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.1), data)
    train_reference(ref, SGD(ref.parameters(), lr=0.1), data)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert_allclose_all_ranks(comm, p.data, q.data, dtype="bfloat16", what=name)
    if per_node == "node" or comm.size <= per_node:  # one node: nothing is compressed
        assert_same_parameters(comm, model, ref)
    if per_node == 1:
        flat_dp = DataParallel(flat, comm, compression="bfloat16")
        train_parallel(comm, flat_dp, SGD(flat.parameters(), lr=0.1), data)
        same = all(numpy.array_equal(p.data, q.data)
                   for p, q in zip(model.parameters(), flat.parameters()))
        assert_all_ranks(comm, same, "one rank per node differs from flat compression")
        flat_dp.remove_hooks()
    dp.remove_hooks()


# On one node the tables are summed in the shared window by their touched rows; apart
# from it (shared_memory=False, and always across nodes) by MPI's row exchange.
SPARSE_PATHS = pytest.mark.parametrize("shared_memory", [None, False], ids=["window", "mpi"])


@SPARSE_PATHS
def test_sparse_embedding_exchange_matches_dense(comm, shared_memory):
    vocab = 5000  # few rows touched per step: the sparse exchange is chosen
    model, dense_model, ref = small_bow(vocab=vocab), small_bow(vocab=vocab), small_bow(vocab=vocab)
    dp = DataParallel(model, comm, shared_memory=shared_memory)
    dense = DataParallel(dense_model, comm, sparse_embeddings=False)
    data = list(batches("tokens", 2, 2 * comm.size + 1, vocab=vocab))
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.5), data)
    train_parallel(comm, dense, SGD(dense_model.parameters(), lr=0.5), data)
    train_reference(ref, SGD(ref.parameters(), lr=0.5), data)
    assert_all_ranks(comm, len(dp.sparse) == 1 and (dp.sparse_used or comm.size == 1),
                     f"sparse tables {len(dp.sparse)}, used {dp.sparse_used}")
    assert_same_parameters(comm, model, ref)
    assert_same_parameters(comm, dense_model, ref)


@SPARSE_PATHS
def test_rows_that_several_ranks_touch_are_summed_in_the_sparse_exchange(comm, shared_memory):
    # Tokens from 11 ids of a 5000-row table: every rank touches the same rows, each
    # several times, yet the rows are few enough that the sparse exchange is chosen.
    vocab = 5000
    model, ref = small_bow(vocab=vocab), small_bow(vocab=vocab)
    dp = DataParallel(model, comm, shared_memory=shared_memory)
    data = list(batches("tokens", 2, 3 * comm.size + 1, vocab=12))
    train_parallel(comm, dp, SGD(model.parameters(), lr=0.5), data)
    train_reference(ref, SGD(ref.parameters(), lr=0.5), data)
    assert_all_ranks(comm, dp.sparse_used or comm.size == 1,
                     f"sparse tables {len(dp.sparse)}, used {dp.sparse_used}")
    assert_same_parameters(comm, model, ref)


@SPARSE_PATHS
def test_the_sparse_exchange_after_no_sync_sends_the_rows_of_every_micro_batch(
        comm, shared_memory):
    # Each micro-batch of the cycle reads its own 10 rows of the table: the sync must
    # sum the rows the first ones touched too, not only the last one's.
    vocab, m = 5000, 3
    model, ref = small_bow(vocab=vocab), small_bow(vocab=vocab)
    dp = DataParallel(model, comm, shared_memory=shared_memory)
    micro = [(x + 100 * k, y) for k, (x, y) in
             enumerate(batches("tokens", m, 2 * comm.size + 1, vocab=11))]
    total = sum(len(x) for x, _ in micro)
    for k, (x, y) in enumerate(micro):
        xs, ys = my_share(comm, x, y)
        loss = softmax_cross_entropy(dp(xs), ys, reduction="sum")
        with dp.no_sync() if k < m - 1 else contextlib.nullcontext():
            dp.backward(loss, global_count=total)
    x, y = (numpy.concatenate(parts) for parts in zip(*micro))
    softmax_cross_entropy(ref(x), y, reduction="mean").backward()
    assert_all_ranks(comm, dp.sparse_used or comm.size == 1,
                     f"sparse tables {len(dp.sparse)}, used {dp.sparse_used}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_allclose_all_ranks(comm, p.grad, q.grad, what=name)


def test_a_tied_embedding_table_is_exchanged_dense(comm):
    # GPT ties its output projection to the token table (linear(h, tok.weight)): the
    # table's gradient is dense, although only Embedding modules hold it.
    from mpidl.models import GPT

    vocab = 200
    model, ref = (GPT(vocab=vocab, seq_len=SEQ, dim=8, layers=1, heads=2, seed=0,
                      dtype="float64") for _ in range(2))
    dp = DataParallel(model, comm)
    opt, ref_opt = SGD(model.parameters(), lr=0.5), SGD(ref.parameters(), lr=0.5)
    for x, y in batches("tokens", 2, 2 * comm.size + 1, vocab=vocab):
        xs, _ = my_share(comm, x, y)
        loss = softmax_cross_entropy(dp(xs[:, :-1]).reshape(-1, vocab),
                                     xs[:, 1:].reshape(-1), reduction="sum")
        dp.backward(loss, global_count=x[:, 1:].size)
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        softmax_cross_entropy(ref(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1),
                              reduction="mean").backward()
        ref_opt.step()
    assert_all_ranks(comm, not dp.sparse_used, "the tied table went through the row exchange")
    assert_same_parameters(comm, model, ref, scale=100)


@SPARSE_PATHS
@pytest.mark.parametrize("dense_step", [0, 1], ids=["penalty-then-rows", "rows-then-penalty"])
def test_a_weight_penalty_in_the_loss_makes_the_table_gradient_dense(comm, dense_step,
                                                                     shared_memory):
    # An L2 term over every parameter, in one micro-batch of a no_sync cycle: the
    # accumulated table gradient is dense, so the cycle's sync must be dense.
    vocab = 5000
    model, ref = small_bow(vocab=vocab), small_bow(vocab=vocab)
    dp = DataParallel(model, comm, shared_memory=shared_memory)
    (x, y), = batches("tokens", 1, 4 * comm.size, vocab=vocab)
    halves = [(x[:2 * comm.size], y[:2 * comm.size]), (x[2 * comm.size:], y[2 * comm.size:])]
    for step, (xh, yh) in enumerate(halves):
        xs, ys = my_share(comm, xh, yh)
        loss = softmax_cross_entropy(dp(xs), ys, reduction="sum")
        if step == dense_step:  # each rank adds 1/size of the penalty: the sum is one
            loss = loss + sum(F.sum(p * p) for p in model.parameters()) * (
                0.5 * len(x) / comm.size)
        with dp.no_sync() if step == 0 else contextlib.nullcontext():
            dp.backward(loss, global_count=len(x))
    loss = softmax_cross_entropy(ref(x), y, reduction="mean")
    (loss + sum(F.sum(p * p) for p in ref.parameters()) * 0.5).backward()
    assert_all_ranks(comm, not dp.sparse_used, "the penalised table went through the rows")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_allclose_all_ranks(comm, p.grad, q.grad, scale=100, what=name)


def test_optimizer_state_is_broadcast_for_resume(comm):
    model = small_mlp()
    dp = DataParallel(model, comm)
    opt = AdamW(model.parameters(), lr=0.01)
    if comm.rank == 0:  # only rank 0 "resumed": it has state, the others have none
        x, y = next(batches("mlp", 1, 4))
        softmax_cross_entropy(model(x), y).backward()
        opt.step()
    dp.broadcast_optimizer_state(opt)
    state = opt.state_dict()
    arrays = sorted(k for k, v in state.items() if hasattr(v, "shape"))
    digest = [float(numpy.asarray(state[k], dtype="float64").sum()) for k in arrays]
    everyone = comm.allgather_obj((arrays, digest, state.get("step")))
    assert_all_ranks(comm, all(e == everyone[0] for e in everyone) and arrays,
                     f"optimizer state differs: {everyone[comm.rank]} vs {everyone[0]}")


def test_a_loss_scale_multiplies_the_averaged_gradients_exactly(comm):
    # Powers of two: scaling is exact in binary floating point.
    (x, y), = batches("mlp", 1, 10)
    grads = []
    for scale in (1.0, 1024.0):
        model = small_mlp()
        dp = DataParallel(model, comm)
        xs, ys = my_share(comm, x, y)
        dp.backward(softmax_cross_entropy(dp(xs), ys, reduction="sum"), global_count=len(x),
                    scale=scale)
        grads.append([p.grad.copy() for p in model.parameters()])
        dp.close()
    same = all(numpy.array_equal(a * 1024.0, b) for a, b in zip(*grads))
    assert_all_ranks(comm, same, "scale=1024 did not multiply the gradients by 1024 exactly")


def test_a_standardized_mlp_trains_like_one_rank_without_broadcasting_its_fixed_scale(comm):
    # The input and target scales are buffers that never change: N ranks x b == 1 rank
    # x N*b as for the plain mlp, and no buffer broadcast per step (batch norm's
    # running statistics are broadcast; these would cost two bcasts a step for nothing).
    from mpidl.testing.counting import CountingCommunicator

    scales = dict(input_stats=(list(numpy.linspace(-1, 1, 12)), list(numpy.linspace(1, 5, 12))),
                  target_stats=([0.5, -2.0, 3.0], [1.0, 10.0, 0.1]))
    model, reference = (mlp(sizes=(12, 16, 16, 3), seed=7, dtype="float64", **scales)
                        for _ in range(2))
    counting = CountingCommunicator(comm)
    dp = DataParallel(model, counting)
    opt, ref_opt = SGD(model.parameters(), lr=0.05), SGD(reference.parameters(), lr=0.05)
    data = list(batches("mlp", 4, 12))
    before = counting.counts["bcast_"].calls if "bcast_" in counting.counts else 0
    train_parallel(comm, dp, opt, data)
    train_reference(reference, ref_opt, data)
    after = counting.counts["bcast_"].calls if "bcast_" in counting.counts else 0
    assert_all_ranks(comm, after == before, f"{after - before} buffer broadcasts in 4 steps")
    assert_same_parameters(comm, model, reference)
    dp.close()
