"""hivemind glue: DHT start/join, signed per-peer records (see dht.py, records.py)."""

from p2p_diloco.swarm import shm as _shm  # noqa: F401 - how this process shares tensors with the ones it forks
