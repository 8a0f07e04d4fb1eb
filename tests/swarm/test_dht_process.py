"""The DHT process of a peer that was SIGKILLed while it had requests in flight goes quietly, p2pd with it.

hivemind passes each request's reply pipe to the DHT process through the main process (multiprocessing's
resource sharer); a main process killed mid-request leaves a message the DHT process cannot unpickle.
That is the peer leaving: no traceback may reach the log (CI once failed on one in test_churn).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(120)

ATTEMPTS = 3  # the kill lands mid-request in most, not all, attempts
GONE_WITHIN_S = 10.0

# Starts a DHT, floods it with requests from two threads, and SIGKILLs itself; prints the DHT process's pid.
KILLED_MID_REQUEST = textwrap.dedent("""
    import os, signal, threading, time
    from moshpeer.dht import start_dht
    from moshpeer.logs import quiet_expected_peer_failures
    quiet_expected_peer_failures()  # what `moshpeer join` does at start
    dht = start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    print(dht.pid, flush=True)
    def flood():
        while True:
            dht.get("nothing-here", return_future=True)
    for _ in range(2):
        threading.Thread(target=flood, daemon=True).start()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_dht_process_of_a_peer_killed_mid_request_exits_without_a_traceback(swarm):
    for attempt in range(ATTEMPTS):
        killed = subprocess.run([sys.executable, "-c", KILLED_MID_REQUEST], capture_output=True, text=True,
                                timeout=60, env=swarm.env)
        assert killed.returncode == -9, killed.stderr
        dht_pid = int(killed.stdout.split()[0])
        deadline = time.monotonic() + GONE_WITHIN_S
        # The DHT process leads its own group (p2pd is in it): the whole group must go.
        while group_alive(dht_pid):
            assert time.monotonic() < deadline, f"attempt {attempt}: DHT process group {dht_pid} still alive"
            time.sleep(0.1)
        # The DHT process wrote to the same stderr until it ended; the pipe closed when the group was gone.
        assert "Traceback" not in killed.stderr, f"attempt {attempt}:\n{killed.stderr}"


def group_alive(pgid: int) -> bool:
    alive = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True)
    return alive.returncode == 0
