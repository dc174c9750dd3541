"""The real CUDA path (skipped cleanly without a CUDA device; run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from manager_helpers import Part, build, expect, finished, rows, started
from omnishm.client import ModelCachePolicy, OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.client.device import CudaOps, HostRegistration
from omnishm.shm import Segment

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BS = 4


def cuda_save(m, parts, extra=None):
    h, mm, layout, n, pad = build(parts, BS)
    mm = {k: v.cuda() for k, v in mm.items()}
    mm.update(extra or {})
    return m.save_outputs(h.cuda(), mm, num_tokens_unpadded=n, num_tokens_padded=pad, write_layout=layout)


def test_cuda_save_materialize_exact_with_pinned_staging(committer):
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        m.new_step_starts([started("a", [0, 1])])
        live = torch.arange(6.0, device="cuda")
        sid = cuda_save(m, [Part("a", 1, [0, 1], 0, 8)], extra={"pooled": live})
        live.fill_(-1)  # a graph replay overwriting the live buffer changes nothing
        out = m.materialize(sid, ["a"])
        assert isinstance(m._ops, CudaOps)
        assert all(r.pinned for r in m._registrations) and m._registrations
        assert torch.equal(out.hidden_states["a"], rows(1, range(8)))
        assert torch.equal(out.mm_outputs["a"]["pooled"].cpu(), torch.arange(6.0))
        assert not out.mm_outputs["a"]["pooled"].is_pinned()
        m.new_step_starts([finished("a"), started("b", [0, 2], hit=4)])
        sid = cuda_save(m, [Part("b", 1, [0, 2], 4, 2)])
        out = m.materialize(sid, ["b"])
        assert torch.equal(out.hidden_states["b"], expect(1, 4, 1, 4, 2))
        assert torch.equal(out.mm_outputs["b"]["feat"], expect(1, 4, 1, 4, 2, mm=True))


def test_host_register_chunks_and_unregister():
    seg = Segment.create(f"/omnishm.cudatest.g.{torch.randint(1 << 30, ()).item()}", 8 << 20)
    try:
        view = seg.tensor(torch.float32, (2048, 1024))
        reg = HostRegistration(view)
        assert reg.pinned
        dev = torch.randn(2048, 1024, device="cuda")
        view.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(view, dev.cpu())
        reg.unregister()
        assert not reg.pinned
    finally:
        seg.unlink()


def test_reader_materialize_waits_for_its_deferred_clones(committer):
    """A reader with only deferred keys (a talker policy: no hidden states): its rows are device clones,
    and materialize must wait for them, not race the kernel queue that produced them."""
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    policy = ModelCachePolicy(cache_hidden=False, deferred_keys=frozenset({"talker_feat"}))
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False, role="reader") as r:
        for m in (w, r):
            m.register_policy(policy)
        for i in range(20):
            req = f"a{i}"
            _, _, layout, n, pad = build([Part(req, 1, [0, 1], 0, 8)], BS)
            big = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):  # a long kernel queue ahead of the rows on the compute stream
                big = big @ big / 2048
            feat = torch.full((n, 4), float(i), device="cuda") + big[:n, :4] * 0
            sids = []
            for m in (w, r):
                m.new_step_starts([started(req, [0, 1])] + ([finished(f"a{i - 1}")] if i else []))
                sids.append(m.save_outputs(None, {"talker_feat": feat}, num_tokens_unpadded=n, num_tokens_padded=pad,
                                           write_layout=layout))
            w.discard_step(sids[0])
            out = r.materialize(sids[1], [req])  # no synchronize in between
            assert torch.equal(out.mm_outputs[req]["talker_feat"], torch.full((n, 4), float(i))), i


def test_keys_on_two_devices_save_and_materialize_exact_on_writer_and_reader(committer):
    """Hidden states on the device, one mm tensor on the host (REVIEW 2026-12-05, argued from the code):
    the writer's ``to_host`` called ``record_stream`` on the host key's clone (no CPU kernel: the cache
    turned sticky-fatal), and a reader kept only the host key's copy event and read the device key's
    pinned rows before they landed. A long kernel queue ahead of the rows makes that copy late."""
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w, \
            OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False, role="reader") as r:
        for i in range(10):
            req = f"a{i}"
            h, mm, layout, n, pad = build([Part(req, i + 1, [0, 1], 0, 8)], BS)
            big = torch.randn(2048, 2048, device="cuda")
            for _ in range(20):
                big = big @ big / 2048
            hidden = h.cuda() + big[:pad, :1] * 0  # ready only after the queue
            sids = []
            for m in (w, r):
                m.new_step_starts([started(req, [0, 1])] + ([finished(f"a{i - 1}")] if i else []))
                sids.append(m.save_outputs(hidden, mm, num_tokens_unpadded=n, num_tokens_padded=pad,
                                           write_layout=layout))
            for m, sid in zip((w, r), sids):
                out = m.materialize(sid, [req])
                assert torch.equal(out.hidden_states[req], rows(i + 1, range(8))), (m.role, i)
                assert torch.equal(out.mm_outputs[req]["feat"], rows(i + 501, range(8), 3)), (m.role, i)
            assert isinstance(w._ops, CudaOps) and isinstance(r._ops, CudaOps)


def test_device_tensors_nested_in_a_leftover_value_come_back_on_the_host_exact(committer):
    """REVIEW (2026-12-05, argued from the code): tensors inside a list or dict leftover were deep-copied
    on the GPU, without waiting the engine's stream, and returned there. They come back on the host now,
    exact even when the engine's stream is still busy and the buffer is overwritten after the save."""
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as w:
        w.new_step_starts([started("a", [0, 1])])
        h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8)], BS)
        big = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            big = big @ big / 2048
        inner = torch.arange(5.0, device="cuda") + big[0, :5] * 0  # ready only after the queue
        sid = w.save_outputs(h.cuda(), {**mm, "nested": [inner, {"x": inner}]}, num_tokens_unpadded=n,
                             num_tokens_padded=pad, write_layout=layout)
        inner.fill_(-1)
        value = w.materialize(sid, ["a"]).mm_outputs["a"]["nested"]
        assert value[0].device.type == "cpu" and value[1]["x"].device.type == "cpu"
        assert torch.equal(value[0], torch.arange(5.0)) and torch.equal(value[1]["x"], torch.arange(5.0))


def test_a_permuted_deferred_device_key_comes_back_exact(committer):
    """REVIEW (2026-12-05, stop 42): a dense, non-contiguous device key (a permuted head output) was frozen as
    a strided clone and reshaped by a second clone after the freeze event, which the flusher's copy and the
    reads did not wait. ``CudaOps.freeze`` is contiguous now (test_device_order.py checks it on CPU)."""
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat3"})))
        m.new_step_starts([started("a", [0, 1])])
        h, mm, layout, n, pad = build([Part("a", 1, [0, 1], 0, 8)], BS)
        big = torch.randn(n, 64, 256, device="cuda")
        feat3 = big.permute(0, 2, 1)  # (n, 256, 64): dense, not contiguous
        torch.cuda._sleep(50_000_000)  # a busy engine stream: a copy not fenced would read ahead of it
        sid = m.save_outputs(h.cuda(), {"feat3": feat3}, num_tokens_unpadded=n, num_tokens_padded=pad,
                             write_layout=layout)
        out = m.materialize(sid, ["a"])
        assert torch.equal(out.mm_outputs["a"]["feat3"], feat3.cpu())
        m.new_step_starts([finished("a"), started("b", [0, 1, 2], hit=8)])
        h2, _, layout2, n2, pad2 = build([Part("b", 1, [0, 1, 2], 8, 1)], BS)
        sid = m.save_outputs(h2.cuda(), {"feat3": torch.zeros(n2, 256, 64, device="cuda")},
                             num_tokens_unpadded=n2, num_tokens_padded=pad2, write_layout=layout2)
        out = m.materialize(sid, ["b"])  # the hit reads the deferred rows the flusher wrote to the pool
        assert torch.equal(out.mm_outputs["b"]["feat3"][:8], feat3.cpu())


def test_discarded_steps_behind_a_busy_stream_land_exact_rows(committer):
    """REVIEW (stop 59, by reading): every other test here materializes its steps, and the materializing
    thread sends each step once it waited the step's copy. A step nobody materializes is sent by the
    ``omnishm-sender`` thread, and a deferred key's rows are copied by the flusher: each must wait its own
    step's events. Steps saved behind a long kernel queue and discarded at once, their request finished so the
    flusher copies its deferred rows: a later hit reads them all from the pool, exact (a send or a flush that
    did not wait would have the committer commit a staging page or a flush region before the copy landed)."""
    cfg = PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=32, staging_depth=3)
    with OmniPrefixCacheManager(cfg, cache=committer.name, autostart=False) as m:
        m.register_policy(ModelCachePolicy(deferred_keys=frozenset({"feat"})))
        before = []
        for i in range(4):
            a, b = f"a{i}", f"b{i}"
            m.new_step_starts(before + [started(a, [0, 1])])
            h, mm, layout, n, pad = build([Part(a, i + 1, [0, 1], 0, 8)], BS)
            torch.cuda._sleep(50_000_000)  # the step's rows and its copies queue behind it
            sid = m.save_outputs(h.cuda(), {k: v.cuda() for k, v in mm.items()}, num_tokens_unpadded=n,
                                 num_tokens_padded=pad, write_layout=layout)
            m.discard_step(sid)  # nobody materializes it: the sender thread sends it
            m.new_step_starts([finished(a), started(b, [0, 1, 2], hit=8)])  # the flusher copies a's rows
            h2, mm2, layout2, n2, pad2 = build([Part(b, i + 1, [0, 1, 2], 8, 1)], BS)
            sid = m.save_outputs(h2.cuda(), {k: v.cuda() for k, v in mm2.items()}, num_tokens_unpadded=n2,
                                 num_tokens_padded=pad2, write_layout=layout2)
            out = m.materialize(sid, [b])
            assert torch.equal(out.hidden_states[b], expect(i + 1, 8, i + 1, 8, 1)), i
            assert torch.equal(out.mm_outputs[b]["feat"], expect(i + 1, 8, i + 1, 8, 1, mm=True)), i
            before = [finished(b)]
        assert m.counters["deferred_flushes"] >= 4
