"""benchmarks/gpu_vs_transformers.py, smoke-sized on a tiny model: every system measured on
every workload, speculation's tokens equal to plain decoding's, the batch ratios present."""

from __future__ import annotations

import json

from benchmarks.gpu_vs_transformers import main
from tests.conftest import TEST_DEVICE


def test_gpu_benchmark_measures_every_system(tiny_chat_model_folder, tmp_path):
    output = tmp_path / "gpu.json"
    main(["--model", str(tiny_chat_model_folder), "--device", str(TEST_DEVICE),
          "--dtype", "float32", "--max-tokens", "6", "--repeats", "1", "--num-prompts", "1",
          "--batch-sizes", "3", "--hf-modes", "plain,pld", "--output", str(output),
          "--gpu-memory-utilization", "0.02"])  # a smoke test's share (on a GPU)
    report = json.loads(output.read_text())
    assert set(report["batch_1"]) == {"ours/none", "ours/ngram", "hf/plain", "hf/pld"}
    for system, by_kind in report["batch_1"].items():
        assert set(by_kind) == {"code", "copy", "chat"}
        assert all(r["num_tokens"] == 6 and r["tokens_per_s"] > 0 for r in by_kind.values())
    assert all(r["same_tokens_as_none"] for r in report["batch_1"]["ours/ngram"].values())
    batch = report["batches"]["3"]
    assert batch["ours/none"] > 0 and batch["hf/padded"] > 0
    assert abs(batch["ours_none_vs_hf_padded"] - batch["ours/none"] / batch["hf/padded"]) \
        < 0.05 * batch["ours_none_vs_hf_padded"] + 0.01  # the rates are rounded to 0.1 tok/s
