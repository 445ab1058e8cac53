"""Layer 5: performance benchmarks (dispatch ops, engine throughput). Each module ends its run with one JSON line."""
