"""Benchmarks and theory for loopserve: FLOP bounds, KV memory, rooflines and throughput runs."""
