"""Benchmarks of the BOTS selection service (see docs/benchmarks.md).

- `python -m bench.simulate`: learning-dynamics simulator, data efficiency of
  the selection strategies against baselines, over several seeds.
- `python -m bench.perf`: latency, throughput, writes, restart time and memory
  of a real server on SQLite and PostgreSQL, beside the in-process engine.
- `python -m bench.loadgen`: a bounded load generator for any running server.

Run them from the repository root with the project's venv.
"""
