"""A hostile peer in a real 4-peer digits swarm with `--aggregation clipped` (issue 14).

The hostile peer runs the real protocol through the `byzantine` fault mode: it sends -100x its gradient
and declares weight 1e6. Every honest part owner must reject its contributions from the first round (it is
far outside the rejection radius), make it a suspect, and stop counting its samples toward the epoch, so
the three honest peers compute the whole target batch between them and train as an honest swarm does.
bench_trust.py measures the accuracy against an all-honest swarm over repeated runs.
"""

from __future__ import annotations

import pytest

from moshpeer.averaging.suspects import SUSPECT_AFTER_ROUNDS
from moshpeer.peer.tasks import load_task, train_locally
from training_swarm import events, start_trainers, wait_event

pytestmark = [pytest.mark.timeout(240), pytest.mark.swarm]

EPOCHS = 12
TARGET_BATCH = 256
HOSTILE = "byzantine=-100,weight=1e6"


def test_a_hostile_peer_is_rejected_then_distrusted_and_its_samples_stop_counting(swarm):
    run = "byzantine"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    flags = ("--group-size", "4", "--min-peers", "4", "--max-epochs", str(EPOCHS), "--eval-every", str(EPOCHS),
             "--aggregation", "clipped")
    honest = start_trainers(swarm, 3, run, boot.maddrs, *flags, first_seed=0)
    (hostile,) = start_trainers(swarm, 1, run, boot.maddrs, *flags, "--faults", HOSTILE, first_seed=3)
    hostile_id = wait_event(hostile, "training", timeout=60)["peer_id"]
    done = [wait_event(peer, "done", timeout=200) for peer in honest]
    for peer in honest:
        assert peer.wait_exit(30) == 0, peer.describe()

    # The epoch line's "round" is the whole RoundResult: `flagged` (peer id -> chunks) and `distrusted` (peer ids).
    epochs = [[{**e, **{key: e["round"][key] for key in ("flagged", "distrusted")}}
               for e in events(peer, "epoch") if e["ok"]] for peer in honest]
    for peer_epochs in epochs:
        assert len(peer_epochs) >= EPOCHS - 2, [e["epoch"] for e in peer_epochs]
        # Every owner flagged the hostile peer in every round it contributed to the owner's part (a group of 4 whose
        # chunks for that part all arrived: a member can be counted in a group and never send, as test_training_aux
        # showed in session 19; that session's one failure here, an unflagged round of 4, was not traced), and
        # honest peers were flagged in two rounds at most (the clip radius is two
        # median distances: chance clipping is rare; bench_trust saw 0-2 honest chunks flagged in a whole run of 25
        # rounds x 3 owners).
        hostile_rounds = [e for e in peer_epochs if e["group_size"] == 4]
        contributed = [e for e in hostile_rounds if e["round"]["reduce"]["chunks_lost"] == 0]
        assert len(contributed) >= len(hostile_rounds) - 1, [e["round"]["reduce"] for e in hostile_rounds]
        assert all(hostile_id in e["flagged"] for e in contributed), \
            [(e["flagged"], e["round"]["departed"], e["round"]["reduce"]) for e in hostile_rounds]
        assert sum(any(peer_id != hostile_id for peer_id in e["flagged"]) for e in peer_epochs) <= 2
        # After SUSPECT_AFTER_ROUNDS flagged rounds the owner weighs it at zero, for the rest of the run.
        suspect_from = contributed[SUSPECT_AFTER_ROUNDS - 1]["epoch"] if len(contributed) >= SUSPECT_AFTER_ROUNDS else 0
        late = [e for e in hostile_rounds if e["epoch"] > suspect_from]
        assert late and all(hostile_id in e["distrusted"] for e in late), [e["distrusted"] for e in late]

    # Once every honest peer distrusts it, the hostile peer's samples no longer count: the honest peers compute
    # the whole target batch between them (with its samples counted they would stop at about 3/4 of it).
    by_epoch = {}
    for peer_epochs in epochs:
        for e in peer_epochs:
            by_epoch.setdefault(e["epoch"], []).append(e)
    distrusted_everywhere = [rounds for epoch, rounds in sorted(by_epoch.items())
                             if len(rounds) == 3 and all(hostile_id in e["distrusted"] for e in rounds)]
    assert len(distrusted_everywhere) >= EPOCHS // 2, sorted(by_epoch)
    honest_samples = [sum(e["samples"] for e in rounds) for rounds in distrusted_everywhere]
    assert min(honest_samples) >= 0.9 * TARGET_BATCH, honest_samples

    reference = train_locally(load_task("digits"), num_samples=EPOCHS * TARGET_BATCH,
                              global_batch_size=TARGET_BATCH).metrics["accuracy"]
    for summary in done:
        assert summary["metrics"]["accuracy"] >= reference - 0.03, (summary["metrics"], reference)


def test_a_free_rider_fails_its_spot_checks_and_honest_peers_pass_theirs(swarm):
    """Issue 26, accountability: a peer that trains but sends zeros at its full weight is inside every other rule
    (never clipped: zeros sit near the others; no direction to measure). With `--spot-checks 1.0` every honest
    owner recomputes, after each round, the contribution of one member it drew in secret from that member's data
    assignment: checks of honest peers pass, a check of the free rider fails, and from then on that owner weighs
    it at zero. On main nothing recomputed a contribution."""
    run = "free-rider"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    epochs = 8
    flags = ("--group-size", "4", "--min-peers", "4", "--max-epochs", str(epochs), "--eval-every", str(epochs),
             "--aggregation", "clipped", "--spot-checks", "1.0")
    honest = start_trainers(swarm, 3, run, boot.maddrs, *flags, first_seed=0)
    (rider,) = start_trainers(swarm, 1, run, boot.maddrs, *flags, "--faults", "byzantine=0", first_seed=3)
    rider_id = wait_event(rider, "training", timeout=60)["peer_id"]
    for peer in honest:
        wait_event(peer, "done", timeout=200)
        assert peer.wait_exit(30) == 0, peer.describe()
    checks = [events(peer, "spot_check") for peer in honest]
    of_honest = [c for peer_checks in checks for c in peer_checks if c["peer"] != rider_id]
    of_rider = [c for peer_checks in checks for c in peer_checks if c["peer"] == rider_id]
    wrong = [(c["peer"][-6:], c["epoch"], c["outcome"], c["reason"], c["relative_error"])
             for c in of_honest if c["outcome"] not in ("passed", "skipped")]
    rounds = [[(e["previous_epoch"], e.get("ok"), e.get("error"), e.get("group_size"), e.get("joined_epoch"))
               for e in events(peer, "epoch")] for peer in honest]
    assert of_honest and not wrong, f"honest peers failed: {wrong}; each honest peer's rounds: {rounds}"
    # Skipped: a check the owner cannot do fairly (e.g. a part of epoch 0's parameters round; spot_checks.py).
    assert any(c["outcome"] == "failed" for c in of_rider), of_rider
    assert all(c["outcome"] in ("failed", "skipped") for c in of_rider), of_rider
    for peer, peer_checks in zip(honest, checks):  # an owner that caught it weighs it at zero from the next round
        caught = [c["epoch"] for c in peer_checks if c["peer"] == rider_id and c["outcome"] == "failed"]
        later = [e for e in events(peer, "epoch") if e["ok"] and caught and e["previous_epoch"] > caught[0]]
        assert all(rider_id in e["round"]["distrusted"] for e in later if e["group_size"] == 4), \
            [(e["previous_epoch"], e["round"]["distrusted"]) for e in later]
