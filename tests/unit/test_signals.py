"""Preemption: SIGTERM/SIGUSR1 set a flag, the handlers are restored, ranks agree."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from mpidl.train.signals import EXIT_PREEMPTED, PreemptionFlag


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_to_self_sets_the_flag(sig):
    with PreemptionFlag() as flag:
        assert not flag and flag.signum is None
        os.kill(os.getpid(), sig)
        assert flag.is_set and flag.signum == sig
        assert flag.signal_name == signal.Signals(sig).name


def test_first_signal_is_the_one_remembered():
    with PreemptionFlag() as flag:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.signal_name == "SIGUSR1"


def test_close_restores_the_previous_handlers():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        before_term = signal.getsignal(signal.SIGTERM)
        flag = PreemptionFlag()
        assert signal.getsignal(signal.SIGUSR1) != previous
        flag.close()
        flag.close()                                   # idempotent
        assert signal.getsignal(signal.SIGTERM) == before_term
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] and not flag
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_agree_is_true_on_every_rank_when_any_rank_is_signalled(comm):
    with PreemptionFlag() as flag:
        assert flag.agree(comm) is False
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.agree(comm) is True


def test_creating_it_off_the_main_thread_is_an_error():
    errors = []

    def make():
        try:
            PreemptionFlag()
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


def test_exit_code_is_ex_tempfail():
    assert EXIT_PREEMPTED == 75


def test_a_flag_of_no_signals_installs_nothing_and_is_never_set():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    made = []
    thread = threading.Thread(target=lambda: made.append(PreemptionFlag(None)))
    thread.start()  # off the main thread too: it touches no handler
    thread.join()
    assert made and not made[0].is_set
    assert {s: signal.getsignal(s) for s in before} == before


def test_check_raises_preempted_on_every_rank_when_any_rank_is_signalled(comm):
    from mpidl.train.signals import Preempted

    with PreemptionFlag() as flag:
        flag.check(comm, "starting")  # nothing yet
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Preempted) as caught:
            flag.check(comm, "generating the corpus")
    assert caught.value.during == "generating the corpus"
