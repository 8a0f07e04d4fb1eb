"""Relays on the data plane, for peers behind NAT: nobody can open a connection to them, so they keep one open.

A peer behind NAT holds a slot on a public peer's relay (`RelayReservation`, found in the run's relay
directory in the DHT) and announces that relay to its groups; a sender then opens a circuit to it through the
relay (`open_circuit`), and the data plane's handshake runs end to end through it. Every public peer serves as
a relay on its data-plane port (`RelayService`, bounded) and offers it in the directory (`RelayPublisher`).
`RelayRole` is which of the two a peer is. The protocol and its checks: protocol.py.

Why our own, when hivemind's p2pd has circuit relays: between two peers behind NAT, p2pd's relayed
connections were reset within a fraction of a second of carrying a round's chunks, and a NAT'ed p2pd takes
its relay slot only about 3 minutes after it starts (docs/benchmarks.md, sessions 18-19). libp2p streams stay
as the last path (member_connector.py).
"""
