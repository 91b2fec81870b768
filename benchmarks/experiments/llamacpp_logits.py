"""Teacher-forced llama.cpp results on token ids, run with llama-cpp-python's own Python (the venv
benchmarks/vs_llamacpp.sh builds), so it imports nothing of specserve. Reads one JSON list of
token ids per line on stdin; writes one JSON object per line: the top-1 token at every position
but the last, and the summed negative log-likelihood of each next token.

    .venv-llamacpp/bin/python benchmarks/experiments/llamacpp_logits.py MODEL.gguf [--threads 2] < ids.jsonl

Not a figure of its own: int8_agreement.py runs it for llama.cpp's logits.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from llama_cpp import Llama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--kv-f32", action="store_true",
                        help="a float32 KV cache (llama.cpp's default is float16)")
    args = parser.parse_args()
    kv_type = {"type_k": 0, "type_v": 0} if args.kv_f32 else {}  # 0: GGML_TYPE_F32
    llm = Llama(args.model, n_ctx=args.n_ctx, n_batch=512, logits_all=True,
                n_threads=args.threads, n_threads_batch=args.threads, verbose=False, **kv_type)
    for line in sys.stdin:
        ids = json.loads(line)
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll = float((log_z - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        print(json.dumps({"argmax": logits.argmax(axis=1).tolist(), "nll": nll}), flush=True)


if __name__ == "__main__":
    main()
