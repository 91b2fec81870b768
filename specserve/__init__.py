"""The `specserve` command: one entry module over the server's, the benchmarks' and the draft
trainer's command lines, so that none of them imports another."""
