"""The built-in task's data: the generated reviews corpus and its cache."""
from __future__ import annotations

import os

import pytest

from mpidl.comm import world
from mpidl.data import ShardedDataset
from mpidl.train.config import Config
from mpidl.train.log import Logger
from mpidl.train.signals import Preempted
from mpidl.train.task import prepare_data


def test_a_damaged_corpus_cache_is_rebuilt(tmp_path):
    # A scratch purge removes files and keeps directories: the cache must not be reused.
    config = Config()
    config.data.num_train, config.data.num_test = 200, 50
    config.data.cache_dir = str(tmp_path / "cache")
    comm = world()
    target = prepare_data(config, comm, Logger(0, 1))
    for root, _, files in os.walk(target):
        for name in files:
            os.remove(os.path.join(root, name))
    assert prepare_data(config, comm, Logger(0, 1)) == target
    assert len(ShardedDataset(os.path.join(target, "train"))) == 200
    assert [d for d in os.listdir(tmp_path / "cache") if ".damaged-" in d]  # set aside


def test_the_corpus_cache_gets_the_umask_mode_not_mkdtemps_0700(tmp_path):
    config = Config()
    config.data.num_train, config.data.num_test = 100, 20
    config.data.cache_dir = str(tmp_path / "cache")
    old = os.umask(0o002)  # a group-shared cache
    try:
        target = prepare_data(config, world(), Logger(0, 1))
    finally:
        os.umask(old)
    assert os.stat(target).st_mode & 0o777 == 0o775


def _small(tmp_path):
    config = Config()
    config.data.num_train, config.data.num_test = 100, 20
    config.data.cache_dir = str(tmp_path / "cache")
    return config


@pytest.mark.parametrize("asked_at", [1, 2], ids=["before-generating", "before-sharding"])
def test_a_preempted_corpus_build_raises_and_leaves_no_temporary_folder(tmp_path, asked_at):
    config = _small(tmp_path)
    asked = []

    def stop():  # True from its asked_at-th question on: the signal came in between
        asked.append(1)
        return len(asked) >= asked_at

    with pytest.raises(Preempted):
        prepare_data(config, world(), Logger(0, 1), stop=stop)
    assert len(asked) == asked_at
    assert os.listdir(tmp_path / "cache") == []  # no corpus, no .reviews-* temporary


def test_a_build_that_is_not_stopped_is_kept(tmp_path):
    config = _small(tmp_path)
    target = prepare_data(config, world(), Logger(0, 1), stop=lambda: False)
    assert os.listdir(tmp_path / "cache") == [os.path.basename(target)]
