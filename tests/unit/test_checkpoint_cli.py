"""`moshpeer checkpoint inspect DIR [--json] [--quick]`."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moshpeer.cli.main import main
from moshpeer.peer.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def checkpoint_dir(tmp_path):
    with CheckpointStore(tmp_path, keep_last=None) as store:
        store.save({"model": {"w": torch.ones(1000)}}, step=10, epoch=1)
        store.save({"model": {"w": torch.ones(1000)}}, step=20, epoch=2)
        damaged = store.save({"model": {"w": torch.ones(1000)}}, step=30, epoch=3)
    with open(damaged, "r+b") as f:  # a bit flip in the payload
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    (tmp_path / "ckpt-00000004-epoch3-step40.mpck.tmp").write_bytes(b"partial")
    return tmp_path


def test_inspect_json_lists_valid_and_invalid_files(checkpoint_dir, capsys):
    assert main(["checkpoint", "inspect", str(checkpoint_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["file"][:13], row["valid"], row["step"], row["epoch"]) for row in rows] == [
        ("ckpt-00000001", True, 10, 1),
        ("ckpt-00000002", True, 20, 2),
        ("ckpt-00000003", False, None, None),
        ("ckpt-00000004", False, None, None),
    ]
    assert rows[2]["reason"] == "payload checksum mismatch"
    assert rows[3]["reason"] == "leftover temp file of an interrupted write"
    assert rows[0]["size"] == (checkpoint_dir / rows[0]["file"]).stat().st_size
    assert rows[0]["parts"] == {"model": 4000} and rows[0]["format_version"] == 1


def test_inspect_quick_skips_the_checksum(checkpoint_dir, capsys):
    assert main(["checkpoint", "inspect", str(checkpoint_dir), "--json", "--quick"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["valid"] for row in rows] == [True, True, True, False]


def test_inspect_table(checkpoint_dir, capsys):
    assert main(["checkpoint", "inspect", str(checkpoint_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 valid checkpoints, 2 other file(s)" in out
    assert "ckpt-00000002-epoch2-step20.mpck" in out and "invalid: payload checksum mismatch" in out
    assert "leftover temp file" in out


def test_inspect_missing_directory_is_one_line_and_nonzero(tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"moshpeer checkpoint: error: checkpoint directory {tmp_path / 'nope'} does not exist"
    ]
    assert captured.out == ""


def test_inspect_a_file_instead_of_a_directory(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("x")
    assert main(["checkpoint", "inspect", str(path)]) == 2
    assert "is not a directory" in capsys.readouterr().err
