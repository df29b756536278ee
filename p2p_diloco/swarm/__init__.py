"""hivemind glue: DHT start/join, signed per-peer records (see dht.py, records.py)."""
