"""When data parallelism's bucket allreduces start and finish: overlapped with backward,
or after it.

:class:`BucketLauncher` owns the order of one backward's gradient exchange over the
buckets (:mod:`mpidl.parallel.buckets`) and their transport
(:mod:`mpidl.parallel.transport`); :class:`~mpidl.parallel.DataParallel` tells it when a
backward begins, when a parameter's gradient is final, and when backward has ended::

    launcher = BucketLauncher(buckets, transport, overlap=True)
    launcher.begin()                  # before backward: every bucket counts its params
    ...                               # backward's hooks: launcher.ready(bucket)
    launcher.finish()                 # after backward: start the rest, wait for all

Overlap: a parameter's post-accumulate hook counts down its bucket during backward; a
bucket whose gradients are all final starts its non-blocking allreduce at once (a ready
bucket waits for the ones before it, so every rank starts them in the same order), and
later hooks call ``test()`` on the requests in flight: Open MPI progresses a non-blocking
collective only inside MPI calls. This pays when the ranks span several nodes, where a
network moves the data while the cores compute. When every rank shares one node the
"network" is the same cores copying memory, nothing is left to overlap with, and one
blocking allreduce per bucket after backward measured faster (benchmarks/README.md).
"""
from __future__ import annotations

from typing import Any, Sequence

from mpidl.parallel.buckets import Bucket


class BucketLauncher:
    """Starts each bucket's allreduce in bucket order and waits for them all.

    Collective over the transport's communicator in :meth:`ready` (with ``overlap``)
    and :meth:`finish`: every rank starts the same buckets in the same order.

    Args:
        buckets: the gradient buckets, in the order every rank starts them.
        transport: how a bucket is summed (:func:`~mpidl.parallel.transport.choose_transport`).
        overlap: start buckets from backward's hooks as they fill (True), or all after
            backward, one blocking allreduce each (False).
    """

    def __init__(self, buckets: Sequence[Bucket], transport: Any, overlap: bool) -> None:
        self.buckets, self.transport, self.overlap = list(buckets), transport, overlap
        self.next = 0  # the first bucket not started yet

    def begin(self) -> None:
        """Before a backward: every bucket attached and waiting for all its parameters."""
        for b in self.buckets:
            b.attach()
            b.pending = len(b.params)
        self.next = 0

    def ready(self, bucket: Bucket | None) -> None:
        """A parameter of ``bucket`` (None: of no bucket) has its final gradient; with
        overlap, start every bucket now ready and drive the ones in flight."""
        if bucket is not None:
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch_ready()
        for b in self.buckets[:self.next]:
            if b.request is not None:
                b.request.test()  # drive MPI progress while backward computes

    def finish(self) -> bool:
        """Start the buckets backward did not start, in order; then finish them all.

        Without overlap every bucket runs one blocking allreduce here: it beats a
        non-blocking one plus wait on one node (Open MPI's libnbc schedule copies through
        temporary buffers; see benchmarks/README.md). With overlap the rest start
        non-blocking too, because another rank may have started the same bucket during
        its backward, and a non-blocking collective only matches a non-blocking one: a
        rank whose batch never reached some parameter (an unused branch) never fires its
        hook, and starts that bucket only here.
        """
        if self.transport.sums_all_at_once:
            return self.transport.allreduce_all_()
        for b in self.buckets[self.next:]:
            self.start(b, blocking=not self.overlap)
        self.next = len(self.buckets)
        for b in self.buckets:
            self.wait(b)
        return False

    def _launch_ready(self) -> None:
        """Start buckets in order: each one once it (and every earlier one) is ready."""
        while self.next < len(self.buckets):
            b = self.buckets[self.next]
            if b.pending > 0:
                return
            self.start(b)
            self.next += 1

    def start(self, b: Bucket, blocking: bool = False) -> None:
        """Allreduce bucket ``b``: start it (``b.request``), or run it to the end."""
        if blocking:
            self.transport.allreduce_(b.flat)
        else:
            b.request = self.transport.iallreduce_(b.flat)

    def wait(self, b: Bucket) -> None:
        """Wait for bucket ``b``'s allreduce, if one is in flight."""
        if b.request is not None:
            b.request.wait()
            b.request = None


__all__ = ["BucketLauncher"]
