"""The committer's CachePool (omnishm/committer/pool.py): layouts, key limits, segments made and unlinked, what a
restart adopts.

From the mutation review of stop 51 (24 mutants, 7 gaps). The in-process pools are named by ``unique_cache_name``,
so another session's sweeps never see them.
"""

from __future__ import annotations

import errno
import os
import uuid

import pytest

from omnishm import protocol, shm
from omnishm.committer import meta
from omnishm.committer import pool as pool_mod
from omnishm.committer.pool import MAX_KEY_NAME, MAX_KEYS, CachePool, KeyState, PoolError, WriterRecord

from conftest import unique_cache_name
from helpers import Writer

LAYOUT = protocol.Layout(num_blocks=16, block_size=4)
KEY_H = protocol.KeySpec("float16", 8, (8,))


@pytest.fixture
def pool():
    """An in-process ``CachePool`` on real shared memory; closed after the test, which must leave none of its
    segments."""
    made = CachePool(unique_cache_name("pool"), uuid.uuid4().hex[:8])
    try:
        yield made
    finally:
        made.close()
    assert shm.list_segments(made.name) == []


def _key_h(pool: CachePool, writer_epoch: int = 0) -> KeyState:
    """A 4x4 layout and key "h" opened; with ``writer_epoch``, writer "w1" (4 staging rows) recorded at it."""
    pool.set_layout(protocol.Layout(4, 4))
    state = pool.open_key("h", KEY_H)
    if writer_epoch:
        assert pool.set_writer_epoch(writer_epoch, "w1", 4)
    return state


def test_a_client_with_another_block_size_is_refused(committer_factory):
    """A cache's slots are ``num_blocks * block_size`` rows addressed as ``block * block_size + offset``:
    a client whose block_size differs (even with the same num_blocks) would compute other slots for the
    same block and read rows that belong to other tokens. The committer must refuse its Hello with a
    layout mismatch naming both block sizes, and the writer that fixed the layout stays attached."""
    handle = committer_factory()
    writer = Writer(handle.endpoint, handle.name, LAYOUT, 4)
    writer.open_key("h", "float16", 8)
    client = handle.client()
    reply = client.hello(protocol.ROLE_READER, protocol.Layout(num_blocks=16, block_size=8))
    assert isinstance(reply, protocol.Refused), reply
    assert "block_size=4" in reply.reason and "block_size=8" in reply.reason, reply.reason
    welcome = client.hello(protocol.ROLE_READER, LAYOUT)
    assert isinstance(welcome, protocol.Welcome) and welcome.layout.block_size == 4
    assert isinstance(client.goodbye(), protocol.Bye)
    client.close()
    writer.goodbye()


def test_the_key_limit_is_exact_for_a_writers_keys(pool):
    """A cache holds at most MAX_KEYS key names (their longest form must fit the metadata slot a
    restart adopts): the writer's MAX_KEYS-th OpenKey of a new name succeeds and is recorded, the next
    is refused with ``too_many_keys`` and creates no segment; a writer Hello layout declaring one name
    past the limit is refused the same way, and the cache keeps working for the keys it has."""
    pool.set_layout(protocol.Layout(1, 1))
    names = [f"{i:03d}" + "k" * (MAX_KEY_NAME - 3) for i in range(MAX_KEYS)]
    for key in names:
        pool.open_key(key, protocol.KeySpec("int8", 1, (1,)))
    segments = set(shm.list_segments(pool.name))
    with pytest.raises(PoolError) as err:
        pool.open_key("one-more", protocol.KeySpec("int8", 1, (1,)))
    assert err.value.code == "too_many_keys" and f"limit of {MAX_KEYS}" in err.value.message
    assert set(shm.list_segments(pool.name)) == segments and "one-more" not in pool.key_specs
    with pytest.raises(PoolError) as err:
        pool.fix_layout(protocol.Layout(1, 1, {"one-more": protocol.KeySpec("int8", 1)}), room_for_specs=True)
    assert err.value.code == "too_many_keys"
    _, doc = meta.read(pool.ctl_seg.mmap)
    assert sorted(k[0] for k in doc["keys"]) == sorted(names)


def test_a_key_whose_segments_cannot_all_be_made_leaves_none_behind(pool, monkeypatch):
    """open_key creates a key's pool, claim and commit segments; when one cannot be made (ENOSPC from
    posix_fallocate on a full /dev/shm) the ones already made are unlinked, the key is not recorded,
    and the same OpenKey succeeds once there is room: /dev/shm is left as found and no half key leaks."""
    real = shm.Segment.create

    def full(seg_name, size):
        if seg_name.endswith(".commit.k0"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(seg_name, size)

    pool.set_layout(protocol.Layout(4, 4))
    before = set(shm.list_segments(pool.name))
    monkeypatch.setattr(shm.Segment, "create", staticmethod(full))
    with pytest.raises(OSError):
        pool.open_key("h", KEY_H)
    assert set(shm.list_segments(pool.name)) == before and "h" not in pool.keys
    monkeypatch.setattr(shm.Segment, "create", staticmethod(real))
    state = pool.open_key("h", KEY_H)
    assert state.index == 0
    _, doc = meta.read(pool.ctl_seg.mmap)
    assert [k[0] for k in doc["keys"]] == ["h"]


def test_keys_declared_in_the_writers_layout_open_with_their_own_segments(committer_factory):
    """A writer's Hello layout may declare its keys before it opens them (the committer records their
    specs); each key opened afterwards gets the next key index and segments of its own, so the second
    declared key opens as well as the first (it does not collide with a name the first took) and rows
    written to one key never land in the other's pool."""
    handle = committer_factory()
    specs = {"a": protocol.KeySpec("float16", 8), "b": protocol.KeySpec("float16", 8), "c": protocol.KeySpec("int8", 4)}
    writer = Writer(handle.endpoint, handle.name, protocol.Layout(16, 4, specs), 4)
    opened = []
    for rid, key in enumerate(["b", "a"], start=1):
        spec = specs[key]
        reply = writer.raw.call(protocol.OpenKey(rid=rid, key=key, dtype=spec.dtype, width=spec.width))
        assert isinstance(reply, protocol.KeyOpened), reply
        opened.append(reply.segments)
    assert sorted(s.index for s in opened) == [0, 1]
    assert len({s.pool for s in opened}) == 2 and len({s.staging for s in opened}) == 2
    writer.goodbye()


def test_a_staging_segment_that_cannot_be_mapped_is_unlinked(pool, monkeypatch):
    """ensure_staging creates a writer's staging segment and then maps it; when the map fails (an
    mmap refused: MemoryError, ValueError) the segment, recorded nowhere yet, is unlinked at once, so
    no shared memory leaks, and the next try makes the staging afresh."""
    state = _key_h(pool)
    before = set(shm.list_segments(pool.name))
    real = pool_mod.Staging.map

    def refuse(cls, *args):
        raise MemoryError("cannot map")

    monkeypatch.setattr(pool_mod.Staging, "map", classmethod(refuse))
    with pytest.raises(MemoryError):
        pool.ensure_staging("w1", state, 4)
    assert set(shm.list_segments(pool.name)) == before and "w1" not in state.staging
    monkeypatch.setattr(pool_mod.Staging, "map", real)
    staging = pool.ensure_staging("w1", state, 4)
    assert staging.rows == 4 and staging.segment.name in shm.list_segments(pool.name)


def test_a_dropped_writer_is_no_longer_recorded_for_a_restart(pool):
    """drop_client (a writer's Bye, its reaping, a refused Hello) unlinks the writer's staging and takes
    it out of the metadata a restarted committer adopts: an adopter keeps no seat, epoch record or
    staging for a writer that is gone (it would wait for a resume that never comes, with the
    next writer refused meanwhile)."""
    pool.ensure_staging("w1", _key_h(pool, writer_epoch=1), 4)
    assert "w1" in meta.read(pool.ctl_seg.mmap)[1]["writers"]
    removed = pool.drop_client("w1")
    assert removed and not any(n in shm.list_segments(pool.name) for n in removed)
    assert meta.read(pool.ctl_seg.mmap)[1]["writers"] == {}
    adopted = CachePool.adopt(pool.name, pool.generation)
    assert adopted.writers == {} and adopted.max_epoch == 1 and list(adopted.keys) == ["h"]


def test_an_adopted_segment_of_the_wrong_size_is_refused(pool):
    """A restarted committer adopts a key's segments only when each has the size the recorded layout
    needs: one grown or cut by someone (a stray tool, a different build) holds rows at offsets the
    clients do not compute, so the adoption is refused with a MetaError naming the segment and both
    sizes (the caller sweeps the generation); a writer's staging of the wrong size drops that writer
    and unlinks that staging."""
    state = _key_h(pool, writer_epoch=1)
    staging = pool.ensure_staging("w1", state, 4)
    stage_path = shm.SHM_DIR / staging.segment.name.lstrip("/")
    os.truncate(stage_path, staging.segment.size + 4096)
    adopted = CachePool.adopt(pool.name, pool.generation)
    assert "w1" not in adopted.writers and "w1" not in adopted.keys["h"].staging
    assert not stage_path.exists()  # named by no adopted writer: swept
    path = shm.SHM_DIR / state.pool_seg.name.lstrip("/")
    os.truncate(path, state.pool_seg.size + 4096)
    with pytest.raises(meta.MetaError) as err:
        CachePool.adopt(pool.name, pool.generation)
    assert state.pool_seg.name in str(err.value) and str(state.pool_seg.size) in str(err.value)


def test_a_recorded_writer_without_a_valid_epoch_is_not_adopted(pool):
    """Epoch 0 means "no writer" to every reader (the control word before any writer, cv epoch 0), so a
    metadata record of a writer with epoch 0 (or no staging rows) cannot be a writer that was welcomed:
    the adopter drops it (logged) and keeps the rest of the cache, rather than seating a writer whose
    publications no reader would ever follow."""
    _key_h(pool)
    assert pool.set_writer_epoch(3, "good", 4)
    doc = pool.meta_doc()
    doc["writers"]["zero"] = {"rows": 4, "epoch": 0}
    doc["writers"]["norows"] = {"rows": 0, "epoch": 2}
    pool.meta_seq = meta.write(pool.ctl_seg.mmap, doc, pool.meta_seq + 1)
    adopted = CachePool.adopt(pool.name, pool.generation)
    assert set(adopted.writers) == {"good"} and adopted.writers["good"].epoch == 3


@pytest.mark.parametrize("pid,started", [(True, "123"), (0, "123"), (-4, "123"),
                                         (4242, ""), (4242, "9" * 65), (4242.0, "123"), ("4242", "123"),
                                         (1 << 70, "123")])
def test_a_malformed_recorded_process_is_adopted_as_unknown(pool, pid, started):
    """Mutation review (stop 56): a writer's recorded process is adopted only as a pid in 1..2**31-1 and a
    start time of 1 to 64 characters, else as unknown (a pid past 2**64 stopped the restarted committer at
    its first status reply, which could not encode it)."""
    _key_h(pool)
    assert pool.set_writer_epoch(3, "odd", 4) and pool.set_writer_epoch(3, "good", 4, 4242, "123")
    doc = pool.meta_doc()
    doc["writers"]["odd"].update(pid=pid, started=started)
    pool.meta_seq = meta.write(pool.ctl_seg.mmap, doc, pool.meta_seq + 1)
    adopted = CachePool.adopt(pool.name, pool.generation)
    assert adopted.writers["odd"] == WriterRecord(3, 4, 0, None)
    assert adopted.writers["good"] == WriterRecord(3, 4, 4242, "123")


def test_a_key_its_metadata_cannot_record_is_refused_and_leaves_nothing(pool, monkeypatch):
    """REVIEW (stop 59, by reading): ``open_key`` ignored a failed metadata save, and handed out segments no
    metadata named, which an adoption unlinks while clients map them. It refuses the key now (``meta``), keeps
    no segment and no spec of it, and the same key opens once the metadata can be saved."""
    pool.set_layout(protocol.Layout(4, 4))
    before = set(shm.list_segments(pool.name))
    real = meta.write

    def full(mm, doc, seq):
        raise meta.MetaError("cache metadata of 70000 bytes does not fit a 65536-byte slot")

    monkeypatch.setattr(meta, "write", full)
    with pytest.raises(PoolError) as exc:
        pool.open_key("h", KEY_H)
    assert exc.value.code == "meta" and "'h'" in exc.value.message
    assert set(shm.list_segments(pool.name)) == before and "h" not in pool.keys and "h" not in pool.key_specs
    monkeypatch.setattr(meta, "write", real)
    assert pool.open_key("h", KEY_H).index == 0
    _, doc = meta.read(pool.ctl_seg.mmap)
    assert [k[0] for k in doc["keys"]] == ["h"]
