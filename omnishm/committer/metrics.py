"""What the committer tells operators: throughput ring, client counters, Prometheus, ``/health``.

Threads and ownership
- The committer's loop thread is the only one that calls ``Observability``
  methods (``tick``, ``batch_done``, ``step_applied``, ``heartbeat``,
  ``departed``, ``status_extras``) and the only one that reads committer state.
- With ``--metrics-port`` set, a daemon HTTP thread (``omnishm-metrics``)
  serves ``/metrics`` and ``/health``. It never touches committer state: a
  scrape asks the loop for a snapshot (built at the loop's next round, only
  when asked: it reads every key's commit table) and waits for it up to about a
  second, else uses the previous one; it also reads the few live floats (last
  tick, queue gauges) and the write-latency histogram (``prometheus_client``
  metrics carry their own lock). A scrape never blocks the loop, and a stuck
  loop shows as 503. A connection lives at most ``HTTP_TIMEOUT_S``, at most
  ``HTTP_MAX_CONNECTIONS`` are served at once (more are closed at accept), and
  broken ones are logged at debug level, not as tracebacks.

``prometheus_client`` is optional: it is imported only when metrics are on
(``require_prometheus`` raises a clear error when it is missing).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from omnishm import protocol

if TYPE_CHECKING:
    from omnishm.committer.server import Committer
    from omnishm.committer.sessions import Session

logger = logging.getLogger("omnishm.committer.metrics")

WRITE_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0)
CLIENT_COUNTERS: dict[str, str] = {
    "steps_saved": "steps saved by writers and readers (save_outputs calls)",
    "hit_tokens": "prefix-hit tokens materialized",
    "hit_rows_served": "hit rows served from the shared pool (tokens x tensors)",
    "rows_served": "rows returned by materialize (hit + step rows, tokens x tensors)",
    "cow_rescues": "rows copied out of slots about to be reused (copy-on-write rescues)",
    "unmatch_errors": "OmniPrefixCacheUnmatchError raised to the engine",
    "save_seconds": "engine-thread seconds spent in save_outputs",
    "materialize_seconds": "seconds spent in materialize",
    "staging_waits": "saves that had to wait for a free staging page",
    "deferred_flushes": "deferred (join-on-finish) writes flushed",
    "budget_flushes": "deferred writes forced out by the gpu_staging_bytes budget or by their length",
    "deferred_waits": "saves that waited for deferred writes to land (their clones over gpu_staging_bytes)",
    "prefetch_used": "hit spans (one request's rows of one tensor) a reader served from its prefetch",
    "prefetch_dropped": "hit spans the prefetch did not have (read in materialize instead)",
    "result_blocks_reused": "materialize results placed in recycled, pre-faulted host memory",
    "result_blocks_faulted": "materialize results that needed a new host block (first-touch page faults)",
    "token_checked_rows": "hit rows whose token and position (and chain of earlier tokens, where known) a "
                          "writer compared with what their slot holds",
    "token_mismatches": "hit rows a writer found computed for other tokens (each raised, never served)",
    "link_committer_lost": "times a client found its committer silent, gone or not knowing its session",
    "link_io_stalls": "times a client's link thread did not run for over max(1 s, 2 heartbeats) (its process starved "
                      "or frozen)",
}
"""Cumulative client counters exported as ``omnishm_client_<name>_total{role}`` (others are ignored)."""
CLIENT_GAUGES: dict[str, str] = {
    "staging_pages_in_use": "staging pages held by unconsumed steps (latest heartbeat of each live client)",
}
RETAIN_DEPARTED_IDS = 1024
RETAIN_FOLDED_IDS = 4096
"""Departed clients remembered after their values were folded into the role totals, so that one coming back
counts once (as many as the committer remembers reaped clients: ``Sessions.mark_reaped``)."""
HTTP_TIMEOUT_S = 10.0
"""The most one HTTP connection lives, whatever it sends: a client trickling one header byte a few seconds
apart passed every per-read timeout and kept its thread and fd for good (review: held connections took a
committer to its fd limit, and libzmq aborted it at its next accept)."""
HTTP_MAX_CONNECTIONS = 16
"""Connections served at once; more are closed as soon as they are accepted (scrapers need one or two)."""
MAX_COUNTER_NAME = 64
"""Longer client counter names are dropped on arrival (they are kept per departed client, 1024 of them)."""


def require_prometheus() -> None:
    """Raise ValueError with the fix when ``prometheus_client`` is not importable."""
    try:
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError:
        raise ValueError("--metrics-port needs the prometheus_client package: "
                         "`pip install prometheus_client` (or `pip install omnishm[metrics]`), "
                         "or leave metrics_port at 0") from None


# ---------------------------------------------------------------- throughput


class ThroughputRing:
    """Samples of (monotonic time, rows written, bytes written), one per ``sample_s``; loop thread only."""

    def __init__(self, sample_s: float = 1.0, window_s: float = 10.0):
        self.sample_s = sample_s
        self.window_s = window_s
        self._ring: collections.deque[tuple[float, int, int]] = collections.deque(
            maxlen=int(window_s / sample_s) + 2)

    def maybe_sample(self, now: float, rows: int, nbytes: int) -> None:
        if not self._ring or now - self._ring[-1][0] >= self.sample_s:
            self._ring.append((now, rows, nbytes))

    def rates(self, now: float, rows: int, nbytes: int) -> dict[str, float]:
        """Rows/s and bytes/s from the oldest sample within ``window_s`` (or the oldest kept) to now."""
        base = None
        for sample in self._ring:
            if now - sample[0] <= self.window_s + self.sample_s:
                base = sample
                break
        if base is None or now - base[0] <= 0:
            return {"window_s": 0.0, "rows_per_s": 0.0, "bytes_per_s": 0.0}
        dt = now - base[0]
        return {"window_s": round(dt, 3), "rows_per_s": (rows - base[1]) / dt, "bytes_per_s": (nbytes - base[2]) / dt}


# ---------------------------------------------------------------- client counters


@dataclass
class ClientCounterTotals:
    """Client counters summed per role; never decreasing across client departures.

    A heartbeat carries a client's cumulative values; the latest per live
    client counts, and a departed client's last values move into a per-role
    retained total. A client that comes back with the same id (re-hello, a
    resume after it was reaped) supersedes its departed entry, so it is not
    counted twice: the last ``RETAIN_DEPARTED_IDS`` departed clients are kept
    whole, and the ``RETAIN_FOLDED_IDS`` before them by what they added to the
    retained total, which a return takes out again (review: a client back
    after 1024 others had left was counted twice). Loop thread only.
    """

    live: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)
    departed_ids: collections.OrderedDict[str, tuple[str, dict[str, float]]] = field(
        default_factory=collections.OrderedDict)
    retained: dict[str, dict[str, float]] = field(default_factory=dict)
    folded: collections.OrderedDict[str, tuple[str, dict[str, float]]] = field(
        default_factory=collections.OrderedDict)
    """Client id -> (role, what it added to ``retained``), the latest ``RETAIN_FOLDED_IDS`` folded."""

    def heartbeat(self, client_id: str, role: str, counters: dict[str, float]) -> None:
        gone = self.departed_ids.pop(client_id, None)
        if gone is not None and gone[0] != role:
            # Back in another role (a second Hello on its socket): its values of the old role never come again,
            # and dropping them took a role's total back (review, 2026-12-06). They stay, folded for good.
            self._add(*gone)
        back = self.folded.pop(client_id, None)
        if back is not None and back[0] == role:  # its cumulative values come again: take out what it left behind
            old_role, added = back
            bucket = self.retained.get(old_role, {})
            for name, value in added.items():
                bucket[name] = bucket.get(name, 0.0) - value
        self.live[client_id] = (role, dict(counters))

    def _add(self, role: str, counters: dict[str, float]) -> dict[str, float]:
        """Add a departed client's cumulative ``counters`` to ``retained[role]``; returns what was added."""
        bucket = self.retained.setdefault(role, {})
        added = {name: float(value) for name, value in counters.items() if name in CLIENT_COUNTERS}
        for name, value in added.items():
            bucket[name] = bucket.get(name, 0.0) + value
        return added

    def departed(self, client_id: str) -> None:
        entry = self.live.pop(client_id, None)
        if entry is None:
            return
        self.departed_ids[client_id] = entry
        while len(self.departed_ids) > RETAIN_DEPARTED_IDS:  # fold the oldest into the role total
            gone, (role, counters) = self.departed_ids.popitem(last=False)
            self.folded[gone] = (role, self._add(role, counters))
            while len(self.folded) > RETAIN_FOLDED_IDS:
                self.folded.popitem(last=False)

    def totals(self) -> dict[str, dict[str, float]]:
        """role -> counter -> live sum + departed (cumulative counters only)."""
        out: dict[str, dict[str, float]] = {role: dict(v) for role, v in self.retained.items()}
        for role, counters in (*self.live.values(), *self.departed_ids.values()):
            bucket = out.setdefault(role, {})
            for name, value in counters.items():
                if name in CLIENT_COUNTERS:
                    bucket[name] = bucket.get(name, 0.0) + float(value)
        return out

    def gauges(self) -> dict[str, dict[str, float]]:
        """role -> gauge -> sum over live clients."""
        out: dict[str, dict[str, float]] = {}
        for role, counters in self.live.values():
            for name, value in counters.items():
                if name in CLIENT_GAUGES:
                    bucket = out.setdefault(role, {})
                    bucket[name] = bucket.get(name, 0.0) + float(value)
        return out


# ---------------------------------------------------------------- loop-side bookkeeping


class Observability:
    """The committer's operator view. Every method but the HTTP side runs on the loop thread."""

    def __init__(self, committer: Committer, *, tick_s: float):
        self.committer = committer
        self.cfg = committer.cfg
        self.ring = ThroughputRing()
        self.clients = ClientCounterTotals()
        self.tick_s = tick_s
        self.health_timeout_s = max(5.0, 5 * tick_s)
        self.last_tick = time.monotonic()
        self.queue_depth = 0
        self.queue_age_s = 0.0
        self.snapshot: dict[str, Any] | None = None
        self._wanted = threading.Event()  # set by a scrape; the loop then builds one snapshot
        self._fresh = threading.Event()
        self._exporter: MetricsExporter | None = None

    # -------------------------------------------------------- loop hooks

    def tick(self, now: float) -> None:
        """Called every loop round and after every receive batch: liveness, throughput samples, snapshots."""
        self.last_tick = now
        rows, nbytes = self._written()
        self.ring.maybe_sample(now, rows, nbytes)
        if self._exporter is not None and self._wanted.is_set():
            # Only when scraped: a snapshot reads every key's commit table and every client's /proc,
            # which on a large pool is milliseconds the loop's clients would wait for.
            self._wanted.clear()
            self.snapshot = self._build_snapshot()
            self._fresh.set()

    def batch_done(self, messages: int, received_at: float, now: float) -> None:
        """A receive batch of ``messages`` was handled; its last message waited ``now - received_at`` here."""
        self.queue_depth = messages
        self.queue_age_s = now - received_at
        self.tick(now)

    def step_applied(self, seconds: float) -> None:
        if self._exporter is not None:
            self._exporter.write_seconds.observe(seconds)

    def heartbeat(self, session: Session) -> None:
        self.clients.heartbeat(session.client_id, session.role, session.counters)

    def departed(self, session: Session) -> None:
        self.clients.departed(session.client_id)

    def status_extras(self, now: float) -> dict[str, Any]:
        """Throughput, the committer's own memory and the client counter totals, for ``status()``."""
        from omnishm.committer.sessions import proc_memory

        rows, nbytes = self._written()
        return {"throughput": self.ring.rates(now, rows, nbytes),
                "committer_memory": proc_memory(os.getpid()),
                "client_counters": self.clients.totals(),
                "metrics_endpoint": self._exporter.url if self._exporter is not None else None}

    def _written(self) -> tuple[int, int]:
        keys = self.committer.pool.keys.values()
        return sum(k.rows_written for k in keys), sum(k.bytes_written for k in keys)

    def _build_snapshot(self) -> dict[str, Any]:
        st = self.committer.status()
        st["client_gauges"] = self.clients.gauges()
        return st

    # -------------------------------------------------------- HTTP side

    def start_http(self) -> None:
        """Bind the metrics port (when configured) and serve it from a daemon thread. Raises OSError."""
        if not self.cfg.metrics_port:
            return
        require_prometheus()
        self.snapshot = self._build_snapshot()
        self._exporter = MetricsExporter(self, self.cfg.metrics_host, self.cfg.metrics_port)
        logger.info("committer %s: metrics on %s (/metrics, /health)", self.cfg.name, self._exporter.url)

    def stop_http(self) -> None:
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None

    def fresh_snapshot(self, timeout_s: float) -> dict[str, Any] | None:
        """HTTP thread: ask the loop for a new snapshot; the previous one if it does not come in time."""
        self._fresh.clear()
        self._wanted.set()
        self._fresh.wait(timeout_s)
        return self.snapshot

    def healthy(self) -> tuple[bool, str]:
        """Any thread: is the loop alive (ticked within ``health_timeout_s``, not stopping)?"""
        age = time.monotonic() - self.last_tick
        if self.committer.stopping:
            return False, f"stopping ({self.committer.stop_reason})"
        if age > self.health_timeout_s:
            return False, f"committer loop silent for {age:.1f}s (limit {self.health_timeout_s:.1f}s)"
        return True, f"ok: cache {self.cfg.name}, loop ticked {age:.2f}s ago"


# ---------------------------------------------------------------- Prometheus


class _SnapshotCollector:
    """Turns the loop's last published snapshot into metric families (runs on the HTTP thread)."""

    def __init__(self, obs: Observability):
        self.obs = obs

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        obs = self.obs
        st = obs.fresh_snapshot(max(1.0, 2 * obs.tick_s))
        yield GaugeMetricFamily("omnishm_queue_depth", "messages in the committer's most recent receive batch",
                                value=obs.queue_depth)
        yield GaugeMetricFamily("omnishm_queue_oldest_age_seconds",
                                "seconds the last message of the most recent batch waited inside the committer",
                                value=obs.queue_age_s)
        yield GaugeMetricFamily("omnishm_loop_tick_age_seconds", "seconds since the committer loop last ticked",
                                value=time.monotonic() - obs.last_tick)
        if st is None:
            return

        def gauge(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]):
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for values, v in rows:
                fam.add_metric(values, v)
            return fam

        def counter(name: str, doc: str, labels: list[str], rows: list[tuple[list[str], float]]):
            fam = CounterMetricFamily(name, doc, labels=labels)
            for values, v in rows:
                fam.add_metric(values, v)
            return fam

        keys = st["keys"]
        yield gauge("omnishm_committer_info", "committer identity (value 1)", ["cache", "generation", "pid"],
                    [([st["name"], st["generation"], str(st["pid"])], 1)])
        yield GaugeMetricFamily("omnishm_uptime_seconds", "seconds since the committer started",
                                value=st["uptime_s"])
        yield counter("omnishm_rows_written_total", "rows copied into the shared pool", ["tensor"],
                      [([k["name"]], k["rows_written"]) for k in keys])
        yield counter("omnishm_bytes_written_total", "bytes copied into the shared pool", ["tensor"],
                      [([k["name"]], k["bytes_written"]) for k in keys])
        yield counter("omnishm_rows_skipped_total",
                      "rows not written because a newer claim owns the slot or the row is committed under its version",
                      ["tensor"], [([k["name"]], k["rows_skipped"]) for k in keys])
        yield CounterMetricFamily("omnishm_steps_applied_total", "StepWrite messages applied",
                                  value=st["steps_applied"])
        yield CounterMetricFamily("omnishm_failed_steps_total", "StepWrite messages rejected by validation",
                                  value=st["steps_failed"])
        yield CounterMetricFamily("omnishm_failed_writes_total", "writes (tids) reported failed to the writer "
                                  "(a reaped writer's included)", value=st["tids_failed"] + st["tids_failed_reaped"])
        yield CounterMetricFamily("omnishm_messages_total", "messages received", value=st["messages"])
        reasons = dict(st["rejected"])
        for kind, n in st["decode_errors"].items():
            reasons[f"decode_{kind}"] = reasons.get(f"decode_{kind}", 0) + n
        yield counter("omnishm_rejected_messages_total", "messages answered with an error or refusal", ["reason"],
                      [([r], n) for r, n in sorted(reasons.items())])
        by_role = collections.Counter(c["role"] for c in st["clients"])
        yield gauge("omnishm_clients", "attached clients", ["role"],
                    [([role], by_role.get(role, 0)) for role in protocol.ROLES])
        yield CounterMetricFamily("omnishm_clients_reaped_total", "clients detached for heartbeat silence",
                                  value=st["clients_reaped"])
        yield CounterMetricFamily("omnishm_loop_stalls_total", "times the committer loop answered nothing for over "
                                  "max(1 s, 2 heartbeat periods)", value=st["loop_stalls"])
        mem: dict[str, list[float]] = {}
        for c in st["clients"]:
            acc = mem.setdefault(c["role"], [0.0, 0.0])
            acc[0] += c.get("rss_bytes", 0)
            acc[1] += c.get("shared_bytes", 0)
        own = st.get("committer_memory") or {}
        mem["committer"] = [own.get("rss_bytes", 0), own.get("shared_bytes", 0)]
        yield gauge("omnishm_process_resident_bytes", "resident bytes (/proc statm) summed per role", ["role"],
                    [([r], v[0]) for r, v in sorted(mem.items())])
        yield gauge("omnishm_process_shared_bytes", "shared resident bytes (/proc statm) summed per role", ["role"],
                    [([r], v[1]) for r, v in sorted(mem.items())])
        yield gauge("omnishm_mirror_bytes", "bytes of the shared pool (mirror) per tensor", ["tensor"],
                    [([k["name"]], k["pool_bytes"]) for k in keys])
        yield GaugeMetricFamily("omnishm_segment_bytes", "bytes of every segment (pool, tables, staging, control)",
                                value=st["segment_bytes"])
        yield GaugeMetricFamily("omnishm_capacity_rows", "rows the pool holds per tensor (num_blocks x block_size)",
                                value=(st["layout"] or {}).get("num_slots", 0))
        yield gauge("omnishm_committed_rows", "pool rows holding committed data", ["tensor"],
                    [([k["name"]], k["committed_rows"]) for k in keys])
        yield gauge("omnishm_committed_ratio", "committed rows / capacity rows (0..1)", ["tensor"],
                    [([k["name"]], k["committed_share"]) for k in keys])
        totals = st.get("client_counters") or {}
        for name, doc in CLIENT_COUNTERS.items():
            yield counter(f"omnishm_client_{name}_total", f"{doc}; summed over clients by role (via heartbeats)",
                          ["role"], [([role], v[name]) for role, v in sorted(totals.items()) if name in v])
        gauges = st.get("client_gauges") or {}
        for name, doc in CLIENT_GAUGES.items():
            yield gauge(f"omnishm_client_{name}", doc, ["role"],
                        [([role], v[name]) for role, v in sorted(gauges.items()) if name in v])


class MetricsExporter:
    """Private registry + loopback HTTP server on a daemon thread (``/metrics``, ``/health``)."""

    def __init__(self, obs: Observability, host: str, port: int):
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry(auto_describe=False)
        self.write_seconds = Histogram("omnishm_write_apply_seconds",
                                       "committer time to validate and apply one StepWrite",
                                       buckets=WRITE_BUCKETS, registry=self.registry)
        self.registry.register(_SnapshotCollector(obs))
        server_cls = _HTTPServer6 if ":" in host else _HTTPServer
        self.server = server_cls((host, port), _handler(obs, self.registry))
        bound = self.server.server_address
        self.url = f"http://[{bound[0]}]:{bound[1]}" if ":" in host else f"http://{bound[0]}:{bound[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="omnishm-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=2.0)


class _HTTPServer(ThreadingHTTPServer):
    """At most ``HTTP_MAX_CONNECTIONS`` connections, each for at most ``HTTP_TIMEOUT_S``: the metrics port is
    reachable by every local user (the ipc socket only by ours), and neither its threads nor its fds may grow
    with what they do. The serving thread enforces both (``process_request``, ``service_actions``); handler
    threads only take their connection out of ``_open`` when done. ``_lock`` guards ``_open``."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64  # socketserver's 5 dropped SYNs of a burst of scrapes: a 1 s retransmit each

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}
        """Connection -> when it is cut (monotonic)."""
        self.refused = 0
        """Connections closed at accept because ``HTTP_MAX_CONNECTIONS`` were open."""
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # The listener stays readable: without a pause this thread spun on accept, a core and the GIL.
                time.sleep(0.1)
            raise

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = len(self._open) >= HTTP_MAX_CONNECTIONS
            if not full:
                self._open[request] = time.monotonic() + HTTP_TIMEOUT_S
        if full:
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread could be started: the connection is ours to close
            with self._lock:
                self._open.pop(request, None)
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def service_actions(self) -> None:
        """Serving thread, between polls: cut connections past their deadline (their handler's read or write
        then ends, and its thread closes the socket)."""
        now = time.monotonic()
        with self._lock:
            late = [conn for conn, cut_at in self._open.items() if cut_at <= now]
        for conn in late:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile

    def handle_error(self, request, client_address) -> None:
        # A scraper that hangs up mid-reply is not the committer's error: no traceback in its log.
        logger.debug("metrics: connection from %s failed", client_address, exc_info=True)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


def _handler(obs: Observability, registry) -> type[BaseHTTPRequestHandler]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT_S  # an idle connection must not hold its thread forever

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/health", "/healthz"):
                ok, text = obs.healthy()
                self._reply(200 if ok else 503, (text + "\n").encode(), "text/plain; charset=utf-8")
            else:
                self._reply(404, b"omnishm committer: try /metrics or /health\n", "text/plain; charset=utf-8")

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            logger.debug("metrics %s: " + format, self.client_address[0], *args)

    return Handler
