"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, acceptance counts."""
