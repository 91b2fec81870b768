"""`specserve bench`: load generation against any OpenAI-compatible server, offline runs of our
engine, reports and figures. Installed with specserve; the repository's benchmarks/ folder (its
experiments and results) is not."""
