"""The cross-method wing: every method's whole training step against dense (``step_bench``,
the one whole-step table), the quickstart comparison, data loading and decoding, gradient
all-reduce, and the framework-level benches. Their pages are in ``results/benchmarks/``."""
