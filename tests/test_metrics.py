"""The committer's Prometheus endpoint during a real workload (real committer, real manager, real HTTP)."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request

import pytest
from helpers import RawClient, Writer, free_port, pack
from manager_helpers import Part, extended, save, started
from prometheus_client.parser import text_string_to_metric_families

from omnishm import protocol
from omnishm.client import HIDDEN_KEY, OmniPrefixCacheManager, PrefixCacheConfig
from omnishm.committer.metrics import ClientCounterTotals, ThroughputRing

BS = 4
NUM_BLOCKS = 16
POLL_TIMEOUT_S = 15.0


def others_depart(t: ClientCounterTotals, counter: str, prefix: str = "r") -> None:
    """``RETAIN_DEPARTED_IDS`` readers of 1 ``counter`` each come and go: every client that left before them is
    folded into the readers' total."""
    from omnishm.committer.metrics import RETAIN_DEPARTED_IDS

    for i in range(RETAIN_DEPARTED_IDS):
        t.heartbeat(f"{prefix}{i}", "reader", {counter: 1})
        t.departed(f"{prefix}{i}")


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape."""
    code, text = get(f"http://127.0.0.1:{port}/metrics")
    assert code == 200, text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict, name: str, **labels) -> float | None:
    return m.get((name, tuple(sorted(labels.items()))))


def wait_for(port: int, what: str, cond) -> dict:
    """Scrape until ``cond(metrics)`` holds (bounded; the loop publishes a snapshot every tick)."""
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while True:
        m = scrape(port)
        if cond(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never showed {what}; last scrape: "
                                 f"{ {k: v for k, v in m.items() if k[0].startswith('omnishm_')} }")
        time.sleep(0.05)  # poll interval of a bounded wait, not a stand-in for the condition


def config() -> PrefixCacheConfig:
    return PrefixCacheConfig(num_blocks=NUM_BLOCKS, block_size=BS, staging_capacity_tokens=32, staging_depth=3,
                             staging_claim_timeout_s=2.0, commit_timeout_s=5.0)


def test_counters_move_by_the_workload(committer_factory):
    port = free_port()
    handle = committer_factory("--metrics-port", str(port), "--heartbeat-s", "0.1")
    code, text = get(f"http://127.0.0.1:{port}/health")
    assert code == 200 and handle.name in text
    assert get(f"http://127.0.0.1:{port}/nope")[0] == 404
    m0 = wait_for(port, "an idle committer", lambda m: value(m, "omnishm_clients", role="writer") == 0)
    assert value(m0, "omnishm_capacity_rows") == 0 and value(m0, "omnishm_rejected_messages_total") is None

    writer = OmniPrefixCacheManager(config(), cache=handle.name, autostart=False)
    reader = OmniPrefixCacheManager(config(), cache=handle.name, role="reader", autostart=False)
    try:
        writer.new_step_starts([started("a", [0, 1, 2])])
        writer.discard_step(save(writer, [Part("a", 1, [0, 1, 2], 0, 10)], BS))
        writer.new_step_starts([started("b", [0, 1, 5], hit=8)])  # shares a's first two blocks
        sid = save(writer, [Part("b", 1, [0, 1, 5], 8, 3)], BS, padded=16)
        assert writer.materialize(sid, ["b"]).num_hit_tokens["b"] == 8
        writer.wait_idle()

        raw = RawClient(handle.endpoint, handle.name)  # a message without Hello: rejected, reason no_session
        try:
            assert isinstance(raw.call(protocol.Heartbeat(rid=1)), protocol.Error)
        finally:
            raw.close()

        rows = 10 + 3
        m = wait_for(port, "13 rows per key and the writer's heartbeat counters", lambda m: (
            value(m, "omnishm_rows_written_total", tensor=HIDDEN_KEY) == rows
            and value(m, "omnishm_rows_written_total", tensor="feat") == rows
            and value(m, "omnishm_client_steps_saved_total", role="writer") == 2
            and value(m, "omnishm_client_hit_tokens_total", role="writer") == 8
            and value(m, "omnishm_rejected_messages_total", reason="no_session") == 1))
        assert value(m, "omnishm_bytes_written_total", tensor=HIDDEN_KEY) == rows * 8 * 4  # float32[8]
        assert value(m, "omnishm_bytes_written_total", tensor="feat") == rows * 3 * 4  # float32[3]
        assert value(m, "omnishm_client_hit_rows_served_total", role="writer") == 8 * 2  # 8 tokens x 2 tensors
        assert value(m, "omnishm_client_rows_served_total", role="writer") == (8 + 3) * 2
        assert value(m, "omnishm_clients", role="writer") == 1 and value(m, "omnishm_clients", role="reader") == 1
        assert value(m, "omnishm_capacity_rows") == NUM_BLOCKS * BS
        assert value(m, "omnishm_mirror_bytes", tensor=HIDDEN_KEY) == NUM_BLOCKS * BS * 8 * 4
        assert value(m, "omnishm_committed_rows", tensor=HIDDEN_KEY) == rows  # 13 distinct slots
        assert value(m, "omnishm_committed_ratio", tensor="feat") == pytest.approx(rows / (NUM_BLOCKS * BS))
        assert value(m, "omnishm_failed_steps_total") == 0 and value(m, "omnishm_clients_reaped_total") == 0
        assert value(m, "omnishm_process_resident_bytes", role="writer") > 0
        applied = value(m, "omnishm_steps_applied_total")
        assert applied >= 2 and value(m, "omnishm_write_apply_seconds_count") == applied
        assert value(m, "omnishm_write_apply_seconds_sum") > 0
        assert value(m, "omnishm_loop_tick_age_seconds") < 5
    finally:
        reader.shutdown()
        writer.shutdown()
    # Departed clients: gauges drop, their counters are retained (never backwards).
    m = wait_for(port, "both clients gone", lambda m: value(m, "omnishm_clients", role="writer") == 0
                 and value(m, "omnishm_clients", role="reader") == 0)
    assert value(m, "omnishm_client_steps_saved_total", role="writer") == 2
    assert value(m, "omnishm_client_hit_tokens_total", role="writer") == 8
    assert value(m, "omnishm_rows_written_total", tensor=HIDDEN_KEY) == rows


def test_metrics_off_by_default_and_port_in_use_refuses_start(committer_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        handle = committer_factory("--metrics-port", str(port), wait=False)
        assert handle.proc.wait(30) == 2
        assert f"cannot serve metrics on 127.0.0.1:{port}" in handle.log()


def test_client_counter_totals_survive_departures_and_rehello():
    t = ClientCounterTotals()
    t.heartbeat("w1", "writer", {"steps_saved": 3, "staging_pages_in_use": 2, "not_a_counter": 9})
    t.heartbeat("r1", "reader", {"steps_saved": 3})
    assert t.totals() == {"writer": {"steps_saved": 3.0}, "reader": {"steps_saved": 3.0}}
    assert t.gauges() == {"writer": {"staging_pages_in_use": 2.0}}
    t.departed("w1")
    t.heartbeat("w2", "writer", {"steps_saved": 1})
    assert t.totals()["writer"] == {"steps_saved": 4.0} and t.gauges() == {}
    t.heartbeat("w1", "writer", {"steps_saved": 5})  # same client back (re-hello): superseded, not doubled
    assert t.totals()["writer"] == {"steps_saved": 6.0}


def test_a_client_back_after_a_thousand_others_left_is_counted_once():
    """REVIEW (2026-12-05, stop 42, metrics): a departed client's values were folded into the role total once
    1024 others had left after it, and a client coming back with its id (a reader reaped after a stall, then
    resumed) reported its cumulative values again: 100 + 1024 counted as 1224."""
    from omnishm.committer.metrics import RETAIN_DEPARTED_IDS

    t = ClientCounterTotals()
    t.heartbeat("x", "reader", {"steps_saved": 100})
    t.departed("x")
    others_depart(t, "steps_saved")
    assert t.totals()["reader"] == {"steps_saved": 100.0 + RETAIN_DEPARTED_IDS}
    t.heartbeat("x", "reader", {"steps_saved": 100})  # back: the same cumulative value
    assert t.totals()["reader"] == {"steps_saved": 100.0 + RETAIN_DEPARTED_IDS}
    t.heartbeat("x", "reader", {"steps_saved": 103})
    t.departed("x")
    assert t.totals()["reader"] == {"steps_saved": 103.0 + RETAIN_DEPARTED_IDS}


def test_a_client_back_in_another_role_keeps_what_it_counted_in_the_old_one():
    """REVIEW (2026-12-06): a reader's socket that said Hello again as an admin (same client id) dropped the
    reader's departed values at its first heartbeat: the readers' cumulative total went from 100 back to 0.
    The old role's values stay, folded (departed, and folded after 1024 others left); a return in the same
    role still supersedes them."""
    from omnishm.committer.metrics import RETAIN_DEPARTED_IDS

    t = ClientCounterTotals()
    t.heartbeat("x", "reader", {"hit_tokens": 100})
    t.departed("x")
    t.heartbeat("x", "admin", {})
    assert t.totals()["reader"] == {"hit_tokens": 100.0}
    t.departed("x")
    t.heartbeat("x", "reader", {"hit_tokens": 7})  # a reader again, its counters new: nothing to supersede
    assert t.totals()["reader"] == {"hit_tokens": 107.0}
    t.departed("x")
    others_depart(t, "hit_tokens")  # x's 7 folded into the readers' total
    t.heartbeat("x", "writer", {})
    assert t.totals()["reader"] == {"hit_tokens": 107.0 + RETAIN_DEPARTED_IDS}


def test_a_reaped_writers_failed_writes_are_counted_and_a_reaped_readers_step_write_is_not(committer_factory):
    """REVIEW (2026-12-06): ``omnishm_failed_writes_total`` left out the tids failed for a reaped writer
    (status ``tids_failed_reaped`` alone had them); and a reaped reader's StepWrite was answered as a reaped
    writer's ("this writer's session was reaped"), its tids counted as failed writes. The reader's gets
    ``no_session`` now, counted as such."""
    port = free_port()
    h = committer_factory("--metrics-port", str(port), "--heartbeat-s", "0.1", "--heartbeat-timeout-s", "1.0")
    w = Writer(h.endpoint, h.name, protocol.Layout(num_blocks=NUM_BLOCKS, block_size=BS), 8)
    reader = RawClient(h.endpoint, h.name)
    try:
        w.open_key("k", "bfloat16", 8)
        assert isinstance(reader.hello(protocol.ROLE_READER), protocol.Welcome)
        wait_for(port, "both reaped", lambda m: value(m, "omnishm_clients_reaped_total") == 2)
        cv = w.new_cv(1)
        reply = w.step_write(1, [("k", 11, cv, 0, [0]), ("k", 12, cv, 1, [1]), ("k", 13, cv, 2, [2])],
                             claim=False)
        assert isinstance(reply, protocol.StepDone) and len(reply.failed_tids) == 3 * 8, reply
        n = 100
        reply = reader.call(protocol.StepWrite(
            rid=reader.next_rid(), step=1, keys=["k"], key_idx=pack([0] * n), tids=pack(range(n)),
            cvs=pack([1] * n), src_rows=pack([0] * n), counts=pack([0] * n), slots=b""))
        assert isinstance(reply, protocol.Error) and reply.code == "no_session", reply
        m = scrape(port)
        assert value(m, "omnishm_failed_writes_total") == 3
        assert value(m, "omnishm_rejected_messages_total", reason="reaped_write") == 1
        assert value(m, "omnishm_rejected_messages_total", reason="no_session") == 1
    finally:
        reader.close()
        w.raw.close()


def test_throughput_ring_reports_recent_rates():
    ring = ThroughputRing(sample_s=1.0, window_s=10.0)
    for i in range(30):
        ring.maybe_sample(float(i), i * 100, i * 1000)
    rates = ring.rates(30.0, 3000, 30000)
    assert rates["rows_per_s"] == pytest.approx(100.0) and rates["bytes_per_s"] == pytest.approx(1000.0)
    assert 10.0 <= rates["window_s"] <= 11.0
    assert ThroughputRing().rates(5.0, 0, 0)["rows_per_s"] == 0.0


def test_metrics_host_must_be_loopback(committer_factory):
    handle = committer_factory("--metrics-port", "1", "--metrics-host", "0.0.0.0", wait=False)
    assert handle.proc.wait(30) == 2
    assert "loopback only" in handle.log()
    assert not os.path.exists(handle.endpoint[len("ipc://"):])


def test_health_is_503_when_the_loop_stops_ticking_or_stops():
    from types import SimpleNamespace

    from omnishm.committer.metrics import Observability

    stub = SimpleNamespace(cfg=SimpleNamespace(name="stub"), stopping=False, stop_reason="",
                           pool=SimpleNamespace(keys={}))
    obs = Observability(stub, tick_s=1.0)
    obs.tick(time.monotonic())
    assert obs.healthy()[0]
    obs.last_tick -= obs.health_timeout_s + 1  # the loop went silent
    ok, why = obs.healthy()
    assert not ok and "silent" in why
    obs.tick(time.monotonic())
    stub.stopping, stub.stop_reason = True, "SIGTERM"
    assert obs.healthy() == (False, "stopping (SIGTERM)")


def test_counters_made_after_the_last_heartbeat_arrive_with_the_goodbye(committer_factory):
    port = free_port()
    # Heartbeats every 60 s: within this test the only counters the committer gets are the goodbye's.
    handle = committer_factory("--metrics-port", str(port), "--heartbeat-s", "60", "--heartbeat-timeout-s", "120")
    writer = OmniPrefixCacheManager(config(), cache=handle.name, autostart=False)
    try:
        for step in range(3):
            writer.new_step_starts([started("a", [0, 1, 2])] if step == 0 else [extended("a", 4 * step)])
            writer.discard_step(save(writer, [Part("a", 1, [0, 1, 2], 4 * step, 4)], BS))
        assert value(scrape(port), "omnishm_client_steps_saved_total", role="writer") is None
    finally:
        writer.shutdown()
    m = wait_for(port, "the goodbye's counters", lambda m: value(m, "omnishm_clients", role="writer") == 0
                 and value(m, "omnishm_client_steps_saved_total", role="writer") == 3)
    assert value(m, "omnishm_rows_written_total", tensor=HIDDEN_KEY) == 12


def test_every_unmatch_error_raised_to_the_engine_is_counted_and_a_refused_saves_time_too(committer_factory):
    """REVIEW (2026-12-07, stop 53): ``omnishm_client_unmatch_errors_total`` is documented as the
    OmniPrefixCacheUnmatchErrors raised to the engine, but only those of ``materialize``'s reading were counted:
    a refused hit, an unknown step id and a staging timeout raised 3 and the export said 0. And
    ``save_seconds`` counted successful saves only: a save that waited out its staging claim added nothing."""
    from omnishm.client import OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError

    port = free_port()
    handle = committer_factory("--metrics-port", str(port), "--heartbeat-s", "60", "--heartbeat-timeout-s", "120")
    writer = OmniPrefixCacheManager(PrefixCacheConfig(num_blocks=16, block_size=BS, staging_capacity_tokens=8,
                                                      staging_depth=1, staging_claim_timeout_s=0.3),
                                    cache=handle.name, autostart=False)
    try:
        with pytest.raises(OmniPrefixCacheUnmatchError, match="not a multiple of block_size"):
            writer.new_step_starts([started("a", [0, 1], hit=3)])  # a hit that is no whole block
        with pytest.raises(OmniPrefixCacheUnmatchError, match="never saved"):
            writer.discard_step(7)
        writer.new_step_starts([started("b", [2])])
        held = save(writer, [Part("b", 1, [2], 0, 4)], BS)  # the one staging page, held unconsumed
        before = writer.counters["save_seconds"]
        writer.new_step_starts([started("c", [3])])
        with pytest.raises(OmniPrefixCacheStagingTimeoutError):
            save(writer, [Part("c", 2, [3], 0, 4)], BS)
        assert writer.counters["save_seconds"] - before >= 0.3  # the claim's wait, on the engine thread
        writer.discard_step(held)
        assert writer.counters["unmatch_errors"] == 3
    finally:
        writer.shutdown()
    m = wait_for(port, "the goodbye's counters", lambda m: value(m, "omnishm_clients", role="writer") == 0
                 and value(m, "omnishm_client_unmatch_errors_total", role="writer") is not None)
    assert value(m, "omnishm_client_unmatch_errors_total", role="writer") == 3


def test_a_refused_save_cut_short_in_its_burn_counts_no_unmatch_error(committer, monkeypatch):
    """REVIEW (2026-12-07, stop 53): a refused save is counted once its refusal is what leaves the call; an
    interrupt in the burn that follows raises in its place, and the engine never got an unmatch error."""
    from helpers import interrupt_once
    from manager_helpers import quick_config

    w = OmniPrefixCacheManager(quick_config(staging_capacity_tokens=8), cache=committer.name, autostart=False)
    try:
        w.new_step_starts([started("b", [2, 3, 4])])
        interrupt_once(monkeypatch, w, "_forget_refused")
        with pytest.raises(KeyboardInterrupt):
            save(w, [Part("b", 1, [2, 3, 4], 0, 12)], BS)  # refused (too large), then cut in the burn
        assert w.counters["unmatch_errors"] == 0
    finally:
        w.shutdown()


def test_client_counters_are_checked_before_they_are_kept(committer):
    """Long names, NaN, infinities and negatives are dropped (counted); an exported counter never goes back;
    the exported names are kept first when a client sends more than MAX_COUNTERS."""
    from omnishm.committer.server import MAX_COUNTERS

    raw = committer.client()
    try:
        assert isinstance(raw.hello(protocol.ROLE_READER, protocol.Layout(16, 4)), protocol.Welcome)
        junk = {f"junk{i:04d}": 1.0 for i in range(MAX_COUNTERS + 10)}
        bad = {"x" * 100_000: 1.0, "nan": float("nan"), "inf": float("inf"), "neg": -5.0}
        assert isinstance(raw.call(protocol.Heartbeat(rid=raw.next_rid(),
                                                      counters={**junk, **bad, "steps_saved": 100.0})),
                          protocol.HeartbeatAck)
        assert isinstance(raw.call(protocol.Heartbeat(rid=raw.next_rid(), counters={"steps_saved": 7.0})),
                          protocol.HeartbeatAck)
        st = raw.status()
        me = [c for c in st["clients"] if c["client_id"] == raw.client_id][0]
        assert me["counters"] == {"steps_saved": 100.0}  # the largest value seen, nothing else survived
        assert st["rejected"].get("bad_counters", 0) >= 1
        assert isinstance(raw.call(protocol.Heartbeat(rid=raw.next_rid(), counters={**junk, "steps_saved": 101.0})),
                          protocol.HeartbeatAck)
        me = [c for c in raw.status()["clients"] if c["client_id"] == raw.client_id][0]
        assert me["counters"]["steps_saved"] == 101.0 and len(me["counters"]) == MAX_COUNTERS
    finally:
        raw.close()


def test_a_negative_or_non_finite_counter_is_dropped_even_when_the_report_is_small(committer):
    """``Committer._take_counters`` keeps only finite values >= 0: a heartbeat of a few counters (far below
    ``MAX_COUNTERS``, so the count limit drops nothing) that carries a negative value and a NaN keeps neither,
    keeps the good counter, and counts the report in ``rejected['bad_counters']``. MUTATION (stop 47): the test above sends its negative
    among more than MAX_COUNTERS names, where the count limit dropped it whatever its value."""
    raw = committer.client()
    try:
        assert isinstance(raw.hello(protocol.ROLE_READER, protocol.Layout(16, 4)), protocol.Welcome)
        before = raw.status()["rejected"].get("bad_counters", 0)
        ack = raw.call(protocol.Heartbeat(rid=raw.next_rid(),
                                          counters={"neg": -5.0, "nan": float("nan"), "steps_saved": 3.0}))
        assert isinstance(ack, protocol.HeartbeatAck), ack
        st = raw.status()
        me = [c for c in st["clients"] if c["client_id"] == raw.client_id][0]
        assert me["counters"] == {"steps_saved": 3.0}, me["counters"]
        assert st["rejected"].get("bad_counters", 0) == before + 1, st["rejected"]
    finally:
        raw.close()


def test_staging_pages_in_use_drops_when_the_steps_are_consumed(committer_factory):
    # The gauge was set at each save only, so it kept the last save's pages after they were consumed.
    port = free_port()
    handle = committer_factory("--metrics-port", str(port), "--heartbeat-s", "0.1")
    writer = OmniPrefixCacheManager(config(), cache=handle.name, autostart=False)
    try:
        sids = []
        for step in range(2):
            writer.new_step_starts([started("a", [0, 1, 2])] if step == 0 else [extended("a", 4)])
            sids.append(save(writer, [Part("a", 1, [0, 1, 2], 4 * step, 4)], BS))
        wait_for(port, "two pages held", lambda m: value(m, "omnishm_client_staging_pages_in_use", role="writer") == 2)
        for sid in sids:
            writer.discard_step(sid)
        writer.wait_idle()
        wait_for(port, "no page held", lambda m: value(m, "omnishm_client_staging_pages_in_use", role="writer") == 0)
    finally:
        writer.shutdown()


def test_the_links_own_counters_survive_the_goodbye(committer_factory):
    """REVIEW (2026-12-05): heartbeats carry the link's own ``link_*`` stats, the goodbye did not, and the
    committer kept only what the last report named: a client that had lost its committer once, or stalled,
    took its share out of ``omnishm_client_link_*_total`` when it left (a counter going back)."""
    port = free_port()
    handle = committer_factory("--metrics-port", str(port), "--heartbeat-s", "0.1")
    writer = OmniPrefixCacheManager(config(), cache=handle.name, autostart=False)
    try:
        writer._link.stats["committer_lost"] += 2  # what the link's I/O thread counts on a loss, a stall
        writer._link.stats["io_stalls"] += 1
        wait_for(port, "the link's counters", lambda m: value(
            m, "omnishm_client_link_committer_lost_total", role="writer") == 2)
    finally:
        writer.shutdown()
    m = wait_for(port, "the writer gone", lambda m: value(m, "omnishm_clients", role="writer") == 0)
    assert (value(m, "omnishm_client_link_committer_lost_total", role="writer"),
            value(m, "omnishm_client_link_io_stalls_total", role="writer")) == (2, 1)


def test_a_cumulative_counter_left_out_or_dropped_keeps_its_value(committer):
    """REVIEW (2026-12-05): a report that left a cumulative counter out, or sent a value dropped as invalid,
    took the counter back to nothing."""
    raw = committer.client()
    try:
        assert isinstance(raw.hello(protocol.ROLE_READER, protocol.Layout(16, 4)), protocol.Welcome)
        for counters in ({"hit_tokens": 1000.0}, {"hit_tokens": float("nan")}, {}):
            assert isinstance(raw.call(protocol.Heartbeat(rid=raw.next_rid(), counters=counters)),
                              protocol.HeartbeatAck)
            me = [c for c in raw.status()["clients"] if c["client_id"] == raw.client_id][0]
            assert me["counters"] == {"hit_tokens": 1000.0}, (counters, me["counters"])
    finally:
        raw.close()


def test_held_connections_cannot_take_the_metrics_threads_or_fds_beyond_a_bound(monkeypatch):
    """REVIEW (2026-12-05, stop 42, metrics): the metrics port is reachable by every local user. A client
    trickling a header byte every few seconds passed each read's timeout and kept its thread and fd for good;
    a few hundred such connections took a committer to its fd limit, and libzmq aborted it (SIGABRT) at its
    next accept. At most ``HTTP_MAX_CONNECTIONS`` are served at once (more are closed at accept), and each
    lives at most ``HTTP_TIMEOUT_S`` (1 s in the second part), however it trickles."""
    import threading
    from types import SimpleNamespace

    from omnishm.committer import metrics

    stub = SimpleNamespace(cfg=SimpleNamespace(name="stub"), stopping=False, stop_reason="",
                           pool=SimpleNamespace(keys={}))
    obs = metrics.Observability(stub, tick_s=1.0)
    obs.tick(time.monotonic())

    def held(port: int, n: int) -> list[socket.socket]:
        conns = []
        for _ in range(n):
            c = socket.create_connection(("127.0.0.1", port), timeout=5)
            c.sendall(b"GET /health HTTP/1.1\r\n")  # never ends its headers
            conns.append(c)
        return conns

    def cut(c: socket.socket) -> bool:
        try:
            c.sendall(b"X")  # a header byte now and then: each read's timeout alone never fires
            c.settimeout(0.01)
            return c.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:  # reset
            return True

    port = free_port()
    exporter = metrics.MetricsExporter(obs, "127.0.0.1", port)
    threads_before = threading.active_count()
    conns = held(port, metrics.HTTP_MAX_CONNECTIONS + 8)
    try:
        deadline = time.monotonic() + 10
        while exporter.server.refused < 8:  # the surplus is closed at accept
            assert time.monotonic() < deadline, exporter.server.refused
            time.sleep(0.02)
        assert threading.active_count() <= threads_before + metrics.HTTP_MAX_CONNECTIONS
        assert sum(cut(c) for c in conns) == 8  # the others are still served (their 10 s are not up)
    finally:
        for c in conns:
            c.close()
        exporter.close()

    monkeypatch.setattr(metrics, "HTTP_TIMEOUT_S", 1.0)
    port = free_port()
    exporter = metrics.MetricsExporter(obs, "127.0.0.1", port)
    conns = held(port, 4)
    try:
        t0 = time.monotonic()
        alive = list(conns)
        while alive:
            assert time.monotonic() - t0 < 10, f"{len(alive)} of {len(conns)} connections live after 10 s"
            alive = [c for c in alive if not cut(c)]
            time.sleep(0.2)
        assert time.monotonic() - t0 >= 0.8  # cut by the deadline, not at once
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        for c in conns:
            c.close()
        exporter.close()


def test_a_departed_clients_gauge_leaves_and_per_role_sums_are_sums(committer_factory):
    """MUTATION (2026-12-06): three survivors of the committer's metrics. A Goodbye that no longer told the
    metrics the client departed left its ``staging_pages_in_use`` gauge in the role's sum (7 instead of 4); a
    role's resident bytes were one client's, not the sum; and the ``decode_`` prefix could go from a decode
    error's reason label unseen."""
    port = free_port()
    h = committer_factory("--metrics-port", str(port))
    a, b = RawClient(h.endpoint, h.name), RawClient(h.endpoint, h.name)
    layout = protocol.Layout(num_blocks=NUM_BLOCKS, block_size=BS)
    try:
        for c, pages in ((a, 3.0), (b, 4.0)):
            assert isinstance(c.hello(protocol.ROLE_READER, layout), protocol.Welcome)
            ack = c.call(protocol.Heartbeat(rid=c.next_rid(), counters={"staging_pages_in_use": pages,
                                                                        "steps_saved": 2.0}))
            assert isinstance(ack, protocol.HeartbeatAck), ack
        m = scrape(port)
        assert value(m, "omnishm_client_staging_pages_in_use", role="reader") == 7.0
        rss = [c["rss_bytes"] for c in h.status()["clients"] if c["role"] == "reader"]
        assert len(rss) == 2 and value(m, "omnishm_process_resident_bytes", role="reader") >= 1.5 * max(rss)
        assert isinstance(a.goodbye(), protocol.Bye)
        m = scrape(port)
        assert value(m, "omnishm_client_staging_pages_in_use", role="reader") == 4.0
        assert value(m, "omnishm_client_steps_saved_total", role="reader") == 4.0  # the departed one still counts
        b.send_raw(b"\xc1 not msgpack")
        assert b.recv().code == "decode"
        assert value(scrape(port), "omnishm_rejected_messages_total", reason="decode_msgpack") == 1.0
        assert isinstance(b.goodbye(), protocol.Bye)
    finally:
        a.close()
        b.close()


def test_the_throughput_window_health_bound_and_queue_depth_of_the_metrics():
    """MUTATION (2026-12-06): three survivors of ``committer/metrics.py``. A ring that sampled at every tick
    (``<=`` for ``>=``) shrank the throughput window from about 10 s to 1.1 s; a health bound of
    ``min(5 s, ...)`` for ``max`` reported a committer with a 0.1 s tick unhealthy after 0.5 s of loop silence;
    and ``omnishm_queue_depth`` one off the batch size."""
    from types import SimpleNamespace

    from omnishm.committer.metrics import Observability, _SnapshotCollector

    ring = ThroughputRing(sample_s=1.0, window_s=10.0)
    for i in range(301):  # a tick every 0.1 s for 30 s
        ring.maybe_sample(i / 10, i * 10, i * 100)
    rates = ring.rates(30.0, 3000, 30000)
    assert 9.0 <= rates["window_s"] <= 11.0 and rates["rows_per_s"] == pytest.approx(100.0), rates
    stub = SimpleNamespace(cfg=SimpleNamespace(name="stub", metrics_port=0), stopping=False, stop_reason="",
                           pool=SimpleNamespace(keys={}))
    obs = Observability(stub, tick_s=0.1)
    obs.last_tick = time.monotonic() - 2.0
    assert obs.healthy()[0], obs.healthy()
    now = time.monotonic()
    obs.batch_done(3, now, now)
    families = {f.name: f for f in _SnapshotCollector(obs).collect()}
    assert families["omnishm_queue_depth"].samples[0].value == 3


# Mutation review (2026-12-06).


def test_the_committers_own_resident_and_shared_bytes_are_each_in_their_own_metric(committer_factory):
    """``omnishm_process_resident_bytes{role="committer"}`` is the committer's resident set and
    ``omnishm_process_shared_bytes{role="committer"}`` its shared part (/proc statm), each in its own family:
    the shared part is at most the resident set, and the resident figure is the one /proc shows for the
    committer's pid (within a factor of two: the process moves between the two reads)."""
    port = free_port()
    handle = committer_factory("--metrics-port", str(port))
    m = scrape(port)
    resident = value(m, "omnishm_process_resident_bytes", role="committer")
    shared = value(m, "omnishm_process_shared_bytes", role="committer")
    with open(f"/proc/{handle.proc.pid}/statm") as f:
        statm = [int(x) * os.sysconf("SC_PAGE_SIZE") for x in f.read().split()]
    assert resident is not None and shared is not None
    assert 0 < shared < resident, (resident, shared, statm)
    assert statm[1] / 2 <= resident <= statm[1] * 2, (resident, statm)


def test_more_scrapes_than_the_connection_bound_one_after_another_are_all_served(committer_factory):
    """``HTTP_MAX_CONNECTIONS`` bounds the connections open *at once*, not how many a committer serves in its
    life: a finished scrape gives its slot back. Sequential ``/health`` and ``/metrics`` requests, three
    times the bound, each get their answer (a Prometheus server scrapes every few seconds for days)."""
    from omnishm.committer.metrics import HTTP_MAX_CONNECTIONS
    from test_metrics import get

    port = free_port()
    handle = committer_factory("--metrics-port", str(port))
    for i in range(3 * HTTP_MAX_CONNECTIONS):
        code, text = get(f"http://127.0.0.1:{port}/health")
        assert code == 200 and handle.name in text, (i, code, text)
    assert value(scrape(port), "omnishm_uptime_seconds") > 0  # /metrics too, after all of them
