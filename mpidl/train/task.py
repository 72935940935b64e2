"""Where a run's data comes from: a user's sharded dataset, or a generated corpus.

``mpidl train`` with no arguments trains on 50,000 generated customer reviews
(:mod:`mpidl.data.synthetic`); ``mpidl train gpt`` on a generated language corpus with
learnable structure (:mod:`mpidl.data.language`). Each is generated and sharded once,
through the same writer ``mpidl shard`` uses, into ``<cache_dir>/<task>-<key>/``, where
``key`` is a hash of the corpus options; later runs with the same options reuse it.
Rank 0 builds it in a temporary directory and renames it into place, so concurrent jobs
never see half a dataset; the other ranks wait. A preemption during the build ends it at
its next phase (generating, writing the shards) and removes the temporary directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable

from mpidl.comm.ledger import patience
from mpidl.data import write_text_shards
from mpidl.data.cosmo import write_cosmo
from mpidl.data.language import write_language
from mpidl.data.synthetic import generate_reviews
from mpidl.train.config import Config
from mpidl.train.signals import Preempted


def _options(config: Config) -> dict:
    """The options that make a task's corpus (its cache key)."""
    d = config.data
    if config.task == "gpt":
        return {"num_train": d.num_train, "num_test": d.num_test, "seq_len": d.seq_len,
                "vocab_size": d.vocab_size, "seed": d.seed, "format": 1}
    if config.task == "cosmo":
        return {"num_train": d.num_train, "num_test": d.num_test, "side": d.side,
                "seed": d.seed, "format": 1}
    return {"num_train": d.num_train, "num_test": d.num_test, "seq_len": d.seq_len,
            "vocab_size": d.vocab_size, "label_noise": d.label_noise, "seed": d.seed,
            "format": 1}


def corpus_cache_dir(config: Config) -> str:
    """The directory of the generated corpus of ``config.task`` for its options."""
    key = hashlib.sha256(json.dumps(_options(config), sort_keys=True).encode()).hexdigest()
    name = {"gpt": "language", "cosmo": "cosmo"}.get(config.task, "reviews")
    return os.path.join(config.data.cache_dir, f"{name}-{key[:12]}")


def reviews_cache_dir(config: Config) -> str:
    """The directory of the generated reviews corpus for ``config.data``'s options."""
    return corpus_cache_dir(config)


def _build(config: Config, target: str, stop: Callable[[], bool] | None = None) -> None:
    """Generate the task's corpus into ``target`` (a temporary sibling, then renamed).
    Preempted when ``stop()`` says so between phases; the temporary is removed."""
    parent = os.path.dirname(os.path.abspath(target)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".reviews-", dir=parent)
    # mkdtemp makes it 0700; the cache is meant to be shared (a group's cache_dir), so it
    # gets the mode any directory made here would get (umask applied).
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        _write_corpus(config, tmp, stop or (lambda: False))
        try:
            os.rename(tmp, target)
        except OSError:  # another job got there first: use theirs
            if not os.path.isdir(target):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _write_corpus(config: Config, out: str, stop: Callable[[], bool]) -> None:
    d = config.data
    if stop():
        raise Preempted("generating the corpus")
    if config.task == "gpt":
        write_language(out, d.num_train, d.num_test, d.seq_len, d.vocab_size, d.seed)
        return
    if config.task == "cosmo":
        write_cosmo(out, d.num_train, d.num_test, d.side, d.seed)
        return
    train_texts, train_labels, test_texts, test_labels = generate_reviews(
        d.num_train, d.num_test, seed=d.seed, label_noise=d.label_noise)
    if stop():  # the shards take longer than the texts: not begun for a preempted job
        raise Preempted("generating the corpus")
    names = ("negative", "positive")
    write_text_shards(out, train_texts, [names[i] for i in train_labels],
                      test_texts=test_texts, test_labels=[names[i] for i in test_labels],
                      vocab_size=d.vocab_size, length=d.seq_len, classes=names,
                      source="mpidl.data.synthetic.generate_reviews", seed=d.seed)


def _complete(target: str) -> bool:
    """Whether a cached corpus has both splits' manifests (written last by the writer)."""
    return all(os.path.isfile(os.path.join(target, split, "manifest.json"))
               for split in ("train", "test"))


def prepare_data(config: Config, comm: Any, log: Any,
                 stop: Callable[[], bool] | None = None) -> str:
    """Return the dataset directory of the run, generating the corpus if needed.

    Collective: rank 0 generates (when the task's corpus is not cached yet) while the
    others wait; a failure on rank 0 is raised on every rank.

    Args:
        stop: asked by rank 0 between the phases of a build (``mpidl train`` passes its
            preemption flag's ``is_set``); True ends the build there, removes its
            temporary directory and raises :class:`~mpidl.train.signals.Preempted` on
            every rank. A finished build is kept (the next attempt uses it).
    """
    if config.data.path:
        return config.data.path
    if config.task not in ("reviews", "gpt", "cosmo"):
        raise ValueError(f"task {config.task!r} needs a dataset: pass --data=DIR "
                         "(a directory written by `mpidl shard`)")
    target = corpus_cache_dir(config)
    error, stopped = None, False
    if comm.rank == 0 and os.path.isdir(target) and not _complete(target):
        # Damaged (a scratch purge took files, kept directories): set it aside, rebuild.
        aside = f"{target}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        log.info(f"the cached corpus {target} is incomplete; moved to {aside}, rebuilding")
        os.rename(target, aside)
    if comm.rank == 0 and not os.path.isdir(target):
        what = {"gpt": "language", "cosmo": "Gaussian random field"}.get(config.task,
                                                                         "reviews")
        log.info(f"generating the {what} corpus ({config.data.num_train} train + "
                 f"{config.data.num_test} test) into {target} ...")
        try:
            _build(config, target, stop)
        except Preempted:
            stopped = True
        except Exception as e:  # reported on every rank below
            error = f"{type(e).__name__}: {e}"
    with patience("rank 0 generates the corpus"):
        comm.check(error is None, f"could not build the corpus in {target}: {error}")
    if stop is not None and comm.agree(stopped):
        raise Preempted("generating the corpus")
    return target
