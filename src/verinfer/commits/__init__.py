"""Activation commits: Activation-DiFR fingerprints and TOPLOC proofs, their bytes, builders and checks."""
