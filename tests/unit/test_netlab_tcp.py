"""netlab.tcp: the congestion control a lab's namespaces may choose, allowed while labs need it, then put back."""

from __future__ import annotations

import pytest

from moshpeer.testing.netlab import tcp
from moshpeer.testing.netlab.commands import NetlabError


@pytest.fixture
def sysctl(tmp_path):
    (tmp_path / "tcp_available_congestion_control").write_text("reno bbr cubic\n")
    (tmp_path / "tcp_allowed_congestion_control").write_text("reno bbr\n")
    return tmp_path


def allowed(sysctl) -> str:
    return (sysctl / "tcp_allowed_congestion_control").read_text()


def test_the_last_lab_down_puts_the_allowed_list_back(sysctl):
    tcp.allow("cubic", sysctl)
    tcp.allow("cubic", sysctl)  # a second lab of this process
    assert allowed(sysctl) == "reno bbr cubic"
    tcp.release("cubic", sysctl)
    assert allowed(sysctl) == "reno bbr cubic"  # the other lab still runs it
    tcp.release("cubic", sysctl)
    assert allowed(sysctl) == "reno bbr"
    tcp.release("cubic", sysctl)  # again: nothing to do
    assert allowed(sysctl) == "reno bbr"


def test_an_allowed_name_is_left_alone_and_an_unknown_one_is_one_line(sysctl):
    tcp.allow("bbr", sysctl)
    tcp.release("bbr", sysctl)
    assert allowed(sysctl) == "reno bbr\n"  # never written
    with pytest.raises(NetlabError, match="no TCP congestion control 'vegas'.*reno, bbr, cubic"):
        tcp.allow("vegas", sysctl)
    tcp.release(None, sysctl)
