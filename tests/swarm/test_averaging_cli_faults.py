"""`moshpeer join --faults SPEC`: a malformed spec is one clear line and exit code 2, before anything
starts; a valid one reaches the peer's averager and really drops its chunks in training rounds."""

from __future__ import annotations

import pytest

from swarm import LOOPBACK
from training_swarm import FAST_TRAINING, events, wait_event

pytestmark = pytest.mark.timeout(240)

MALFORMED = {
    "drop=2": "fault drop_prob must be within [0, 1], got 2.0",
    "drop": "bad fault setting 'drop' (expected key=value)",
    "delay=soon": "bad value for fault delay_s: 'soon'",
    "jitter=inf": "fault jitter_s must be a finite number of seconds",
    "drop=0.1,drop_prob=0.2": "fault drop_prob given twice",
    "phases=scatter": "fault phases must be among",
}


def test_malformed_fault_spec_is_one_clear_line(swarm):
    running = {spec: swarm.spawn("join", "--run-id", "faults", "--host-maddrs", LOOPBACK, "--faults", spec,
                                 "--max-epochs", "1", name=f"bad{i}")
               for i, spec in enumerate(MALFORMED)}
    for spec, proc in running.items():
        assert proc.wait_exit(120) == 2, proc.describe()
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and MALFORMED[spec] in lines[0], (spec, lines)


@pytest.mark.slow  # two training peers through the real CLI: ~45 s on the loaded 2-core machine
def test_fault_flag_drops_the_peers_chunks_in_training_rounds(swarm):
    """The lossy peer drops every reduce chunk it would send: its group mate receives none of them and
    reports them lost; the lossy peer itself still receives everything its mate sends."""
    run = "faults"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    common = ("join", "--initial-peers", *boot.maddrs, "--run-id", run, "--host-maddrs", LOOPBACK, *FAST_TRAINING,
              "--group-size", "2", "--min-peers", "2", "--max-epochs", "3", "--chunk-bytes", "4096")
    clean = swarm.spawn(*common, name="clean")
    lossy = swarm.spawn(*common, "--faults", "drop=1.0,phases=reduce", name="lossy")
    for peer in (clean, lossy):
        wait_event(peer, "done", timeout=200)
        assert peer.wait_exit(30) == 0, peer.describe()
    paired = [(a, b) for a, b in zip(events(clean, "epoch"), events(lossy, "epoch"))
              if a["ok"] and b["ok"] and a["group_size"] == b["group_size"] == 2]
    brief = [[(e["epoch"], e["ok"], e["group_size"], e["chunks_lost"]) for e in events(peer, "epoch")]
             for peer in (clean, lossy)]
    assert paired, brief
    for from_lossy, from_clean in paired:
        assert from_lossy["chunks_lost"] > 0  # the clean peer never got the lossy peer's contributions
        assert from_clean["chunks_lost"] == 0  # the faults are the lossy peer's outgoing chunks only
