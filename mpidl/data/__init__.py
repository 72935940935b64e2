"""Sharded HDF5 datasets: format, writers, the exact distributed sampler, the loader.

Write a dataset (``mpidl shard`` on the command line, or the API)::

    mpidl shard --from-csv IMDB.csv --text-col review --label-col sentiment data/imdb

    from mpidl.data import write_shards
    write_shards("data/mnist", {"x": x, "y": y}, test_fraction=0.1)

Read it on every rank::

    from mpidl.data import ShardedDataset, DistributedSampler, DataLoader, ExactAccuracy
    ds = ShardedDataset("data/imdb/train", comm=comm)      # collective checks
    sampler = DistributedSampler(len(ds), 256, comm.rank, comm.size, seed=0)
    loader = DataLoader(ds, sampler, features=("x", "y"), xp=xp)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for x, y, global_count in loader: ...

Layout on disk (details in :mod:`mpidl.data.format`)::

    data/imdb/
      train/manifest.json    format_version, features {name: dtype, shape}, shards
                             [{file, rows, bytes, sha256}], labels, metadata
                             (vocab, classes, tokenizer, pad_id, length, stats)
      train/shard-00000.h5   datasets /x (int32 (rows, length) token ids), /y (int64 labels)
      test/manifest.json     same features; vocabulary built on train, stored in both
      test/shard-00000.h5

Guarantees:

- the sampler gives every sample exactly once per epoch over all ranks, no padding,
  the same global batches at any number of ranks, resumable at any step
  (:mod:`mpidl.data.sampler`);
- each rank reads only its samples, in contiguous runs, in a prefetch thread
  (:mod:`mpidl.data.loader`);
- a missing, truncated, corrupt or inconsistent shard, a shard name escaping the
  directory, an out-of-range label or token id, or splits that disagree
  (:mod:`mpidl.data.splits`) is a :class:`DataError` naming the file
  (:mod:`mpidl.data.hdf5`); evaluation counts are summed exactly over ranks
  (:mod:`mpidl.data.evaluate`).

Importing this package imports NumPy only; h5py is imported when files are read or written.
"""

from mpidl.data.evaluate import ExactAccuracy, evaluate_counts
from mpidl.data.format import DataError, Manifest, read_manifest
from mpidl.data.hdf5 import ShardedDataset, verify_dataset
from mpidl.data.loader import DataLoader
from mpidl.data.sampler import DistributedSampler
from mpidl.data.shard import raise_open_file_limit
from mpidl.data.text import build_vocab, encode, encode_labels, tokenize
from mpidl.data.writer import write_shards, write_split, write_text_shards

__all__ = [
    "DataError",
    "Manifest",
    "read_manifest",
    "ShardedDataset",
    "verify_dataset",
    "raise_open_file_limit",
    "DistributedSampler",
    "DataLoader",
    "ExactAccuracy",
    "evaluate_counts",
    "write_shards",
    "write_split",
    "write_text_shards",
    "tokenize",
    "build_vocab",
    "encode",
    "encode_labels",
]
