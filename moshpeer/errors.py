"""Errors shared by every layer.

`UserError` marks a mistake the user can fix (bad flag, unreachable peer, port in use, bad
checkpoint). The CLI prints its message as one line and exits non-zero, never a traceback.
"""


class MoshpeerError(Exception):
    """Base class of moshpeer's own errors."""


class UserError(MoshpeerError):
    """A problem with the user's input or environment; shown as one line, exit code `exit_code`."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class ProtocolError(MoshpeerError):
    """A message from the network violated the protocol; it is dropped and counted."""


class SwarmLost(MoshpeerError):
    """This peer's DHT process is gone (killed, or its libp2p daemon was): it can reach no one. Training cannot go
    on with the swarm; save what you need and start the peer again."""
