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
interpreter (same pid, same command line) with the threshold added to ``GLIBC_TUNABLES``, right after its
options are parsed and before it makes anything: no lock, socket, segment or thread exists yet. Only a
command line that starts the committer and nothing else is run again (``python -m omnishm.committer``,
``python -m omnishm committer``, ``omnishm committer``: the launcher script and autostart use the first);
a committer started any other way, or with a ``--config`` that is not a regular file, keeps glibc's. The
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
import stat
import sys

TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
ENV = "GLIBC_TUNABLES"
MIN_BYTES = 0x4040
"""glibc's lower bound for the threshold (16448 bytes): a smaller one is ignored without a word."""
MAX_BYTES = (1 << 60) - 1
"""glibc's upper bound (``SIZE_MAX >> 4``): a larger one is ignored without a word too."""
DEFAULT_BYTES = 64 << 10
"""The committer's long runs (``apply.RUN_BYTES``): each goes by one copy, with non-temporal stores."""
_EXECED = "OMNISHM_COMMITTER_REEXECED"
"""Set in the re-executed image: never a second exec, whatever glibc made of ``GLIBC_TUNABLES``."""


def check_threshold(value: int) -> int:
    """The ``nontemporal_threshold`` knob's check: 0 (glibc's own), or within glibc's bounds. Raises ValueError."""
    if 0 < value < MIN_BYTES:
        raise ValueError(f"glibc ignores a threshold under {MIN_BYTES} bytes; use 0 to keep glibc's own")
    if value > MAX_BYTES:
        raise ValueError(f"glibc ignores a threshold over {MAX_BYTES:#x} bytes; use 0 to keep glibc's own")
    return value


def with_threshold(tunables: str, threshold: int) -> str | None:
    """``tunables`` (a ``GLIBC_TUNABLES`` value) with ``TUNABLE=threshold`` added; None when it names
    ``TUNABLE`` already (the operator's value is kept)."""
    items = [item for item in tunables.split(":") if item]
    if any(item.split("=", 1)[0] == TUNABLE for item in items):
        return None
    return ":".join([*items, f"{TUNABLE}={threshold}"])


def threshold_in_effect() -> int | None:
    """The threshold this process was started with (``GLIBC_TUNABLES``), None for glibc's own (also for a
    value glibc ignores, which an operator's ``GLIBC_TUNABLES`` may hold); for status."""
    if not _applies():
        return None
    for item in os.environ.get(ENV, "").split(":"):
        name, _, value = item.partition("=")
        if name == TUNABLE:
            try:
                threshold = int(value, 0)
            except ValueError:
                return None
            return threshold if MIN_BYTES <= threshold <= MAX_BYTES else None
    return None


def _applies() -> bool:
    """glibc on x86-64: the only place the tunable exists."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))  # musl has no such name
    except (ValueError, OSError):
        return False


def is_entry_point(argv: list[str]) -> bool:
    """Whether ``argv`` (``sys.orig_argv``) runs the committer and nothing else: ``python [options] -m
    omnishm.committer ...``, ``-m omnishm committer ...``, or the ``omnishm`` script with ``committer``.

    Only such a command line is executed again. Any other (``-c`` code, a program read from stdin, a
    ``multiprocessing`` child, a script of one's own) may do more than start the committer, and doing
    it twice, or once more without what it was handed (stdin, an inherited descriptor), is not ours to do.
    """
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "-" or not word.startswith("-"):  # stdin, or a script: only the omnishm console script
            return os.path.basename(word) == "omnishm" and argv[i + 1:i + 2] == ["committer"]
        i += 1
        if word.startswith("--"):  # the one long option that takes a value
            i += word == "--check-hash-based-pycs"
            continue
        for k, flag in enumerate(word[1:], 2):  # a group of short options, as in -IEm
            if flag in "cmWX":  # takes a value: the rest of the word, else the next word
                value = word[k:] or (argv[i] if i < len(argv) else "")
                i += not word[k:]
                if flag == "c":
                    return False
                if flag == "m":
                    rest = argv[i:i + 1]
                    return value == "omnishm.committer" or (value == "omnishm" and rest == ["committer"])
                break
    return False


def reexec_with_threshold(threshold: int, stop_signals: tuple[signal.Signals, ...], stopped: object,
                          config_file: str | None = None) -> None:
    """Re-execute this process with ``threshold`` in ``GLIBC_TUNABLES``; returns only when it did not.

    Main thread, before the committer makes anything. Nothing happens for a threshold of 0, an image that
    is the re-executed one, a ``GLIBC_TUNABLES`` that names the tunable, a platform other than glibc on
    x86-64, an interpreter path Python does not know, a command line that is not the committer's own
    (``is_entry_point``), or a ``config_file`` that is not a regular file: the new image reads its options
    again, and a pipe (``--config <(...)``) is empty the second time. ``stop_signals`` are blocked from before
    ``stopped.reason`` (``EarlyStop``) is read until the exec: a stop signal that arrives meanwhile stays
    pending through the exec, and the new image's ``EarlyStop`` takes it once installed (it unblocks
    them), so it stops that image as it would have stopped this one. An exec that fails leaves this
    process as it was, with glibc's threshold.
    """
    if os.environ.pop(_EXECED, None) is not None or not threshold or not _applies() or not sys.executable:
        return
    tunables = with_threshold(os.environ.get(ENV, ""), threshold)
    argv = getattr(sys, "orig_argv", None)
    if tunables is None or not argv or not is_entry_point(argv):
        return
    if config_file:
        try:
            if not stat.S_ISREG(os.stat(config_file).st_mode):
                return
        except OSError:
            return  # the options were read already: what went wrong is not ours to report
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


__all__ = ["DEFAULT_BYTES", "MAX_BYTES", "MIN_BYTES", "TUNABLE", "check_threshold", "is_entry_point",
           "reexec_with_threshold", "threshold_in_effect", "with_threshold"]
