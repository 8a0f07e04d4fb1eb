"""`examples/hf_trainer.py`: a Hugging Face `Trainer` trains a tiny random GPT-2 through CollaborativeOptimizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarm import REPO_ROOT

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # ~1-3 min: two Trainer processes


def test_hf_trainer_two_peers(swarm):
    run = "hf"
    boot = swarm.bootstrap(run, "--heartbeat", "1")
    procs = [
        subprocess.Popen([sys.executable, str(REPO_ROOT / "examples" / "hf_trainer.py"), "--initial-peers", *boot.maddrs,
                          "--run-id", run, "--max-steps", "48", "--min-peers", "2", "--seed", str(seed)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=swarm.env, cwd=str(REPO_ROOT),
                         start_new_session=True)
        for seed in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err.decode()[-3000:]
        done = json.loads(out.decode().strip().splitlines()[-1])
        assert done["event"] == "done"
        # 48 micro-batches of 8 = 384 samples per peer; target 32 over 2 peers = 16 per peer: 24 epochs.
        assert done["epochs"] >= 20
        assert done["max_group_size"] == 2 and done["rounds_ok"] >= done["rounds"] // 2, done
        assert done["eval_loss"] < done["initial_eval_loss"] - 1.0, done
