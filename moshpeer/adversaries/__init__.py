"""Hostile peers that stay inside the protocol, for tests and benchmarks (bench_trust's arms; issue 26).

Each is a process of the product's own DHT, record and state code that lies the way a hostile peer could:
`sample_liar` claims the target batch at every refresh, `forged_donors` serves one forged state from several
identities. A running peer never imports this package.
"""
