"""Verification in production (issue #26): a recording gateway in front of a real engine, and a
monitor that verifies what it records, shard by shard, into a database of per-shard and per-window
results."""
