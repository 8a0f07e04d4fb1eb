"""The peer layer: what one machine of a swarm runs, above averaging/ and dht/.

- runtime/: a peer process (`PeerDaemon`, preemption, the training loop of `moshpeer join`, metrics)
- optimizer/: `CollaborativeOptimizer` and its parts (epoch loop, state exchange, aux peer, round timing)
- strategies/: the averaging modes (`AveragingStrategy`: gradients, parameters, diloco)
- state/: training state between peers (donating, downloading, validating)
- checkpoint/: local checkpoints; tasks/: what `moshpeer join` trains
- record_publisher.py: this peer's record in the DHT; device.py: where tensors live

Within the layer, runtime/ uses optimizer/, which uses strategies/ and state/; state/ uses none of them.
"""
