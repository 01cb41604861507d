"""The project's benchmarks, run from the repository root as ``python -m benchmarks.<module>``.

``run`` is the one entry point; ``harness`` holds the timing, memory and profiling, the shared options, the outputs
and the six-encoder shapes every step benchmark builds its models from; ``studies`` the training studies.
"""
