"""Speculative decoding: its configuration, the proposers (n-gram, EAGLE-3 heads), the rejection
sampler that keeps the target's distribution, and acceptance metrics. The scheduler and runner
integration comes later (docs/architecture.md, "Speculative decoding")."""
