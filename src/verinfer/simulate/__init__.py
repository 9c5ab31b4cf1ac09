"""The provider simulator: batched decoding with any sampler profile, and the catalogue of honest
variants and misconfigurations a provider may run while claiming the reference configuration."""
