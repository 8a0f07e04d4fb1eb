"""moshpeer: decentralized training on volunteer and preemptible machines."""

from moshpeer.version import __version__

__all__ = ["__version__"]
