"""Mutation review of ``committer/metrics.py`` (stop 60): what an operator reads off the metrics port.

Each test names the survivors it kills: a /health that said 200 for a silent loop, a loop that ticked but
was still reported silent, a scrape that waited for the loop far longer than documented (or always its whole
second), a negative queue age, and client counter totals that double counted a returning client or went back.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from helpers import free_port
from prometheus_client.parser import text_string_to_metric_families
from test_metrics import get, others_depart, scrape, value

from omnishm.committer import metrics
from omnishm.committer.metrics import (
    RETAIN_DEPARTED_IDS,
    RETAIN_FOLDED_IDS,
    ClientCounterTotals,
    Observability,
    _SnapshotCollector,
)


def scrape_path(port: int, path: str) -> dict:
    code, text = get(f"http://127.0.0.1:{port}{path}")
    assert code == 200, (path, code, text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def stub_obs(tick_s: float = 1.0) -> Observability:
    stub = SimpleNamespace(cfg=SimpleNamespace(name="stub", metrics_port=0), stopping=False, stop_reason="",
                           pool=SimpleNamespace(keys={}))
    return Observability(stub, tick_s=tick_s)


def test_health_over_http_is_503_for_a_silent_or_stopping_loop_and_a_stuck_loop_does_not_hold_a_scrape():
    """``/health`` is what a liveness probe reads: its status code, not its text, must say 503 when the loop is
    silent or stopping, and 200 again once the loop ticks. A scrape of ``/metrics`` while the loop is stuck
    waits for a fresh snapshot about a second (``max(1 s, 2 ticks)``), then answers with what it has: the
    loop's tick age shows the stall. MUTATION: ``200 if ok else 503`` -> ``200``; no ``last_tick`` update in
    ``tick``; a scrape waiting 30 s for the loop."""
    obs = stub_obs(tick_s=0.1)  # a scrape waits max(1 s, 2 ticks) for the loop
    obs.tick(time.monotonic())
    port = free_port()
    exporter = metrics.MetricsExporter(obs, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{url}/health")[0] == 200
        assert get(f"{url}/healthz?probe=1")[0] == 200  # a query string is not part of the path
        assert value(scrape_path(port, "/metrics?name[]=x"), "omnishm_queue_depth") == 0
        obs.last_tick -= obs.health_timeout_s + 1  # the loop went silent
        code, text = get(f"{url}/health")
        assert code == 503 and "silent" in text, (code, text)
        t0 = time.monotonic()
        m = scrape(port)  # nothing ticks here: no snapshot comes, the scrape still answers
        took = time.monotonic() - t0
        assert 0.8 <= took < 10.0, took  # the mutant: 30 s
        assert value(m, "omnishm_loop_tick_age_seconds") > obs.health_timeout_s
        obs.tick(time.monotonic())  # the loop ticks again: healthy again
        assert get(f"{url}/health")[0] == 200
        obs.committer.stopping, obs.committer.stop_reason = True, "SIGTERM"
        assert get(f"{url}/health") == (503, "stopping (SIGTERM)\n")
    finally:
        exporter.close()


def test_a_tick_after_silence_makes_the_loop_healthy_and_the_queue_age_is_how_long_the_last_message_waited():
    """MUTATION: ``tick`` not recording ``last_tick`` (a live committer turned 503 five seconds after its start
    and stayed so); ``queue_age_s`` with its sign flipped (a negative age)."""
    obs = stub_obs(tick_s=0.1)
    obs.last_tick = time.monotonic() - 60
    assert not obs.healthy()[0]
    obs.tick(time.monotonic())
    assert obs.healthy()[0], obs.healthy()
    now = time.monotonic()
    obs.batch_done(5, now - 0.25, now)
    fams = {f.name: f for f in _SnapshotCollector(obs).collect()}
    assert fams["omnishm_queue_oldest_age_seconds"].samples[0].value == pytest.approx(0.25)


def test_a_scrape_of_a_busy_committer_gets_the_loops_snapshot_at_its_next_tick(committer_factory):
    """The HTTP thread asks, the loop builds one snapshot at its next round and says so: with a 0.05 s tick a
    scrape answers in a fraction of a second. MUTATION: the loop not setting ``_fresh`` made every scrape
    wait its whole second (10 scrapes: 10 s)."""
    port = free_port()
    committer_factory("--metrics-port", str(port), "--heartbeat-s", "0.05")
    scrape(port)
    t0 = time.monotonic()
    for _ in range(10):
        assert value(scrape(port), "omnishm_uptime_seconds") > 0
    assert time.monotonic() - t0 < 8.0  # the mutant: 10 s


def test_several_folded_clients_coming_back_each_count_once():
    """REVIEW (2026-12-05) kept departed clients' folded contributions (``RETAIN_FOLDED_IDS`` of them) so that
    a return takes them out again. MUTATION: keeping only the newest folded entry, or trimming the newest
    instead of the oldest, counted a returning client twice; a gauge folded into the cumulative totals."""
    t = ClientCounterTotals()
    t.heartbeat("x", "reader", {"hit_tokens": 100, "staging_pages_in_use": 3})
    t.departed("x")
    t.heartbeat("y", "reader", {"hit_tokens": 50})
    t.departed("y")
    others_depart(t, "hit_tokens", "f")  # x and y folded
    want = {"hit_tokens": 150.0 + RETAIN_DEPARTED_IDS}
    assert t.totals()["reader"] == want
    t.heartbeat("x", "reader", {"hit_tokens": 100})
    t.heartbeat("y", "reader", {"hit_tokens": 50})
    assert t.totals()["reader"] == want

    t = ClientCounterTotals()
    n = RETAIN_FOLDED_IDS + RETAIN_DEPARTED_IDS + 1  # one more folded than kept: the oldest is forgotten
    for i in range(n):
        cid = "y" if i == RETAIN_FOLDED_IDS else f"f{i}"  # y: the newest folded
        t.heartbeat(cid, "reader", {"hit_tokens": 10 if cid == "y" else 1})
        t.departed(cid)
    want = {"hit_tokens": float(n - 1 + 10)}
    assert t.totals()["reader"] == want
    t.heartbeat("y", "reader", {"hit_tokens": 10})
    assert t.totals()["reader"] == want


def test_a_folded_client_back_in_another_role_and_then_its_old_one_takes_nothing_out():
    """A folded reader back as a writer: its folded entry is done (the reader's values stay for good). Back as
    a reader later, its counters start again, and nothing of the old reader's may be taken out. MUTATION:
    keeping the folded entry unless the role matched took the readers' total back by 100."""
    t = ClientCounterTotals()
    t.heartbeat("x", "reader", {"hit_tokens": 100})
    t.departed("x")
    others_depart(t, "hit_tokens")
    t.heartbeat("x", "writer", {})
    t.departed("x")
    t.heartbeat("x", "reader", {"hit_tokens": 7})
    assert t.totals()["reader"] == {"hit_tokens": 107.0 + RETAIN_DEPARTED_IDS}


def test_the_loop_builds_a_snapshot_only_when_a_scrape_asks_and_once_per_ask():
    """A snapshot reads every key's commit table and every client's /proc: the loop builds one at the round
    after a scrape asked, and not again until the next ask. MUTATION: the request not cleared, so after the
    first scrape the loop built a snapshot at every round for good."""
    obs = stub_obs(tick_s=0.1)
    built = []
    obs.committer.status = lambda: built.append(1) or {}
    obs._exporter = SimpleNamespace()  # metrics on (no server needed: the ask is made by hand)
    for _ in range(3):
        obs.tick(time.monotonic())
    assert built == []
    assert obs.fresh_snapshot(0.0) is None  # asks; the loop has not ticked yet
    for _ in range(5):
        obs.tick(time.monotonic())
    assert len(built) == 1 and obs.snapshot == {"client_gauges": {}}


def test_a_connection_whose_thread_could_not_start_gives_its_slot_back(monkeypatch):
    """A handler thread that cannot start (``can't start new thread`` at a thread or memory limit) leaves the
    connection to the serving thread, which closes it and must give its slot back. MUTATION: the slot kept:
    after ``HTTP_MAX_CONNECTIONS`` such failures every later connection was closed at accept, and the
    metrics port stayed dead after the limit passed."""
    import socketserver

    obs = stub_obs(tick_s=0.1)
    obs.tick(time.monotonic())
    port = free_port()
    exporter = metrics.MetricsExporter(obs, "127.0.0.1", port)
    real = socketserver.ThreadingMixIn.process_request
    try:
        def no_thread(self, request, client_address):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", no_thread)
        for _ in range(metrics.HTTP_MAX_CONNECTIONS + 2):
            with pytest.raises(OSError):
                get(f"http://127.0.0.1:{port}/health")
        monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", real)
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert exporter.server.refused == 0
    finally:
        monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", real)
        exporter.close()


SPIN = r"""
import os, resource, socket, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 64,) * 2)
from types import SimpleNamespace
from omnishm.committer import metrics
stub = SimpleNamespace(cfg=SimpleNamespace(name="stub", metrics_port=0), stopping=False, stop_reason="",
                       pool=SimpleNamespace(keys={}))
obs = metrics.Observability(stub, tick_s=0.1)
exporter = metrics.MetricsExporter(obs, "127.0.0.1", 0)
port = exporter.server.server_address[1]
c = socket.socket()
fds = []
try:
    while True:
        fds.append(socket.socket())
except OSError:
    pass
c.connect(("127.0.0.1", port))  # completes in the backlog; no fd is left for the server's accept
time.sleep(0.3)
t0 = time.process_time()
time.sleep(1.0)
cpu = time.process_time() - t0
for f in fds:
    f.close()
assert len(fds) > 10
print(cpu)
"""


def test_a_committer_out_of_fds_does_not_spin_its_metrics_thread_on_accept(tmp_path):
    """At its fd limit the listener stays readable and each accept fails with EMFILE: without a pause the
    serving thread spun on it, a core and the GIL the committer's loop needs. MUTATION: the pause dropped
    (0.3 to 1 s of CPU per second instead of about 1 ms)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "spin.py"
    script.write_text(SPIN)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 0.1, out.stdout
