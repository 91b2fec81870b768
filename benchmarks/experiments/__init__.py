"""One-off experiments: each produced a documented figure (its opening docstring says which) and
is kept to reproduce it, not maintained as a tool. Run from the repository root:
`python -m benchmarks.experiments.NAME`."""
