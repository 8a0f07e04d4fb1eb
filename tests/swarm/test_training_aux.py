"""Aux peers (`moshpeer join --role aux`): they join averaging groups with weight 0 and no samples."""

from __future__ import annotations

import pytest

from test_training import TARGET_BATCH, single_process_accuracy
from training_swarm import FAST_TRAINING, events, start_trainers, wait_event
from swarm import LOOPBACK

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]

EPOCHS = 16


def test_aux_peer_joins_groups_without_contributing_samples(swarm):
    run = "aux"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    common = ("--group-size", "4", "--min-peers", "2", "--max-epochs", str(EPOCHS), "--eval-every", "4")
    aux = swarm.spawn("join", "--initial-peers", *boot.maddrs, "--run-id", run, "--host-maddrs", LOOPBACK,
                      *FAST_TRAINING, *common, "--role", "aux", name="aux")
    aux.wait_ready(60)  # its record is in the DHT before the trainers look for peers: their group target is 3
    trainers = start_trainers(swarm, 2, run, boot.maddrs, *common, first_seed=0)
    done = [wait_event(peer, "done", timeout=200) for peer in trainers]
    aux_done = wait_event(aux, "done", timeout=60)
    for peer in trainers + [aux]:
        assert peer.wait_exit(30) == 0, peer.describe()
        assert "Traceback" not in peer.stderr, peer.describe(40)

    trainer_epochs = [events(peer, "epoch") for peer in trainers]
    for peer_epochs in trainer_epochs:
        # The aux is never counted as a trainer: shares and swarm samples come from the two trainers only. A
        # trainer an epoch behind the other (it missed a round) computes its last epoch alone once the other left.
        shared = peer_epochs[:-1] if (peer_epochs[-1]["num_trainers"], peer_epochs[-1]["samples"],
                                      peer_epochs[-1]["error"]) == (1, TARGET_BATCH, "alone") else peer_epochs
        assert all(e["num_trainers"] == 2 and e["samples"] == TARGET_BATCH // 2 for e in shared), \
            [(e["epoch"], e["num_trainers"], e["samples"], e["error"]) for e in peer_epochs]
        # The group target follows the live peers (2 trainers + 1 aux), not the configured 4.
        assert all(e["group_target"] == 3 for e in peer_epochs if e["ok"]), [(e["epoch"], e["group_target"], e["group_size"]) for e in peer_epochs]
        with_aux = [e for e in peer_epochs if e["ok"] and e["group_size"] == 3]
        assert len(with_aux) >= EPOCHS // 2, (
            [(e["ok"], e["group_size"], e["error"], round(e["stragglers_eta_s"], 2)) for e in peer_epochs],
            "aux:", [(e["ok"], e["group_size"]) for e in events(aux, "epoch")])

    aux_epochs = events(aux, "epoch")
    assert len(aux_epochs) >= EPOCHS // 2 and all(e["ok"] and e["samples"] == 0 for e in aux_epochs)
    assert all(e["group_size"] >= 2 for e in aux_epochs)
    assert aux_done["samples"] == 0

    # The trainers' result is that of two peers training alone: weight 0 changes no average.
    reference = single_process_accuracy(EPOCHS)
    for summary in done:
        assert summary["epochs"] == EPOCHS and summary["reason"] == "max_epochs"
        assert summary["metrics"]["accuracy"] >= reference - 0.015, (summary["metrics"], reference)
    # Identical parameters need identical rounds: a round that lost chunks (the aux left it: its part is rebuilt by
    # each trainer from its own values) ends ok but apart, as the lost fraction in its record says.
    both_full = all(a["ok"] and b["ok"] and a["group_size"] == b["group_size"] and a["lost_fraction"] == 0 ==
                    b["lost_fraction"] for a, b in zip(*trainer_epochs))
    assert done[0]["params_digest"] == done[1]["params_digest"] or not both_full
