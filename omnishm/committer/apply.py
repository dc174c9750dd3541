"""Applying a ``StepWrite`` to the pool: validation, then the row copies and the commit.

``StepApply`` is a mixin of ``CachePool`` and works on its key states and
staging segments; it creates no segment. Single-threaded: only the
committer's server loop calls it.

Write path (``apply_step``), all vectorised over the packed int64 buffers of a
``StepWrite``: per-row claim versions and staging rows come from ``np.repeat``;
a row lands only where the claim table still holds its claim version (a slot
reclaimed by a newer write is skipped) and the commit table does not hold it yet (a row committed under
a version is never written again under it: a reader that checked commit == claim == its version after
its copy could not see such a rewrite); rows are copied as maximal runs of
consecutive slots and staging rows with one slice assignment each (memcpy
speed, LIMITS.md), the scattered leftovers with one fancy-indexed assignment.
Copies go through numpy byte views of the pool and staging rows: a numpy slice
assignment costs ~0.3 us against ~5 us for a torch slice ``copy_``, and a
fancy-indexed row scatter runs at memcpy speed for small batches where
``index_copy_`` on bf16 rows was 8x slower (measured, ``omnishm bench``).
The commit table is written after every row of that key has landed, so a
reader that sees ``commit == claim`` sees the row.

Validation is a fast pass of one reduction per rule (negative int64s are huge
as uint64, so one ``max`` checks both bounds); only when it trips does the
detailed pass run, to name the first offending entry in the error.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from omnishm import protocol
from omnishm.versions import MAX_STEP, cv_epoch

if TYPE_CHECKING:
    from omnishm.committer.pool import KeyState, Staging

RUN_BYTES = 64 << 10
"""A run of consecutive rows of at least this many bytes (and 2 rows) goes by one slice assignment.

Measured (2 vCPU, 8 KiB rows): a numpy fancy-indexed row scatter runs at 0.8-0.9 of
memcpy, a slice assignment at memcpy speed plus ~1 us of Python per run, so runs
below ~64 KiB are cheaper inside the single scatter."""

GATHER_BYTES = 4 << 20
"""Rows gathered by one ``np.take`` into a key's gather buffer (at least one row): the bound of that buffer."""


class StepRejected(Exception):
    """A StepWrite that failed validation; nothing was applied."""


_max = np.maximum.reduce  # the ufunc itself: ndarray.max() adds two Python frames per call
_min = np.minimum.reduce
_and = np.logical_and.reduce
_I8 = np.dtype("<i8")  # dtype objects, not strings: a string is parsed again at every call (~0.5 us)
_U8 = np.dtype("<u8")
_MAX_I8 = (1 << 63) - 1
_LITTLE_ENDIAN = sys.byteorder == "little"
"""The fast path compares computed int64s with the wire's little-endian bytes; elsewhere it stands aside."""


def _of_epoch(cvs: np.ndarray, epoch: int) -> bool:
    """Every claim version is positive and of ``epoch``: two reductions, whatever the number of entries."""
    lo = int(_min(cvs))
    return lo > 0 and cv_epoch(lo) == epoch == cv_epoch(int(_max(cvs)))


def _ints(buf: bytes, what: str, step: int) -> np.ndarray:
    if len(buf) % 8:
        raise StepRejected(f"step {step}: {what} buffer has {len(buf)} bytes, not a multiple of 8")
    return np.frombuffer(buf, dtype="<i8")


class StepApply:
    """``validate_step`` and ``apply_step`` of ``CachePool`` (mixin; the state lives in the pool)."""

    def validate_step(self, client_id: str, msg: protocol.StepWrite, epoch: int):
        """Decode and bounds-check every buffer of ``msg``; raises StepRejected naming the bad value.

        Every claim version must be of ``epoch``, the sending writer's: a version of another epoch is
        another writer's claim, and applying it would change a committed row under a version a reader
        already planned on (commit, claim and version would all still agree).
        """
        step = msg.step
        tids = _ints(msg.tids, "tids", step)
        key_idx = _ints(msg.key_idx, "key_idx", step)
        cvs = _ints(msg.cvs, "cvs", step)
        src_rows = _ints(msg.src_rows, "src_rows", step)
        counts = _ints(msg.counts, "counts", step)
        slots = _ints(msg.slots, "slots", step)
        n = len(tids)
        if not len(key_idx) == len(cvs) == len(src_rows) == len(counts) == n:
            for what, arr in (("key_idx", key_idx), ("cvs", cvs), ("src_rows", src_rows), ("counts", counts)):
                if len(arr) != n:
                    raise StepRejected(f"step {step}: {what} has {len(arr)} entries, tids has {n}")
        if len(set(msg.keys)) != len(msg.keys):
            # Each name's rows are bounded by its staging below; a name listed N times would copy N
            # stagings' worth of rows (4096 names: 256 GiB in one apply, 28 s of a committer answering
            # nobody, review 2026-12-06), and commit one slot again under a version already committed.
            seen: set[str] = set()
            twice = next(k for k in msg.keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise StepRejected(f"step {step}: key {protocol.shown(twice, 70)} is listed twice (each key once per step)")
        states: list[KeyState] = []
        for key in msg.keys:
            state = self.keys.get(key)
            if state is None:
                raise StepRejected(f"step {step}: unknown key {protocol.shown(key, 70)} (open it with OpenKey first)")
            if client_id not in state.staging:
                raise StepRejected(f"step {step}: key {protocol.shown(key, 70)} has no staging segment for this writer")
            states.append(state)
        if n == 0:
            if len(slots):
                raise StepRejected(f"step {step}: {len(slots)} slots but no entries")
            return tids, key_idx, cvs, src_rows, counts, slots, states

        def first_bad(bad: np.ndarray, what: str, values: np.ndarray) -> None:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise StepRejected(f"step {step}: entry {i} (tid {int(tids[i])}) has {what} {int(values[i])}")

        # Fast pass: one reduction per rule; the detailed pass names the first offender.
        # A count above the slots sent is refused before the sum: such counts can wrap int64 to the slots' number.
        if (int(_max(key_idx.view(np.uint64))) >= len(states) or int(_max(counts.view(np.uint64))) > len(slots)
                or int(_min(cvs)) <= 0):
            first_bad((key_idx < 0) | (key_idx >= len(states)), f"key_idx out of 0..{len(states) - 1}:", key_idx)
            first_bad(counts < 0, "negative count", counts)
            first_bad(counts > len(slots), f"count above the {len(slots)} slots sent:", counts)
            first_bad(cvs <= 0, "claim version <= 0:", cvs)
        if not _of_epoch(cvs, epoch):
            first_bad(cv_epoch(cvs) != epoch, f"a claim version of another epoch than this writer's {epoch}:", cvs)
        total = int(counts.sum())
        if total != len(slots):
            raise StepRejected(f"step {step}: counts sum to {total} rows but {len(slots)} slots were sent")
        num_slots = self.num_slots
        if total and int(_max(slots.view(np.uint64))) >= num_slots:
            bad = (slots < 0) | (slots >= num_slots)
            r = int(np.flatnonzero(bad)[0])
            e = int(np.searchsorted(np.cumsum(counts), r, side="right"))
            raise StepRejected(f"step {step}: key {states[int(key_idx[e])].name!r} entry {e} (tid {int(tids[e])}) "
                               f"slot {int(slots[r])} out of range 0..{num_slots - 1}")
        # A staged row goes to one slot, so no key's rows outnumber its staging rows (the manager's steps and
        # the flusher's pieces both stage each row once). Without this bound, entries repeating one staging
        # row multiplied the copy and the gather buffer of a step without limit: a 10,000-entry step asked
        # for 39 GiB and failed half-applied (review, 2026-12-05).
        key_rows = [total] if len(states) == 1 else np.bincount(key_idx, weights=counts, minlength=len(states))
        for state, rows in zip(states, key_rows):
            if int(rows) > state.staging[client_id].rows:
                raise StepRejected(f"step {step}: key {state.name!r} writes {int(rows)} rows, more than its "
                                   f"{state.staging[client_id].rows} staging rows (a staged row goes to one slot)")
        if len(states) == 1:
            limit = states[0].staging[client_id].rows
            # src_rows > limit - counts, not src_rows + counts > limit: the sum can wrap around int64.
            ok = int(_min(src_rows)) >= 0 and not bool((src_rows > limit - counts).any())
            limits: np.ndarray | int = limit
        else:
            limits = np.array([s.staging[client_id].rows for s in states], dtype=np.int64)[key_idx]
            ok = not bool(((src_rows < 0) | (src_rows > limits - counts)).any())
        if not ok:
            limits = np.broadcast_to(np.asarray(limits, dtype=np.int64), (n,))
            bad = (src_rows < 0) | (src_rows > limits - counts)
            e = int(np.flatnonzero(bad)[0])
            raise StepRejected(f"step {step}: key {states[int(key_idx[e])].name!r} entry {e} (tid {int(tids[e])}) "
                               f"staging rows {int(src_rows[e])}..{int(src_rows[e]) + int(counts[e])} "
                               f"outside 0..{int(limits[e])}")
        return tids, key_idx, cvs, src_rows, counts, slots, states

    def apply_step(self, client_id: str, msg: protocol.StepWrite, epoch: int) -> protocol.StepDone:
        """Validate, then apply ``msg`` from the writer ``client_id`` of ``epoch``; never raises on bad input."""
        t0 = time.perf_counter()
        try:
            if not 0 <= msg.step <= MAX_STEP:  # no writer issues it: its claims could not name it, nor its ack
                raise StepRejected(f"step id {msg.step} is outside 0..{MAX_STEP}")
            if msg.keys:
                done = self._apply_repeated(client_id, msg, t0, epoch)
                if done is not None:
                    return done
            tids, key_idx, cvs, src_rows, counts, slots, states = self.validate_step(client_id, msg, epoch)
        except StepRejected as exc:
            self.steps_failed += 1
            reply, failed = failed_step(msg, str(exc))
            self.tids_failed += failed
            return reply
        written = skipped = 0
        total = len(slots)
        if total:
            # Per-row staging row and claim version, without per-entry Python: entry i's rows
            # are src_rows[i] + 0..counts[i]-1, i.e. arange(total) shifted by src_rows[i] - offset[i].
            offset = np.cumsum(counts)
            offset -= counts
            shift = src_rows - offset
            if len(states) == 1 and int(_min(shift)) == int(_max(shift)):
                # Staged in entry order (what the manager sends): the rows are one range, no per-row array.
                row_src = np.arange(int(shift[0]), int(shift[0]) + total, dtype=np.int64)
            else:
                row_src = np.repeat(shift, counts)
                row_src += np.arange(total, dtype=np.int64)
            row_cv = np.repeat(cvs, counts)
            row_key = np.repeat(key_idx, counts) if len(states) > 1 else None
            for j, state in enumerate(states):
                if row_key is None:
                    s, r, cv = slots, row_src, row_cv
                else:
                    sel = row_key == j
                    if not sel.any():
                        continue
                    s, r, cv = slots[sel], row_src[sel], row_cv[sel]
                ok = state.claim[s] == cv
                ok &= state.commit[s] != cv
                n_ok = int(np.count_nonzero(ok))
                if n_ok != len(s):
                    state.rows_skipped += len(s) - n_ok
                    skipped += len(s) - n_ok
                    s, r, cv = s[ok], r[ok], cv[ok]
                if not n_ok:
                    continue
                _copy_rows(state, state.staging[client_id], s, r)
                state.commit[s] = cv  # after the rows: a reader seeing commit == claim sees the row
                state.rows_written += n_ok
                state.bytes_written += n_ok * state.row_bytes
                written += n_ok
        self.steps_applied += 1
        self.rows_skipped += skipped
        self.apply_seconds += time.perf_counter() - t0
        return protocol.StepDone(rid=msg.rid, step=msg.step, done_tids=_unique_tids(tids, len(states)),
                                 rows_written=written, rows_skipped=skipped)

    def _apply_repeated(self, client_id: str, msg: protocol.StepWrite, t0: float, epoch: int
                        ) -> protocol.StepDone | None:
        """The per-step fast path: what the manager sends, rows staged in entry order.

        The manager lists each key's writes in batch order with the same
        fields, so every packed buffer is one key's part repeated once per key
        (``key_idx`` is 0..., 1..., ...); that is checked by byte comparison,
        not assumed. Accepts only steps that ``validate_step`` accepts too, and
        applies them exactly as the general path does; anything else (bad input
        included) returns None and takes the general path, which names the
        offender. Every check is a bytes comparison or one reduction over one
        key's part: ~10 numpy calls per step, plus ~5 per key, whatever the
        number of entries.
        """
        if not _LITTLE_ENDIAN:
            return None
        nk = len(msg.keys)
        if nk > 1 and len(set(msg.keys)) != nk:  # a name listed twice: the general path refuses it
            return None
        states = []
        stagings = []
        for key in msg.keys:
            state = self.keys.get(key)
            staging = state.staging.get(client_id) if state is not None else None
            if staging is None:
                return None
            states.append(state)
            stagings.append(staging)
        nb = len(msg.tids)
        if (nb == 0 or nb % (8 * nk) or len(msg.slots) % (8 * nk) or len(msg.cvs) != nb
                or len(msg.src_rows) != nb or len(msg.counts) != nb or len(msg.key_idx) != nb):
            return None
        per = nb // nk
        per_slots = len(msg.slots) // nk
        one_tids, one_cvs = msg.tids[:per], msg.cvs[:per]
        one_src, one_counts = msg.src_rows[:per], msg.counts[:per]
        one_slots = msg.slots[:per_slots]
        if nk == 1:
            if msg.key_idx.count(0) != nb:  # every key_idx is 0: all its bytes are zero
                return None
        elif (msg.tids != one_tids * nk or msg.cvs != one_cvs * nk or msg.src_rows != one_src * nk
              or msg.counts != one_counts * nk or msg.slots != one_slots * nk
              or msg.key_idx != b"".join(k.to_bytes(8, "little") * (per // 8) for k in range(nk))):
            return None
        cvs = np.frombuffer(one_cvs, dtype=_I8)
        counts = np.frombuffer(one_counts, dtype=_I8)
        src_rows = np.frombuffer(one_src, dtype=_I8)
        slots = np.frombuffer(one_slots, dtype=_I8)
        total = len(slots)
        rows = stagings[0].rows if nk == 1 else min(staging.rows for staging in stagings)
        r0 = src_rows.item(0)
        # 0 <= counts <= total (negative counts are huge as uint64) also rules out int64 overflow below.
        if int(_max(counts.view(_U8))) > total or not _of_epoch(cvs, epoch) or not 0 <= r0 <= rows:
            return None
        ends = src_rows + counts
        r1 = ends.item(-1)
        # Staged in entry order: entry i+1 starts where entry i ends, so the step's rows are r0..r1
        # (which bounds every entry's rows) and the counts sum to r1 - r0. Compared as bytes: one
        # memcmp instead of two slices, a comparison and a reduction.
        n1 = per // 8
        if r1 > rows or r1 - r0 != total or (n1 > 1 and ends[:-1].tobytes() != one_src[8:]):
            return None
        if total and int(_max(slots.view(_U8))) >= self.num_slots:
            return None
        tids = np.frombuffer(one_tids, dtype=_I8)
        written = skipped = 0
        if total:
            row_cv = cvs.repeat(counts)
            row_src: np.ndarray | None = None
            for state, staging in zip(states, stagings):
                ok = state.claim[slots] == row_cv
                ok &= state.commit[slots] != row_cv
                n_ok = int(np.count_nonzero(ok))
                if n_ok == total:
                    if total < state.min_run:  # no run long enough for its own slice: one scatter
                        state.rows_v[slots] = staging.rows_v[r0:r1]
                    else:
                        if row_src is None:
                            row_src = np.arange(r0, r1, dtype=np.int64)
                        _copy_rows(state, staging, slots, row_src)
                    state.commit[slots] = row_cv  # after the rows: a reader seeing commit == claim sees the row
                elif n_ok:
                    s = slots[ok]
                    _copy_rows(state, staging, s, np.arange(r0, r1, dtype=np.int64)[ok])
                    state.commit[s] = row_cv[ok]
                if total - n_ok:
                    state.rows_skipped += total - n_ok
                    skipped += total - n_ok
                state.rows_written += n_ok
                state.bytes_written += n_ok * state.row_bytes
                written += n_ok
            self.rows_skipped += skipped
        # Distinct tids: increasing tids (the manager's order) are already their own sorted set.
        done = one_tids if n1 == 1 or _increasing(tids, one_tids) else _unique_tids(tids, 1)
        self.steps_applied += 1
        self.apply_seconds += time.perf_counter() - t0
        return protocol.StepDone(rid=msg.rid, step=msg.step, done_tids=done, rows_written=written,
                                 rows_skipped=skipped)

    # ------------------------------------------------------------ status and teardown


def _increasing(tids: np.ndarray, packed: bytes) -> bool:
    """Whether ``tids`` (``packed`` as bytes) strictly increase. The manager numbers a step's writes from
    one counter, so they are consecutive: that is one bytes comparison with the run they would be."""
    first, n = tids.item(0), len(tids)
    if 0 <= first <= _MAX_I8 - n and np.arange(first, first + n, dtype=_I8).tobytes() == packed:
        return True
    return bool(_and(tids[1:] > tids[:-1]))


FAILED_TIDS_LISTED = 1 << 17
"""A refused step lists its failed tids up to this many (1 MiB); past it the reply's reason alone says every
tid failed: a list of 8 M tids made a reply over ``protocol.MAX_MESSAGE_BYTES``, which the client's socket
drops, so the refusal never reached the writer (review, stop 56)."""


def failed_step(msg: protocol.StepWrite, why: str) -> tuple[protocol.StepDone, int]:
    """The reply refusing every tid of ``msg`` for ``why``, and how many tids it fails (distinct ones where
    they are listed; all of the message's past ``FAILED_TIDS_LISTED``, with no sort)."""
    count = len(msg.tids) // 8
    if count > FAILED_TIDS_LISTED:
        return protocol.StepDone(rid=msg.rid, step=msg.step, done_tids=b"", failed_tids=b"",
                                 reason=f"all {count} tids of step {msg.step} failed: {why}"), count
    failed = np.unique(np.frombuffer(msg.tids[:count * 8], dtype="<i8"))
    return protocol.StepDone(rid=msg.rid, step=msg.step, done_tids=b"", failed_tids=failed.astype("<i8").tobytes(),
                             reason=why), len(failed)


def _unique_tids(tids: np.ndarray, num_keys: int) -> bytes:
    """Sorted distinct tids as packed int64 (what ``np.unique`` gives, without its ~9 us sort).

    The manager sends each key's entries in batch order with increasing tids, so the
    packed tids are one increasing run repeated once per key: that is checked, not assumed.
    """
    n = len(tids)
    if n <= 1 or bool((tids[1:] > tids[:-1]).all()):
        return tids.astype("<i8", copy=False).tobytes()
    if num_keys > 1 and n % num_keys == 0:
        per = tids.reshape(num_keys, -1)
        first = per[0]
        if bool((per == first).all()) and (len(first) <= 1 or bool((first[1:] > first[:-1]).all())):
            return first.astype("<i8", copy=False).tobytes()
    return np.unique(tids).astype("<i8").tobytes()


def _copy_rows(state: KeyState, staging: Staging, s: np.ndarray, r: np.ndarray) -> None:
    """pool[s[i]] = stage[r[i]] for all i: long runs by one slice assignment each, the rest by one scatter.

    Works on the uint8 row views (``KeyState.data``, ``Staging.data``), so each call is a
    memcpy without torch dispatch. A slot listed twice in one step under one claim version gets
    one of its rows, which one is not specified: the manager refuses a layout that names a slot
    twice (``_check_slots``), and every candidate is a row the writer staged for that slot.
    """
    dst, src = state.data, staging.data
    assert dst is not None and src is not None
    m = len(s)
    if m == 0:
        return
    if m == 1:
        dst[int(s[0])] = src[int(r[0])]
        return
    if m < state.min_run:  # no run can be long enough: straight to the scatter
        _scatter(state, dst, src, s, r)
        return
    brk = np.flatnonzero((s[1:] - s[:-1] != 1) | (r[1:] - r[:-1] != 1))
    if len(brk) == 0:  # one run: the common case of a contiguous step
        s0, r0 = int(s[0]), int(r[0])
        dst[s0:s0 + m] = src[r0:r0 + m]
        return
    brk += 1
    run_start = np.concatenate(([0], brk))
    lengths = np.diff(np.concatenate((run_start, [m])))
    long = lengths >= state.min_run
    # One iteration per long run (RUN_BYTES or more), never per row.
    for s0, r0, length in zip(s[run_start[long]].tolist(), r[run_start[long]].tolist(), lengths[long].tolist()):
        dst[s0:s0 + length] = src[r0:r0 + length]
    if not long.all():
        short = np.repeat(~long, lengths)
        _scatter(state, dst, src, s[short], r[short])


def _scatter(state: KeyState, dst: np.ndarray, src: np.ndarray, s: np.ndarray, r: np.ndarray) -> None:
    """dst[s] = src[r] by one fancy-indexed assignment (no gather when ``r`` is one run)."""
    m = len(r)
    r0 = int(r[0])
    if int(r[-1]) - r0 == m - 1 and (m == 1 or bool((r[1:] - r[:-1] == 1).all())):
        dst[s] = src[r0:r0 + m]  # staged in order (the usual case)
    else:
        # mode="clip": with the default "raise", numpy's take copies ``out`` in and back out around the gather
        # (so that a bad index leaves it unchanged), two more copies of every row: 734 against 390 us for
        # 256 rows of 8 KiB (2026-12-05), and worse with non-temporal stores (``stores``), which send those
        # copies to memory and read them back. ``validate_step`` bounded every staging row already.
        # In pieces of GATHER_BYTES: the buffer is the committer's private memory and is kept for the next
        # gather, so its size must not follow the largest step ever gathered.
        for lo in range(0, m, state.gather_rows):
            hi = min(m, lo + state.gather_rows)
            dst[s[lo:hi]] = np.take(src, r[lo:hi], axis=0, out=state.gather_buffer(hi - lo), mode="clip")
