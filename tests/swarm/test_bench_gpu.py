"""benchmarks/bench_gpu.py's harness on the CPU with tiny sizes: both averaging peers, the encode anchor and the
two `moshpeer join --device cpu --task gpt` peers run through the same code a GPU run does, and the figures
land in the final JSON line. (The figures themselves need a GPU: see docs/benchmarks.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.swarm]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "bench_gpu.py"
TINY_GPT = ["context=16", "d_model=16", "layers=1", "max_bytes=100000", "eval_windows=16", "batch_size=16",
            "target_batch_size=32"]


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(REPO))


def test_bench_gpu_harness_on_the_cpu():
    if not torch.cuda.is_available():  # the default device: one line, nothing measured, exit 0
        quiet = run_bench(timeout=120)
        assert quiet.returncode == 0 and quiet.stdout.strip().count("\n") == 0
        assert "CUDA is not available" in quiet.stdout
    gpt_args = [arg for item in TINY_GPT for arg in ("--gpt-arg", item)]
    result = run_bench("--device", "cpu", "--mbytes", "2", "--rounds", "1", "--codecs", "none,int8",
                       "--gpt-epochs", "2", *gpt_args, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    none, int8 = figures["averaging"]["none"], figures["averaging"]["int8"]
    assert none["rel_err"] < 1e-6 and 1e-4 < int8["rel_err"] < 1e-2  # exact vs quantized: both really averaged
    assert none["chunks_lost"] == int8["chunks_lost"] == 0
    assert none["pcie_mb"] == int8["pcie_mb"] == 0  # nothing staged on the CPU
    assert int8["sent_mb"] < 0.3 * none["sent_mb"]
    assert figures["int8_round_vs_none"] > 0 and figures["encode_vs_copy"] > 0
    for mode in ("gradients", "diloco"):  # both modes trained, and were compared with one process alone
        assert 0 < figures[f"gpt_{mode}_averaging_share"] < 1
        assert 0.5 < figures[f"gpt_{mode}_loss_over_single"] < 2.0 and figures[f"gpt_{mode}_tokens_per_s_vs_single"] > 0
