"""The memcpy reference the committer's copies are held to: glibc ``memcpy`` with the committer's stores.

The committer starts with glibc's non-temporal threshold lowered (``omnishm.committer.stores``), and glibc
reads that threshold once, when a process starts. A ``memcpy`` timed in the benchmark's own process keeps
glibc's default (190 MiB on a 480 MiB-L3 build machine), so a 64 MiB copy there goes through the cache, and
the committer's copies of the same bytes with non-temporal stores ran 1.4 times faster than their
"physical limit" (review, 2026-12-05: 9.2 GB/s against 6.7, and against 11.6 with the committer's
setting). The fastest single-thread copy the machine can do includes the committer's kind, so it is timed
here too: in a child process started with the committer's ``GLIBC_TUNABLES``, one copy per request,
between pre-faulted private buffers as ``common.Memcpy``'s.

Protocol (text lines): the parent writes a byte count, the child copies that many bytes and answers the
seconds it took. ``python -m omnishm.bench.nt_memcpy CAPACITY`` is the child. Standard library only in
the child.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time

from omnishm.committer import stores


class NonTemporalMemcpy:
    """The parent's handle on the child; ``time(nbytes)`` is one timed copy. Main thread only."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, capacity: int) -> "NonTemporalMemcpy | None":
        """A child that copies up to ``capacity`` bytes with the committer's threshold, or None where there
        is nothing to add: a platform without the tunable, a threshold of 0 (glibc's own: the in-process
        copy is the same), or a ``GLIBC_TUNABLES`` of this process that names it already (so does the
        committer's)."""
        from omnishm import config as knobs

        threshold = int(knobs.resolve("committer", {}, names=("nontemporal_threshold",))["nontemporal_threshold"])
        tunables = stores.with_threshold(os.environ.get(stores.ENV, ""), threshold)
        if not threshold or tunables is None or not stores._applies():
            return None
        proc = subprocess.Popen([sys.executable, "-m", "omnishm.bench.nt_memcpy", str(capacity)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                env={**os.environ, stores.ENV: tunables})
        child = cls(proc)
        if child._ask("ready") != "ready":
            child.close()
            raise RuntimeError("the non-temporal memcpy child did not start")
        return child

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(line + "\n")
            answer = self.proc.stdout.readline().strip()
        except OSError:  # a broken pipe: the child is gone
            answer = ""
        if not answer:
            raise RuntimeError(f"the non-temporal memcpy child exited ({self.proc.poll()})")
        return answer

    def time(self, nbytes: int) -> float:
        """Seconds of one ``memcpy`` of ``nbytes`` in the child."""
        return float(self._ask(str(int(nbytes))))

    def close(self) -> None:
        """End the child (at its stdin's end; killed after 10 s). Never raises for a child that died:
        ``communicate`` passes over a broken pipe, and closes both pipes."""
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _child(capacity: int) -> None:
    src, dst = mmap.mmap(-1, max(capacity, 1)), mmap.mmap(-1, max(capacity, 1))
    src.write(b"\1" * len(src))  # every page touched now, so timed copies never fault
    dst.write(b"\1" * len(dst))
    sp = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dp = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    for line in sys.stdin:
        word = line.strip()
        if word == "ready":
            print("ready", flush=True)
            continue
        n = int(word)
        if not 0 <= n <= capacity:
            raise SystemExit(f"nt_memcpy: asked to copy {n} bytes, holds {capacity}")
        t0 = time.perf_counter()
        ctypes.memmove(dp, sp, n)
        print(repr(time.perf_counter() - t0), flush=True)


if __name__ == "__main__":
    _child(int(sys.argv[1]))
