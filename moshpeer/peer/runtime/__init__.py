"""A peer process: `PeerDaemon` (DHT membership, heartbeat, signals, shutdown; daemon.py), preemption notices
(preemption.py), the training loop of `moshpeer join` (trainer.py), Prometheus metrics (metrics.py) and the
round health a peer publishes (health.py)."""
