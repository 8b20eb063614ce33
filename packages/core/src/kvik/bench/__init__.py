"""Benchmarks as commands: ``kvik bench throughput``, ``kvik bench latency``, ``kvik bench serve``.

Every workload is random token ids (seeded), fixed or ranged lengths, greedy, end-of-sequence
ignored, so that kvik and its peers do the same work; each command writes its figures as JSON.
"""
