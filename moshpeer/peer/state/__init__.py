"""Training state between peers: a donor serves its state, a newcomer downloads it.

- framing.py: the wire (length-prefixed frames, signed requests and headers, offers) both protocols share
- sync.py: `StateServer`, state offers in the DHT, single-donor fetch and `download_state`
- pieces.py: the multi-donor protocol: a signed manifest of piece hashes, pieces by range
- swarm.py: downloading pieces from several donors at once
- validation.py: checks that a downloaded state fits this model before anything is adopted
"""
