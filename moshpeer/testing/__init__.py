"""Test and benchmark infrastructure that ships with moshpeer (not used by a running peer)."""
