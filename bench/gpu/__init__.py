"""The GPU check (issue 20): one prepared command that proves Hypnos's CUDA paths on a lent GPU.

`./run.sh gpu-pack` (here, with the network) fills `.gpu/` with what a bare, offline GPU machine
lacks: a trimmed llama-cpp-python sdist and the pure-Python wheels the GPU tests import.
`./run.sh gpu-check OUTDIR` (there, on the machine's own python3) builds llama-cpp-python with
CUDA for the detected architecture, or restores that build from a cache bundle, generates a test
GGUF, runs `tests/gpu` and a short chat benchmark against llama.cpp's own `llama-server`, and
leaves a JSON report and the build's cache bundle in OUTDIR. docs/gpu.md says how to run it.

Only the standard library is imported at module level: the same code runs under the project's
venv (where tests/unit/test_gpu_check.py rehearses it on CPU) and under a bare python3.
"""
