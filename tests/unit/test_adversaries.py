"""The hostile peers bench_trust runs (moshpeer/adversaries): what they serve and how they refuse bad arguments."""

from __future__ import annotations

import pytest
import torch

from moshpeer.adversaries import forged_donors, sample_liar
from moshpeer.peer.state.framing import deserialize_state


def test_the_forged_state_is_one_set_of_bytes_per_epoch_scaled_and_renumbered():
    honest = {"model": {"w": torch.ones(3, 3)}, "epoch": 4, "steps": 9}
    forged = forged_donors.ForgedState(honest)
    epoch, data = forged()
    assert epoch == 4 and forged() == (epoch, data)  # every identity serves the very same bytes
    state = deserialize_state(data)
    assert torch.equal(state["model"]["w"], torch.full((3, 3), forged_donors.FORGE_SCALE)) and state["steps"] == 9
    forged.epoch = 6
    epoch, data = forged()
    assert epoch == 6 and deserialize_state(data)["epoch"] == 6  # always at the swarm's epoch
    assert torch.equal(honest["model"]["w"], torch.ones(3, 3))  # the downloaded state is left as it was


@pytest.mark.parametrize("main, argv", [
    (sample_liar.main, ["--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--target-batch-size", "0"]),
    (forged_donors.main, ["--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/1", "--count", "0"]),
])
def test_a_bad_argument_is_argparse_usage_and_exit_code_2(main, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "error: --" in err.strip().splitlines()[-1] and "Traceback" not in err
