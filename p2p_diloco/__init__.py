"""p2p_diloco: DiLoCo training of language models across volunteers' machines over a hivemind swarm."""

__version__ = "0.1.0"
PROTOCOL_VERSION = 8  # bump when what peers exchange changes; part of the swarm fingerprint
