"""Benchmarks against MPI (mpi4py) and torch gloo: ``python -m totalreduce.bench --help``."""
