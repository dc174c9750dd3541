"""Non-temporal stores for the pool writes: glibc's ``x86_non_temporal_threshold``, set at the committer's start.

The committer copies each step's rows into the pool and never reads them back; a reader copies them out
later, usually much later. An ordinary store first reads the destination's cache line (read for
ownership), so a copy into memory that is not cached moves its bytes over the memory bus twice. glibc's
``memcpy`` uses non-temporal stores, which skip that read, only for copies of at least
``x86_non_temporal_threshold`` bytes, a threshold it derives from the size of the last-level cache: tens
to hundreds of MiB. A step's rows land as runs of one block each (16 rows of 4096 bf16: 128 KiB), far
below it, so by default every pool write takes the slow kind. Measured on a 2-vCPU Xeon with a 480 MiB
L3 (2026-12-05): 64 MiB in 128 KiB runs into shared memory, 8.9 GB/s with ordinary stores, 12.9 GB/s
with the threshold at 64 KiB; one 64 MiB ``memcpy`` 11.8 against 14.1 GB/s.

glibc reads its tunables once, when the process starts. So ``omnishm.committer.main`` re-executes the
interpreter (same pid, same arguments) with the threshold added to ``GLIBC_TUNABLES``, right after its
options are parsed and before it makes anything: no lock, socket, segment or thread exists yet. The
setting is the committer's own; an engine process that held the pool (the in-process design) would have
to set it for all of vLLM's copies too. ``nontemporal_threshold`` (``OMNISHM_NONTEMPORAL_THRESHOLD``,
``--nontemporal-threshold``) sets the bytes; 0 leaves glibc's own threshold. A ``GLIBC_TUNABLES`` that
already names the tunable is the operator's choice and is kept. Elsewhere than glibc on x86-64 nothing
happens. Standard library only.
"""

from __future__ import annotations

import os
import platform
import signal
import sys

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
ENV = "GLIBC_TUNABLES"
MIN_BYTES = 0x4040
"""glibc's lower bound for the threshold (16448 bytes): a smaller one is ignored without a word."""
DEFAULT_BYTES = 64 << 10
"""The committer's long runs (``apply.RUN_BYTES``): each goes by one copy, with non-temporal stores."""
_EXECED = "OMNISHM_COMMITTER_REEXECED"
"""Set in the re-executed image: never a second exec, whatever glibc made of ``GLIBC_TUNABLES``."""


def check_threshold(value: int) -> int:
    """The ``nontemporal_threshold`` knob's check: 0 (glibc's own), or at least glibc's lower bound."""
    if 0 < value < MIN_BYTES:
        raise ValueError(f"glibc ignores a threshold under {MIN_BYTES} bytes; use 0 to keep glibc's own")
    return value


def with_threshold(tunables: str, threshold: int) -> str | None:
    """``tunables`` (a ``GLIBC_TUNABLES`` value) with ``TUNABLE=threshold`` added; None when it names
    ``TUNABLE`` already (the operator's value is kept)."""
    items = [item for item in tunables.split(":") if item]
    if any(item.split("=", 1)[0] == TUNABLE for item in items):
        return None
    return ":".join([*items, f"{TUNABLE}={threshold}"])


def threshold_in_effect() -> int | None:
    """The threshold this process was started with (``GLIBC_TUNABLES``), None for glibc's own; for status."""
    if not _applies():
        return None
    for item in os.environ.get(ENV, "").split(":"):
        name, _, value = item.partition("=")
        if name == TUNABLE:
            try:
                return int(value, 0)
            except ValueError:
                return None
    return None


def _applies() -> bool:
    """glibc on x86-64: the only place the tunable exists."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))  # musl has no such name
    except (ValueError, OSError):
        return False


def reexec_with_threshold(threshold: int, stop_signals: tuple[signal.Signals, ...], stopped: object) -> None:
    """Re-execute this process with ``threshold`` in ``GLIBC_TUNABLES``; returns only when it did not.

    Main thread, before the committer makes anything. Nothing happens for a threshold of 0, an image that
    is the re-executed one, a ``GLIBC_TUNABLES`` that names the tunable, a platform other than glibc on
    x86-64, or an interpreter path Python does not know. ``stop_signals`` are blocked from before
    ``stopped.reason`` (``EarlyStop``) is read until the exec: a stop signal that arrives meanwhile stays
    pending through the exec, and the new image's ``EarlyStop`` takes it once installed (it unblocks
    them), so it stops that image as it would have stopped this one. An exec that fails leaves this
    process as it was, with glibc's threshold.
    """
    if os.environ.pop(_EXECED, None) is not None or not threshold or not _applies() or not sys.executable:
        return
    tunables = with_threshold(os.environ.get(ENV, ""), threshold)
    argv = getattr(sys, "orig_argv", None)
    if tunables is None or not argv:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        if getattr(stopped, "reason", ""):
            return  # stopped already: this image stops, as usual
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os.execve(sys.executable, argv, {**os.environ, ENV: tunables, _EXECED: "1"})
    except OSError as exc:
        print(f"omnishm committer: could not re-execute with {TUNABLE}={threshold} ({exc}); "
              f"the pool writes keep glibc's threshold", file=sys.stderr)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)


__all__ = ["DEFAULT_BYTES", "MIN_BYTES", "TUNABLE", "check_threshold", "reexec_with_threshold",
           "threshold_in_effect", "with_threshold"]
