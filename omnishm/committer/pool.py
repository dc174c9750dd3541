"""The cache a committer owns: control segment, per-key pool/claim/commit
segments, per-writer staging segments, their metadata and adoption after a
restart. Applying ``StepWrite``s is ``omnishm.committer.apply`` (a mixin).

Single-threaded: only the committer's server loop calls into a ``CachePool``.
Every segment here is created (and at ``close`` unlinked) by this process.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from omnishm import liveness, protocol, shm
from omnishm.committer import meta
from omnishm.committer.apply import GATHER_BYTES, RUN_BYTES, StepApply
# The client refuses a config past these before it attaches (``PrefixCacheConfig``); the committer, any client.
from omnishm.interface import MAX_SLOTS, MAX_STAGING_ROWS

logger = logging.getLogger(__name__)

MAX_KEY_NAME = 200
"""Characters in a key name (the names go into the metadata, which must fit one slot)."""
MAX_KEYS = 64
"""Key names a cache knows (declared in layouts or opened); a model emits a handful."""
MAX_WIDTH = 1 << 24
MAX_ROW_DIMS = 63
"""A row shape's dims at most: torch's 64 dims of a tensor, less the token dim."""


class WriterRecord(NamedTuple):
    """What a restart needs of a welcomed writer (``CachePool.writers``, saved in the metadata)."""

    epoch: int
    staging_rows: int
    """The rows of its staging segment for each key (``ensure_staging`` makes one per key)."""
    pid: int = 0
    started: str | None = None
    """The process it said Hello from, where confirmed (``attach.confirmed_start``): after a restart another
    live process cannot take its seat by naming its client id (review, stop 56). 0 and None: not known."""


def shape_text(shape: tuple[int, ...]) -> str:
    """A row shape for a message. A client's shape is echoed in replies and logs, so one longer than any
    key may have is cut."""
    if len(shape) <= MAX_ROW_DIMS:
        return str(tuple(shape))
    return f"({', '.join(map(str, shape[:4]))}, ... {len(shape)} dims)"


class PoolError(Exception):
    """A request the pool refuses; ``code`` goes into the ``Error`` reply."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Staging:
    segment: shm.Segment
    rows: int
    data: np.ndarray
    """uint8[rows, row_bytes] view of ``segment`` (the copy engine's source)."""
    rows_v: np.ndarray | None = None
    """The same rows as one opaque item each (``_void_rows``)."""

    def __post_init__(self) -> None:
        if self.rows_v is None:
            self.rows_v = _void_rows(self.data)

    @classmethod
    def map(cls, segment: shm.Segment, rows: int, row_bytes: int) -> "Staging":
        """The staging of ``rows`` rows of ``row_bytes`` bytes in ``segment`` (made, or adopted)."""
        return cls(segment, rows, _byte_rows(segment, rows, row_bytes))


@dataclass
class KeyState:
    index: int
    name: str
    dtype_name: str
    """A ``protocol.DTYPE_ITEMSIZE`` name: rows are bytes here, and only the clients see them as tensors."""
    width: int
    row_shape: tuple[int, ...]
    """The dims of one row (their product is ``width``), the same for every row of the key: fixed by its
    first ``OpenKey``; a later one naming another is refused, so no row is read back in another shape."""
    pool_seg: shm.Segment
    claim_seg: shm.Segment
    commit_seg: shm.Segment
    claim: np.ndarray
    commit: np.ndarray
    row_bytes: int
    staging: dict[str, Staging] = field(default_factory=dict)
    scratch: np.ndarray | None = None
    rows_written: int = 0
    bytes_written: int = 0
    rows_skipped: int = 0
    data: np.ndarray | None = None
    """uint8[num_slots, row_bytes] view of ``pool_seg`` (the copy engine's target)."""
    min_run: int = 2
    """Shortest run (rows) copied by its own slice assignment: RUN_BYTES worth, at least 2."""
    gather_rows: int = 1
    """Rows gathered at once into the gather buffer (``_scatter``): GATHER_BYTES worth, at least 1."""

    rows_v: np.ndarray | None = None
    """The same rows as one opaque item each (``_void_rows``)."""

    @property
    def spec(self) -> protocol.KeySpec:
        """The key's geometry as the protocol names it."""
        return protocol.KeySpec(self.dtype_name, self.width, self.row_shape)

    def __post_init__(self) -> None:
        if self.data is None:
            self.data = _byte_rows(self.pool_seg, len(self.claim), self.row_bytes)
        if self.rows_v is None:
            self.rows_v = _void_rows(self.data)
        self.min_run = int(max(2, -(-RUN_BYTES // max(self.row_bytes, 1))))
        self.gather_rows = max(1, GATHER_BYTES // max(self.row_bytes, 1))

    def gather_buffer(self, rows: int) -> np.ndarray:
        """Preallocated gather target (an allocating gather pays page faults on every call). ``_scatter``
        asks for at most ``gather_rows``, and so the buffer stays that small."""
        if self.scratch is None or self.scratch.shape[0] < rows:
            self.scratch = np.empty((max(rows, min(64, self.gather_rows)), self.row_bytes), dtype=np.uint8)
        return self.scratch[:rows]


def _byte_rows(seg: shm.Segment, rows: int, row_bytes: int) -> np.ndarray:
    """uint8[rows, row_bytes] view of ``seg``: rows as bytes, whatever their dtype (numpy has no bf16, trap 8)."""
    return seg.array(np.uint8, (rows, row_bytes))


def _void_rows(rows: np.ndarray) -> np.ndarray:
    """1-D view of a C-contiguous uint8[rows, row_bytes] array, one ``V{row_bytes}`` item per row.

    A fancy-indexed row scatter on it is one item copy per row: ~0.4 us for 128 rows of
    16 B against ~2 us for the same scatter on the 2-D uint8 view (measured here).
    """
    return rows.view(np.dtype((np.void, rows.shape[1]))).reshape(rows.shape[0])


class CachePool(StepApply):
    """Segments and write pipeline of one named cache (one generation)."""

    def __init__(self, name: str, generation: str, *, prefault: bool = False):
        self.name = name
        self.generation = generation
        self.prefault = prefault
        self.layout: protocol.Layout | None = None
        self.key_specs: dict[str, protocol.KeySpec] = {}
        self.keys: dict[str, KeyState] = {}
        self.ctl_seg: shm.Segment | None = None
        self.ctl: np.ndarray | None = None
        self.steps_applied = 0
        self.steps_failed = 0
        self.tids_failed = 0
        self.rows_skipped = 0
        self.apply_seconds = 0.0
        self.prefault_seconds = 0.0
        self.meta_seq = 0
        self.max_epoch = 0
        self.writers: dict[str, WriterRecord] = {}
        """Every writer that was welcomed and not dropped (what a restart adopts)."""
        self.adopted = False

    # ------------------------------------------------------------ layout

    def _seg(self, what: str) -> str:
        return shm.segment_name(self.name, self.generation, what)

    def _create(self, what: str, size: int) -> shm.Segment:
        seg = shm.Segment.create(self._seg(what), size)
        if self.prefault:
            self.prefault_seconds += seg.prefault()
        return seg

    @property
    def num_slots(self) -> int:
        return 0 if self.layout is None else self.layout.num_blocks * self.layout.block_size

    def layout_mismatch(self, layout: protocol.Layout) -> str | None:
        """Why ``layout`` cannot attach to this cache, or None when it matches."""
        if self.layout is not None and (layout.num_blocks, layout.block_size) != (
                self.layout.num_blocks, self.layout.block_size):
            return (f"cache {self.name} has num_blocks={self.layout.num_blocks} block_size={self.layout.block_size}, "
                    f"client sent num_blocks={layout.num_blocks} block_size={layout.block_size}")
        for key, spec in layout.keys.items():
            mine = self.key_specs.get(key)
            why = self.spec_mismatch(key, mine, spec, "client sent") if mine is not None else None
            if why:
                return why
        return None

    def spec_mismatch(self, key: str, have: protocol.KeySpec, want: protocol.KeySpec, who: str) -> str | None:
        """Why rows of ``want`` cannot be this cache's rows of ``key`` (``have``), or None. A row shape of
        None on either side (not declared yet) matches any."""
        if (have.dtype, have.width) != (want.dtype, want.width):
            # A known dtype as it is; a client's other string cut, as every echoed input is (review, 2026-12-07:
            # a 1 MiB dtype came back whole, and one of 17 MB, repr'd to 68 MB, passed the client's size limit).
            dtype = want.dtype if want.dtype in protocol.DTYPE_ITEMSIZE else protocol.shown(want.dtype, 40)
            return f"cache {self.name} key {key!r} is {have.dtype}[{have.width}], {who} {dtype}[{want.width}]"
        if have.row_shape is not None and want.row_shape is not None and have.row_shape != want.row_shape:
            return (f"cache {self.name} key {key!r} holds rows of shape {shape_text(have.row_shape)}, {who} rows "
                    f"of shape {shape_text(want.row_shape)}")
        return None

    def set_layout(self, layout: protocol.Layout, *, declare: bool = True) -> None:
        """``fix_layout``, then ``declare_specs`` when ``declare``, saving the metadata; raises PoolError."""
        self.fix_layout(layout, room_for_specs=declare)
        if declare and self.declare_specs(layout):
            self.save_meta()

    def fix_layout(self, layout: protocol.Layout, *, room_for_specs: bool) -> None:
        """Check ``layout``; the first one becomes the cache's, with its control segment; raises PoolError.

        ``room_for_specs``: the layout's new key specs must fit the key limit (a writer's Hello, which
        declares them once it is welcomed: ``declare_specs``). A reader's are only checked
        (``layout_mismatch``, by the caller): the writer opens keys, and a reader's Hello fixed the
        spec, or used up the key limit, of keys the writer had not opened, after which the writer was
        refused for the life of the cache (review). Changes no key spec."""
        if layout.num_blocks <= 0 or layout.block_size <= 0:
            raise PoolError("bad_layout", f"num_blocks and block_size must be positive, got "
                                          f"{layout.num_blocks} and {layout.block_size}")
        if layout.num_blocks * layout.block_size > MAX_SLOTS:
            raise PoolError("bad_layout", f"num_blocks*block_size = {layout.num_blocks * layout.block_size} "
                                          f"exceeds {MAX_SLOTS} slots")
        for key, spec in layout.keys.items():
            self._check_spec(key, spec.dtype, spec.width, spec.row_shape)
        if room_for_specs:
            self._check_room(len(set(layout.keys) - set(self.key_specs)))
        elif len(layout.keys) > MAX_KEYS:  # more than any cache of this committer can hold
            raise PoolError("too_many_keys", f"a layout of {len(layout.keys)} key names passes the limit of {MAX_KEYS}")
        if self.layout is None:
            self.layout = protocol.Layout(layout.num_blocks, layout.block_size, {})
            # Control words, then the metadata a restarted committer adopts (committer/meta.py).
            self.ctl_seg = self._create("ctl", meta.CTL_BYTES)
            self.ctl = self.ctl_seg.array(np.int64, (protocol.CTL_WORDS,))
            self.ctl[:] = 0
            self.ctl[protocol.CTL_PUBLISHED_STEP] = -1
            self.ctl[protocol.CTL_COMMITTER_PID] = os.getpid()
        if self.meta_seq == 0:
            self.save_meta()

    def declare_specs(self, layout: protocol.Layout) -> list[str]:
        """The key specs of ``layout`` the cache lacks become its own (in memory; the caller saves the
        metadata); returns their names, for ``forget_specs``. Checked by ``fix_layout`` first."""
        new_specs = [k for k in layout.keys if k not in self.key_specs]
        for key in new_specs:
            self.key_specs[key] = layout.keys[key]
        return new_specs

    def forget_specs(self, keys: list[str]) -> None:
        """Take back specs ``declare_specs`` added whose metadata was never saved (a refused writer)."""
        for key in keys:
            if key not in self.keys:  # an opened key keeps its spec
                self.key_specs.pop(key, None)

    def current_layout(self) -> protocol.Layout:
        if self.layout is None:
            return protocol.Layout(0, 0, {})
        return protocol.Layout(self.layout.num_blocks, self.layout.block_size, dict(self.key_specs))

    def set_writer_epoch(self, epoch: int, client_id: str | None = None, staging_rows: int = 0, pid: int = 0,
                         started: str | None = None) -> bool:
        """Record the attached writer (epoch, staging rows and its process) for a restart, then publish its
        epoch (control word).

        Returns False, publishing nothing, when the metadata cannot be saved: an
        epoch a restart does not know could be handed out again, and the same
        claim versions with it, so the caller must refuse that writer.
        """
        assert self.ctl is not None
        previous_max = self.max_epoch
        self.max_epoch = max(self.max_epoch, epoch)
        record = WriterRecord(epoch, staging_rows, pid if started is not None else 0, started)
        if client_id is not None and self.writers.get(client_id) != record:
            before = self.writers.get(client_id)
            self.writers[client_id] = record
            if not self.save_meta():
                self.max_epoch = previous_max
                if before is None:
                    del self.writers[client_id]
                else:
                    self.writers[client_id] = before
                return False
        self.ctl[protocol.CTL_WRITER_EPOCH] = epoch
        return True

    def _check_room(self, new_keys: int) -> None:
        if new_keys and len(self.key_specs) + new_keys > MAX_KEYS:
            raise PoolError("too_many_keys", f"cache {self.name} knows {len(self.key_specs)} key names; "
                                             f"{new_keys} more would pass the limit of {MAX_KEYS}")

    @staticmethod
    def _check_spec(key: str, dtype: str, width: int, row_shape: tuple[int, ...] | None = None) -> None:
        # Bounded as the metadata writes it (JSON, ASCII-escaped: a non-ASCII or control character takes
        # 6 bytes or 12, so this bounds the characters too): MAX_KEYS names of the longest kind still fit
        # its slot (a review overflowed it with 64 names of 190 "é", and every writer's Hello was refused).
        if not isinstance(key, str) or not key or len(json.dumps(key)) - 2 > MAX_KEY_NAME:
            shown = key if not isinstance(key, str) or len(key) <= 60 else f"{key[:60]}... ({len(key)} characters)"
            raise PoolError("bad_key", f"key name must be a string of 1..{MAX_KEY_NAME} characters, at most "
                                       f"{MAX_KEY_NAME} bytes as JSON (a non-ASCII character takes 6), got {shown!r}")
        if dtype not in protocol.DTYPE_ITEMSIZE:
            raise PoolError("bad_dtype", f"key {key!r}: unknown dtype {protocol.shown(dtype, 40)} "
                                         f"(known: {', '.join(protocol.DTYPE_ITEMSIZE)})")
        if not 0 < width <= MAX_WIDTH:
            raise PoolError("bad_width", f"key {key!r}: width must be in 1..{MAX_WIDTH}, got {width}")
        if row_shape is not None and (len(row_shape) > MAX_ROW_DIMS or any(d < 1 for d in row_shape)
                                      or math.prod(row_shape) != width):
            raise PoolError("bad_row_shape", f"key {key!r}: row shape {shape_text(row_shape)} must have at most "
                                             f"{MAX_ROW_DIMS} dims of at least 1 whose product is the width {width}")

    # ------------------------------------------------------------ keys and staging

    def open_key(self, key: str, want: protocol.KeySpec) -> KeyState:
        """The key's state, creating pool/claim/commit on first open (``want.row_shape`` is concrete:
        ``OpenKey.spec``). Raises PoolError: ``layout_mismatch`` for a key whose rows have another dtype,
        width or shape."""
        if self.layout is None:
            raise PoolError("no_layout", f"cache {self.name} has no layout yet")
        dtype, width, shape = want.dtype, want.width, want.row_shape
        assert shape is not None
        state = self.keys.get(key)
        spec = state.spec if state is not None else self.key_specs.get(key)
        why = self.spec_mismatch(key, spec, want, "OpenKey asked for") if spec is not None else None
        if why:
            raise PoolError("layout_mismatch", why)
        if state is not None:
            return state
        self._check_spec(key, dtype, width, shape)
        self._check_room(0 if key in self.key_specs else 1)
        index = len(self.keys)
        row_bytes = width * protocol.DTYPE_ITEMSIZE[dtype]
        n = self.num_slots
        made: list[shm.Segment] = []
        try:
            pool_seg = self._create(f"pool.k{index}", n * row_bytes)
            made.append(pool_seg)
            claim_seg = self._create(f"claim.k{index}", n * 8)
            made.append(claim_seg)
            commit_seg = self._create(f"commit.k{index}", n * 8)
            made.append(commit_seg)
        except BaseException:
            for seg in made:
                seg.unlink()
            raise
        claim = claim_seg.array(np.int64, (n,))
        commit = commit_seg.array(np.int64, (n,))
        claim[:] = 0  # fallocate'd pages are zero already; explicit for the contract
        commit[:] = 0
        state = KeyState(index=index, name=key, dtype_name=dtype, width=width, row_shape=shape,
                         pool_seg=pool_seg, claim_seg=claim_seg, commit_seg=commit_seg, claim=claim, commit=commit,
                         row_bytes=row_bytes)
        declared = self.key_specs.get(key)
        self.keys[key] = state
        self.key_specs[key] = protocol.KeySpec(dtype, width, shape)
        if not self.save_meta():
            # Unrecorded segments are unlinked by an adoption while clients map them: a restarted committer
            # would open the key again on new ones and a reader keep the old (review, stop 59: by reading; the
            # limits keep the metadata under its slot). Refused now, nothing of it is kept or handed out.
            del self.keys[key]
            if declared is None:
                del self.key_specs[key]
            else:
                self.key_specs[key] = declared
            for seg in made:
                seg.unlink()
                seg.close()
            raise PoolError("meta", f"cache {self.name} cannot record key {key!r} in its metadata (see the "
                                    f"committer log); a restart could not adopt it")
        logger.info("cache %s: opened key %r %s rows of shape %s, %d slots, %.1f MiB pool", self.name, key, dtype,
                    shape, n, n * row_bytes / 2**20)
        return state

    def ensure_staging(self, client_id: str, state: KeyState, rows: int) -> Staging:
        staging = state.staging.get(client_id)
        if staging is None:
            if not 1 <= rows <= MAX_STAGING_ROWS:
                raise PoolError("bad_staging", f"staging_rows must be in 1..{MAX_STAGING_ROWS}, got {rows}")
            seg = self._create(self._staging_what(client_id, state.index), rows * state.row_bytes)
            try:
                staging = Staging.map(seg, rows, state.row_bytes)
            except BaseException:
                seg.unlink()  # recorded nowhere yet: nothing else would ever unlink it
                raise
            state.staging[client_id] = staging  # named nowhere in the metadata: adoption finds it by name
        return staging

    @staticmethod
    def _staging_what(client_id: str, index: int) -> str:
        return f"stage.{client_id[:12]}.k{index}"

    def staging_names(self, client_id: str) -> list[str]:
        return [st.staging[client_id].segment.name for st in self.keys.values() if client_id in st.staging]

    def key_segments(self, state: KeyState, client_id: str | None = None) -> protocol.KeySegments:
        staging = state.staging.get(client_id) if client_id is not None else None
        return protocol.KeySegments(
            key=state.name, index=state.index, dtype=state.dtype_name, width=state.width, row_shape=state.row_shape,
            pool=state.pool_seg.name, claim=state.claim_seg.name, commit=state.commit_seg.name,
            staging=staging.segment.name if staging else None, staging_rows=staging.rows if staging else 0)

    def drop_client(self, client_id: str) -> list[str]:
        """Unlink every staging segment of ``client_id``; returns their names."""
        dropped = [st.staging.pop(client_id) for st in self.keys.values() if client_id in st.staging]
        known = self.writers.pop(client_id, None) is not None
        if dropped or known:
            self.save_meta()  # before the unlink: a crash in between leaves strays, never dangling names
        removed = []
        for staging in dropped:
            staging.segment.unlink()
            staging.segment.close()
            removed.append(staging.segment.name)
        return removed

    # ------------------------------------------------------------ restart: metadata and adoption

    def meta_doc(self) -> dict:
        assert self.layout is not None
        doc = meta.empty_doc(self.name, self.generation, self.layout)
        doc["key_specs"] = {k: [s.dtype, s.width, None if s.row_shape is None else list(s.row_shape)]
                            for k, s in self.key_specs.items()}
        doc["keys"] = [[s.name, s.index, s.dtype_name, s.width, list(s.row_shape)]
                       for s in sorted(self.keys.values(), key=lambda s: s.index)]
        doc["epoch"] = self.max_epoch
        # The welcomed writers, from their sessions, not from the staging that exists: a writer has none
        # before its first key, and a new key's is created after the key is recorded. Staging of a writer
        # not welcomed yet (a crash inside its Hello) is named nowhere, so an adoption unlinks it.
        doc["writers"] = {cid: {"rows": w.staging_rows, "epoch": w.epoch, "pid": w.pid, "started": w.started}
                          for cid, w in self.writers.items()}
        return doc

    def save_meta(self) -> bool:
        """Write the metadata a restarted committer adopts (never on the write path); False if it failed."""
        if self.ctl_seg is None or self.layout is None:
            return True
        try:
            self.meta_seq = meta.write(self.ctl_seg.mmap, self.meta_doc(), self.meta_seq + 1)
        except meta.MetaError as exc:
            logger.error("cache %s: %s; a restart would adopt an older state", self.name, exc)
            return False
        return True

    @classmethod
    def adopt(cls, name: str, generation: str, *, prefault: bool = False) -> "CachePool":
        """Map the segments of a live cache left by a dead committer (never creates or clears any).

        Raises ``meta.MetaError`` naming what does not fit (metadata torn or of
        another cache, a pool/table segment missing or of the wrong size). Every
        recorded writer is kept, with the staging of each key that has one; a
        key's missing staging is created when the writer (re-)opens that key
        (``ensure_staging``), and its resume is refused only if it names a
        staging segment that is gone. A writer whose record or staging does
        not fit (no rows, a segment of the wrong size) is dropped (logged).
        Segments of the generation that the metadata does not name (a crash
        between creating them and recording them) are unlinked.
        """
        pool = cls(name, generation, prefault=prefault)
        try:
            ctl_seg = shm.Segment.attach(pool._seg("ctl"))
        except (FileNotFoundError, PermissionError) as exc:
            raise meta.MetaError(f"cannot map the control segment: {exc}") from exc
        if ctl_seg.size != meta.CTL_BYTES:  # cut short or grown by someone: nothing in it can be trusted
            ctl_seg.close()
            raise meta.MetaError(f"control segment {ctl_seg.name} has {ctl_seg.size} bytes, expected {meta.CTL_BYTES}")
        seq, doc = meta.read(ctl_seg.mmap)
        if doc.get("cache") != name or doc.get("generation") != generation:
            raise meta.MetaError(f"metadata names cache {doc.get('cache')!r} generation {doc.get('generation')!r}, "
                                 f"expected {name!r} {generation!r}")
        layout = protocol.Layout(int(doc["num_blocks"]), int(doc["block_size"]), {})
        pool.layout = layout
        pool.ctl_seg = ctl_seg
        pool.ctl = ctl_seg.array(np.int64, (protocol.CTL_WORDS,))
        pool.meta_seq = seq
        pool.max_epoch = int(doc["epoch"])
        pool.key_specs = {k: protocol.KeySpec(v[0], int(v[1]), None if v[2] is None else tuple(map(int, v[2])))
                          for k, v in doc["key_specs"].items()}
        n = pool.num_slots

        def attach(what: str, size: int) -> shm.Segment:
            seg = attach_if_present(what, size)
            if seg is None:
                raise meta.MetaError(f"segment {pool._seg(what)} does not exist")
            return seg

        def attach_if_present(what: str, size: int) -> shm.Segment | None:
            """The segment, or None when it does not exist or is empty: a kill inside ``Segment.create``
            leaves 0 bytes (tmpfs sets the size when ``posix_fallocate`` completes), and whoever created it
            never handed its name out. An empty one is left to the stray sweep below."""
            try:
                if os.stat(shm.SHM_DIR / pool._seg(what).lstrip("/")).st_size == 0:
                    return None
                seg = shm.Segment.attach(pool._seg(what))
            except FileNotFoundError:
                return None
            except PermissionError as exc:
                raise meta.MetaError(f"segment {pool._seg(what)}: {exc}") from exc
            if seg.size != max(size, 1):
                raise meta.MetaError(f"segment {seg.name} has {seg.size} bytes, the layout needs {max(size, 1)}")
            return seg

        for key, index, dtype, width, row_shape in doc["keys"]:
            try:
                cls._check_spec(key, dtype, int(width), tuple(map(int, row_shape)))
            except PoolError as exc:
                raise meta.MetaError(exc.message) from exc
            row_bytes = int(width) * protocol.DTYPE_ITEMSIZE[dtype]
            pool_seg = attach(f"pool.k{index}", n * row_bytes)
            claim_seg = attach(f"claim.k{index}", n * 8)
            commit_seg = attach(f"commit.k{index}", n * 8)
            pool.keys[key] = KeyState(
                index=int(index), name=key, dtype_name=dtype, width=int(width),
                row_shape=tuple(map(int, row_shape)), pool_seg=pool_seg,
                claim_seg=claim_seg, commit_seg=commit_seg, claim=claim_seg.array(np.int64, (n,)),
                commit=commit_seg.array(np.int64, (n,)), row_bytes=row_bytes)
        for cid, info in doc["writers"].items():
            rows, epoch = int(info["rows"]), int(info["epoch"])
            try:
                if not 1 <= rows <= MAX_STAGING_ROWS or epoch < 1:
                    raise meta.MetaError(f"recorded with staging of {rows} rows and epoch {epoch}")
                for state in pool.keys.values():
                    seg = attach_if_present(cls._staging_what(cid, state.index), rows * state.row_bytes)
                    if seg is None:
                        # Recorded key, staging not made (the crash came in between, or inside its creation):
                        # the writer never got this key's KeyOpened, and its re-sent OpenKey makes the staging.
                        logger.info("cache %s: writer %s has no staging for key %r yet", name, cid, state.name)
                        continue
                    state.staging[cid] = Staging.map(seg, rows, state.row_bytes)
            except (meta.MetaError, RuntimeError, ValueError) as exc:
                logger.warning("cache %s: not adopting writer %s: %s", name, cid, exc)
                for state in pool.keys.values():
                    state.staging.pop(cid, None)
                continue
            # Its process, when recorded (metadata of before stop 56 has none): anything odd is not known.
            pid, started = info.get("pid"), info.get("started")
            # (a pid past 2**64 could not be sent in a status reply: mutation review, stop 56)
            known = type(pid) is int and 0 < pid < 1 << 31 and isinstance(started, str) and 0 < len(started) <= 64
            pool.writers[cid] = WriterRecord(epoch, rows, pid if known else 0, started if known else None)
        keep = set(pool.segment_names())
        for stray in shm.list_segments(name):
            parsed = shm.parse_segment_name(stray)
            if parsed is not None and parsed[1] == generation and parsed[2] != liveness.OWNER and stray not in keep:
                shm.unlink_segment(stray)
                logger.info("cache %s: unlinked %s (created but never recorded before the crash)", name, stray)
        pool.ctl[protocol.CTL_COMMITTER_PID] = os.getpid()
        pool.adopted = True
        if prefault:
            for state in pool.keys.values():
                pool.prefault_seconds += state.pool_seg.prefault()
        pool.save_meta()
        return pool

    def segment_bytes(self) -> int:
        total = self.ctl_seg.size if self.ctl_seg else 0
        for state in self.keys.values():
            total += state.pool_seg.size + state.claim_seg.size + state.commit_seg.size
            total += sum(st.segment.size for st in state.staging.values())
        return total

    def describe_keys(self) -> list[dict]:
        out = []
        n = max(self.num_slots, 1)
        for state in self.keys.values():
            committed = int(np.count_nonzero(state.commit))
            out.append({"name": state.name, "index": state.index, "dtype": state.dtype_name, "width": state.width,
                        "pool_bytes": state.pool_seg.size, "committed_rows": committed,
                        "committed_share": committed / n, "rows_written": state.rows_written,
                        "bytes_written": state.bytes_written, "rows_skipped": state.rows_skipped,
                        "staging_segments": len(state.staging)})
        return out

    def segment_names(self) -> list[str]:
        names = [self.ctl_seg.name] if self.ctl_seg else []
        for state in self.keys.values():
            names += [state.pool_seg.name, state.claim_seg.name, state.commit_seg.name]
            names += [st.segment.name for st in state.staging.values()]
        return names

    def close(self) -> list[str]:
        """Unlink every segment this pool made; returns their names. Views stay valid (trap 11)."""
        removed = [name for name in self.segment_names() if shm.unlink_segment(name)]
        for state in self.keys.values():
            state.staging.clear()
        return removed
