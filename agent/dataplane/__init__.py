"""The data plane of one instance, sans-IO: envelopes, per-sender FIFO, credit and acks, routing, inbox admission."""
