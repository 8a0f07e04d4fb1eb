"""Prometheus metrics of one peer process (`moshpeer join|dht|demo --metrics-port N`).

Every process has its own `CollectorRegistry` (never prometheus-client's global one, so a program that
embeds several peers, or a test, keeps them apart) and serves it at `http://HOST:N/metrics`. The
metrics are fed from what the code already produces: `observe_round` is the one adapter from a
collaborative round (its averaging round result included) to metric updates; the training loop adds
loss and metric, state downloads and checkpoint writes. Names follow Prometheus conventions; see
docs/operations.md ("Prometheus metrics") for the list and docs/grafana/moshpeer.json for a dashboard over them.
"""

from __future__ import annotations

import socket
from typing import Any, Dict, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.process_collector import ProcessCollector

from moshpeer.errors import UserError

# Seconds: a round on a LAN takes well under a second, on shaped links or with stragglers up to minutes.
ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TRANSFER_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
# The data plane's two phases, as RoundResult names them (its `reduce` and `gather` PhaseStats).
PHASES = (("reduce_scatter", "reduce"), ("all_gather", "gather"))


class PeerMetrics:
    """The metrics of one peer, in a registry of its own; `serve(port)` exposes them over HTTP.

    :param run_id, peer_id, role, command: constant labels of `moshpeer_peer_info`
    """

    def __init__(self, *, run_id: str = "", peer_id: str = "", role: str = "", command: str = ""):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        r = self.registry
        self.info = Gauge("moshpeer_peer_info", "Always 1; labels say which peer this is.",
                          ("run_id", "peer_id", "role", "command"), registry=r)
        self.set_identity(run_id=run_id, peer_id=peer_id, role=role, command=command)
        self.rounds = Counter("moshpeer_rounds", "Collaborative rounds by outcome: averaged with a group, "
                              "alone (no other peer), failed (no group, or the round broke).", ("outcome",),
                              registry=r)
        self.round_seconds = Histogram("moshpeer_round_seconds", "Seconds per averaging-round phase: "
                                       "matchmaking, reduce_scatter, all_gather, and total (data plane).",
                                       ("phase",), buckets=ROUND_BUCKETS, registry=r)
        self.sent_bytes = Counter("moshpeer_sent_bytes", "Averaging bytes this peer sent, by phase.", ("phase",),
                                  registry=r)
        self.received_bytes = Counter("moshpeer_received_bytes", "Averaging bytes this peer received, by phase.",
                                      ("phase",), registry=r)
        self.chunks_expected = Counter("moshpeer_chunks_expected", "Chunks this peer should have received, "
                                       "by phase.", ("phase",), registry=r)
        self.chunks_lost = Counter("moshpeer_chunks_lost", "Chunks expected but never usable (not sent, late, "
                                   "rejected), by phase.", ("phase",), registry=r)
        self.rejected_connections = Counter("moshpeer_rejected_connections", "Data-plane connections refused "
                                            "(strangers, failed authentication).", registry=r)
        self.connections_kept = Counter("moshpeer_connections_kept", "Data-plane connections rebound from an earlier "
                                        "round instead of opened (kept between rounds).", registry=r)
        self.admission_refused = Counter("moshpeer_admission_refused", "Private run: peers refused, by point "
                                         "(records, matchmaking, dataplane, state).", ("point",), registry=r)
        self.rejected_messages = Counter("moshpeer_rejected_messages", "Data-plane messages rejected (malformed, "
                                         "bad sizes, non-finite values, duplicates).", registry=r)
        self.group_size = Gauge("moshpeer_group_size", "Size of the group of the last round (1: alone).",
                                registry=r)
        self.epoch = Gauge("moshpeer_epoch", "This peer's collaborative epoch.", registry=r)
        self.swarm_trainers = Gauge("moshpeer_swarm_trainers", "Trainers this peer saw in the swarm.", registry=r)
        self.swarm_samples_capped = Gauge("moshpeer_swarm_samples_capped", "Samples of the last epoch that other "
                                          "trainers claimed beyond what this peer found credible.", registry=r)
        self.samples = Counter("moshpeer_samples", "Samples this peer contributed.", registry=r)
        self.samples_per_second = Gauge("moshpeer_samples_per_second", "This peer's recent training throughput.",
                                        registry=r)
        self.loss = Gauge("moshpeer_loss", "Mean training loss of the last epoch.", registry=r)
        self.metric = Gauge("moshpeer_metric", "The task's evaluation metric, last evaluated.", ("name",),
                            registry=r)
        self.state_downloads = Counter("moshpeer_state_downloads", "State downloads from donors, by outcome.",
                                       ("outcome",), registry=r)
        self.state_download_seconds = Histogram("moshpeer_state_download_seconds", "Seconds per successful "
                                                "state download.", buckets=TRANSFER_BUCKETS, registry=r)
        self.state_download_bytes = Counter("moshpeer_state_download_bytes", "Bytes of downloaded state.",
                                            registry=r)
        self.checkpoint_writes = Counter("moshpeer_checkpoint_writes", "Checkpoint files written, by kind "
                                         "(periodic, final).", ("kind",), registry=r)
        self.checkpoint_write_seconds = Histogram("moshpeer_checkpoint_write_seconds", "Seconds per checkpoint "
                                                  "write.", buckets=TRANSFER_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter("moshpeer_checkpoint_bytes", "Bytes of checkpoint files written.",
                                        registry=r)
        self.checkpoint_failures = Counter("moshpeer_checkpoint_failures", "Checkpoint writes that failed (a full "
                                           "disk, no permission): the newest checkpoint is older than planned.",
                                           registry=r)
        self._server = None
        self.port: Optional[int] = None  # where `serve` listens
        self._checkpoints_seen = 0
        self._checkpoint_failures_seen = 0
        self._refusals_seen: Dict[str, int] = {}

    def set_identity(self, *, run_id: str, peer_id: str, role: str, command: str) -> None:
        """(Re)label `moshpeer_peer_info` once the peer id is known."""
        self.info.clear()
        self.info.labels(run_id=run_id, peer_id=peer_id, role=role, command=command).set(1)

    # ---- HTTP ---------------------------------------------------------------------------------

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve `/metrics` on `host:port` from a daemon thread; returns the port (0: any free one).

        :raises UserError: the port is in use or not ours to bind
        """
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        self.port = self._server.server_address[1]
        return self.port

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- feeding ------------------------------------------------------------------------------

    def observe_round(self, round_: Any) -> None:
        """The one adapter from a collaborative round to metric updates.

        `round_` is a `CollaborativeRound`; its `result` (the averaging round's `RoundResult`, None when
        no round ran) carries the data-plane counters."""
        result = getattr(round_, "result", None)
        outcome = "averaged" if round_.ok else ("alone" if round_.error == "alone" else "failed")
        self.rounds.labels(outcome=outcome).inc()
        self.epoch.set(round_.epoch + 1)
        self.samples.inc(max(int(round_.samples), 0))
        self.swarm_trainers.set(round_.num_trainers)
        self.swarm_samples_capped.set(round_.swarm_samples_capped)
        self.group_size.set(round_.group_size if round_.ok else 1)
        if result is None:
            return
        self.round_seconds.labels(phase="matchmaking").observe(result.matchmaking_s)
        self.rejected_connections.inc(result.rejected_connections)
        self.rejected_messages.inc(result.rejected_messages)
        self.connections_kept.inc(result.connections_kept)
        if not result.ok:
            return
        self.round_seconds.labels(phase="reduce_scatter").observe(result.reduce_scatter_s)
        self.round_seconds.labels(phase="all_gather").observe(result.all_gather_s)
        self.round_seconds.labels(phase="total").observe(result.total_s)
        for phase, attribute in PHASES:
            stats = getattr(result, attribute)
            self.sent_bytes.labels(phase=phase).inc(stats.bytes_sent)
            self.received_bytes.labels(phase=phase).inc(stats.bytes_received)
            self.chunks_expected.labels(phase=phase).inc(stats.chunks_expected)
            self.chunks_lost.labels(phase=phase).inc(stats.chunks_lost)

    def observe_refusals(self, refused: Mapping[str, int]) -> None:
        """A private run's refusals so far, per point (`Admission.refused`: running totals)."""
        for point, total in refused.items():
            new = total - self._refusals_seen.get(point, 0)
            if new > 0:
                self.admission_refused.labels(point=point).inc(new)
                self._refusals_seen[point] = total

    def observe_training(self, *, samples_per_second: float, loss: Optional[float],
                         metrics: Optional[Mapping[str, float]] = None) -> None:
        """After an epoch: throughput, the epoch's mean loss (None: no batch) and fresh evaluation metrics."""
        self.samples_per_second.set(samples_per_second)
        if loss is not None:
            self.loss.set(loss)
        for name, value in (metrics or {}).items():
            self.metric.labels(name=name).set(value)

    def observe_state_download(self, *, seconds: Optional[float], nbytes: int, failed_donors: int) -> None:
        """A catch-up: `failed_donors` donors failed before one delivered (seconds None: none delivered)."""
        self.state_downloads.labels(outcome="failed").inc(failed_donors)
        if seconds is not None:
            self.state_downloads.labels(outcome="ok").inc()
            self.state_download_seconds.observe(seconds)
            self.state_download_bytes.inc(nbytes)

    def observe_checkpoints(self, stats: Any, *, kind: str = "periodic") -> None:
        """Checkpoint writes finished (and failed) since the last call, read from a checkpoint store's `StoreStats`
        (saved, failed, last_write_s, last_size). Polled: writes that finish between two calls are all counted,
        with the duration and size of the latest."""
        if stats.failed > self._checkpoint_failures_seen:
            self.checkpoint_failures.inc(stats.failed - self._checkpoint_failures_seen)
            self._checkpoint_failures_seen = stats.failed
        new = stats.saved - self._checkpoints_seen
        if new <= 0:
            return
        self._checkpoints_seen = stats.saved
        self.checkpoint_writes.labels(kind=kind).inc(new)
        for _ in range(new):
            self.checkpoint_write_seconds.observe(stats.last_write_s)
        self.checkpoint_bytes.inc(new * stats.last_size)


def check_metrics_port(port: int, host: str = "0.0.0.0") -> None:
    """UserError unless `port` is a valid TCP port that is free on `host` now (checked before a peer starts)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--metrics-port {port} is not a TCP port (0-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UserError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from None
