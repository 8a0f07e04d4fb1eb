"""A peer that lies about its progress (issue 26's `sample_liar`), for benchmarks and tests.

It joins a run's DHT with an identity of its own and, once the swarm reaches `--from-epoch`, every REFRESH_S,
publishes a signed trainer record that claims the whole target batch at the swarm's epoch (the upper median of
the live trainers' epochs) and a huge speed. It never trains and never averages: its samples would reach no model. It uses the product's own record
and DHT code, so what the honest peers read is exactly what a hostile peer could publish.

    python -m moshpeer.adversaries.sample_liar --run-id RUN --initial-peers MADDR [MADDR ...] --target-batch-size N
        [--from-epoch E]

Prints one JSON line, {"event": "ready", "peer_id": ...}, once its DHT node runs (before its first lie), then runs until it is
killed (SIGTERM or SIGINT end it at the next refresh). Exit code 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from moshpeer.adversaries.process import run_until_signalled, swarm_epoch
from moshpeer.dht import start_dht
from moshpeer.peer.record_publisher import RecordPublisher, fresh_record

REFRESH_S = 0.5  # as often as an honest peer near its epoch's end reads and publishes
CLAIMED_RATE = 1e6  # samples per second it says it computes
EXPIRATION_S = 10.0


def lie(run_id: str, initial_peers, target_batch_size: int, host: str, stop: threading.Event,
        from_epoch: int = 0) -> None:
    """From the swarm's epoch `from_epoch` on, publish the lie every REFRESH_S until `stop` is set."""
    dht = start_dht(initial_peers=initial_peers, run_ids=[run_id], host_maddrs=[f"/ip4/{host}/tcp/0"])
    try:
        record = fresh_record(dht, "trainer").updated(training=True, target_batch_size=target_batch_size,
                                                       samples_per_second=CLAIMED_RATE)
        publisher = RecordPublisher(dht, run_id, record, expiration=EXPIRATION_S)
        print(json.dumps({"event": "ready", "peer_id": record.peer_id}), flush=True)
        while not stop.is_set():
            epoch = swarm_epoch(dht, run_id, (record.peer_id,))
            if epoch >= from_epoch:
                publisher.update(epoch=epoch, samples_accumulated=target_batch_size)
                publisher.publish(timeout=2.0)
            stop.wait(REFRESH_S)
    finally:
        dht.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moshpeer.adversaries.sample_liar", description=__doc__.splitlines()[0])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--target-batch-size", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address its DHT node listens on")
    parser.add_argument("--from-epoch", type=int, default=0,
                        help="lie once the swarm reaches this epoch (1: join a swarm that already trains)")
    args = parser.parse_args(argv)
    if args.target_batch_size <= 0:
        parser.error("--target-batch-size must be positive")
    return run_until_signalled("sample_liar", lambda stop: lie(args.run_id, args.initial_peers,
                                                               args.target_batch_size, args.host, stop,
                                                               args.from_epoch))


if __name__ == "__main__":
    sys.exit(main())
