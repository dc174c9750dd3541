"""The memcpy reference the committer's copies are held to: glibc ``memcpy`` with the committer's stores.

The committer starts with glibc's non-temporal threshold lowered (``omnishm.committer.stores``), and glibc
reads that threshold once, when a process starts. A ``memcpy`` timed in the benchmark's own process keeps
glibc's default (190 MiB on a 480 MiB-L3 build machine), so a 64 MiB copy there goes through the cache, and
the committer's copies of the same bytes with non-temporal stores ran 1.4 times faster than their
"physical limit" (review, 2026-12-05: 9.2 GB/s against 6.7, and against 11.6 with the committer's
setting). The fastest single-thread copy the machine can do includes the committer's kind, so it is timed
here too: in a child process started with the committer's ``GLIBC_TUNABLES``, one copy per request,
between pre-faulted private buffers as ``common.Memcpy``'s.

The same child also times a *scatter*: a step's pieces copied one ``memcpy`` each from consecutive staging
to the places the step names, as the committer's apply copies a run of slots. Figure 1's large step is 512
pieces of 128 KiB, and glibc copies such a piece at about 0.75 of the rate it copies 64 MiB in one call
(2026-12-07, 2-vCPU Xeon: 8.4-8.9 against 11.4-11.9 GB/s with this threshold; in order or at random places
alike; a 4-page-interleaved loop serves only copies of 16 thresholds or more, and the threshold cannot go
under 16448 bytes). That row tells how much of figure 1's gap is the pieces' and how much the committer's.

Protocol (text lines): the parent writes a byte count, the child copies that many bytes and answers the
seconds it took; or ``scatter PIECE P0,P1,...``: the child copies piece ``i`` of its source to piece ``Pi``
of a destination it grows to hold them (before the clock starts), checks after the clock that each piece
landed where it was sent (its first and last 8 bytes), and answers the seconds.
``python -m omnishm.bench.nt_memcpy CAPACITY`` is the child. Standard library only in the child.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from omnishm.committer import stores


class NonTemporalMemcpy:
    """The parent's handle on the child; ``time(nbytes)`` is one timed copy. Main thread only."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, capacity: int, *, always: bool = False) -> "NonTemporalMemcpy | None":
        """A child that copies up to ``capacity`` bytes with the committer's threshold, or None where there
        is nothing to add: a platform without the tunable, a threshold of 0 (glibc's own: the in-process
        copy is the same), or a ``GLIBC_TUNABLES`` of this process that names it already (so does the
        committer's). With ``always`` there is a child in those cases too, copying with this process's
        stores (which are then the committer's), for its ``scatter``."""
        from omnishm import config as knobs

        threshold = int(knobs.resolve("committer", {}, names=("nontemporal_threshold",))["nontemporal_threshold"])
        tunables = stores.with_threshold(os.environ.get(stores.ENV, ""), threshold)
        differs = bool(threshold) and tunables is not None and stores._applies()
        if not differs and not always:
            return None
        env = {**os.environ, stores.ENV: tunables} if differs and tunables is not None else dict(os.environ)
        from omnishm.bench.common import dies_with_bench  # common imports this module

        proc = subprocess.Popen([sys.executable, "-m", "omnishm.bench.nt_memcpy", str(capacity)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
                                preexec_fn=dies_with_bench(deaf_to_ctrl_c=True))
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

    def scatter(self, piece: int, places: Sequence[int]) -> float:
        """Seconds for the child to copy ``len(places)`` pieces of ``piece`` bytes, one ``memcpy`` each, from
        its source in order to ``places`` (in pieces) of its scatter destination."""
        return float(self._ask(f"scatter {int(piece)} {','.join(str(int(p)) for p in places)}"))

    def close(self) -> None:
        """End the child (at its stdin's end; killed after 10 s). Never raises for a child that died:
        ``communicate`` passes over a broken pipe, and closes both pipes."""
        try:
            self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


def _prefaulted(size: int) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, max(size, 1))
    buf.write(b"\1" * len(buf))  # every page touched now, so timed copies never fault
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _child(capacity: int) -> None:
    (src, sp), dst = _prefaulted(capacity), _prefaulted(capacity)  # dst held: its address is used below
    dp = dst[1]
    scatter_dst: tuple[mmap.mmap, int] | None = None
    for line in sys.stdin:
        word = line.strip()
        if word == "ready":
            print("ready", flush=True)
            continue
        if word.startswith("scatter "):
            _, piece_s, places_s = word.split(" ")
            piece, places = int(piece_s), [int(p) for p in places_s.split(",")]
            if piece < 8 or len(places) * piece > capacity or min(places) < 0 or len(set(places)) < len(places):
                raise SystemExit(f"nt_memcpy: cannot scatter {len(places)} pieces of {piece} bytes, holds {capacity}")
            need = (max(places) + 1) * piece
            if scatter_dst is None or len(scatter_dst[0]) < need:
                scatter_dst = _prefaulted(need)
            out = scatter_dst[0]
            for i in range(len(places)):  # each piece's first and last words name it, for the check below
                src[i * piece:i * piece + 8] = src[(i + 1) * piece - 8:(i + 1) * piece] = (i + 1).to_bytes(8, "little")
            base = scatter_dst[1]
            memmove, t0 = ctypes.memmove, time.perf_counter()
            for i, place in enumerate(places):
                memmove(base + place * piece, sp + i * piece, piece)
            took = time.perf_counter() - t0
            for i, place in enumerate(places):  # a reference that copied the wrong bytes would time nothing real
                mark = (i + 1).to_bytes(8, "little")
                at, end = place * piece, (place + 1) * piece
                if out[at:at + 8] != mark or out[end - 8:end] != mark:
                    raise SystemExit(f"nt_memcpy: piece {i} did not land at place {place}")
            print(repr(took), flush=True)
            continue
        n = int(word)
        if not 0 <= n <= capacity:
            raise SystemExit(f"nt_memcpy: asked to copy {n} bytes, holds {capacity}")
        t0 = time.perf_counter()
        ctypes.memmove(dp, sp, n)
        print(repr(time.perf_counter() - t0), flush=True)


if __name__ == "__main__":
    _child(int(sys.argv[1]))
