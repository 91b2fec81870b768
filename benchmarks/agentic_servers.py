"""The servers benchmarks/agentic.py compares: one `specserve serve` per speculative method, and
optionally llama.cpp's own `llama-server` with its n-gram cache (and without speculation), and
servers of an older tree (`--baseline`, labelled `<method>-baseline`), all started before the
first request and ended with the benchmark.

llama-server gets as many slots as the benchmark has episodes in flight (-np), with 2048 tokens
of context per slot and at least 8192 in all, so that at concurrency N it serves N requests at
once as our servers do; at batch 1 that is `-np 1 -c 8192`.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.agentic_run import BASELINE_SUFFIX, Target, client_for

STARTUP_TIMEOUT_S = 600
LLAMA_NGRAM_CACHE = "llama-server-ngram-cache"
LLAMA_PLAIN = "llama-server"
LLAMA_CONTEXT_PER_SLOT = 2048
LLAMA_MIN_CONTEXT = 8192
GPU_SHARE_TOTAL = 0.9  # of the card, for all our servers together (one server's default alone)


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: all bound at once, so the OS cannot hand one out twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def serves_on_gpu(server_args: list[str]) -> bool:
    """Whether `specserve serve` with these flags runs on CUDA (its --device, else CUDA where
    there is one)."""
    if "--device" in server_args:
        index = server_args.index("--device") + 1
        return index < len(server_args) and server_args[index].startswith("cuda")
    import torch

    return torch.cuda.is_available()


def gpu_share_args(server_args: list[str], num_servers: int, on_gpu: bool) -> list[str]:
    """The flags that split the card between our `num_servers` servers: each asks for an equal
    share of the 0.9 one server takes by default (--gpu-memory-utilization); otherwise the
    second refused to start ("only 12.6 GiB are free", issue 70). Nothing where the servers
    run on a CPU or the flags already size the memory."""
    sized = {"--gpu-memory-utilization", "--kv-cache-memory"} & set(server_args)
    if not on_gpu or sized or num_servers < 2:
        return []
    return ["--gpu-memory-utilization", f"{GPU_SHARE_TOTAL / num_servers:.3f}"]


def specserve_command(method: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "server", "serve", "--port", str(port), "--log-level", "warning",
            "--speculative-method", method, *extra]


def llama_server_command(binary: str, model: str, port: int, threads: int, concurrency: int,
                         ngram_cache: bool) -> list[str]:
    slots = max(1, concurrency)
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               "-c", str(max(LLAMA_MIN_CONTEXT, LLAMA_CONTEXT_PER_SLOT * slots)),
               "--no-webui", "--jinja"]
    if ngram_cache:
        command += ["--spec-type", "ngram-cache", "--spec-draft-n-max", "16"]
    return command


def baseline_env(tree: Path, cache_dir: str) -> dict[str, str]:
    """What an older tree's server runs with, started in `tree` (`python -m server` imports from
    its working directory first): its packages before this tree's (installed editable), and its
    own kernel build folder, since one folder serves one tree's sources."""
    return {"PYTHONPATH": str(tree), "SPECSERVE_CACHE_DIR": cache_dir}


def default_gguf() -> str:
    from engine.models.loader import default_model_path

    return str(default_model_path())


class Servers:
    """Launches commands, each on its own port with its own log; all end when Python exits."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}
        self.targets: list[Target] = []
        self.commands: dict[str, str] = {}
        self._launched_at: dict[str, float] = {}
        self.start_seconds: dict[str, float] = {}  # launch to healthy (warm-up included)
        atexit.register(self.stop)
        # `timeout` or `kill` sends SIGTERM, which skips atexit. The servers end first, so that
        # requests in flight fail at once instead of holding the exit.
        signal.signal(signal.SIGTERM, self._end_on_signal)

    def launch(self, label: str, command: list[str], port: int, ours: bool,
               env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        log = open(self.log_dir / f"agentic_{label}.log", "w")
        self._launched_at[label] = time.monotonic()
        self.processes[label] = subprocess.Popen(command, stdout=log, stderr=log, cwd=cwd,
                                                 env={**os.environ, **(env or {})})
        self.targets.append(Target(label, f"http://127.0.0.1:{port}", ours))
        prefix = " ".join(f"{key}={value}" for key, value in (env or {}).items())
        self.commands[label] = f"{prefix} {' '.join(command)}".strip()

    def wait_healthy(self, targets: list[Target] | None = None) -> None:
        """Returns once every server (of `targets`, default all) answers /health with 200
        (llama-server answers 503 while it loads); exits naming the server that died or took
        longer than STARTUP_TIMEOUT_S."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for target in self.targets if targets is None else targets:
            while not _healthy(target.url):
                process = self.processes[target.label]
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{target.label} did not start: see "
                                     f"{self.log_dir}/agentic_{target.label}.log")
                time.sleep(0.5)
            self.start_seconds.setdefault(
                target.label, round(time.monotonic() - self._launched_at[target.label], 2))

    def _end_on_signal(self, signum, frame) -> None:
        self.stop()
        sys.exit(128 + signum)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def start_all(methods: list[str], server_args: list[str], log_dir: Path, llama_binary: str | None,
              llama_plain: bool, llama_threads: int, concurrency: int,
              baseline: tuple[Path, str, list[str]] | None = None,
              num_other_engines: int = 0) -> Servers:
    """Our servers with the environment they always had (threads as the machine gives them;
    on a GPU each with its share of the card's memory, `gpu_share_args`),
    then the baseline's (tree, kernel cache folder, methods), then the llama-servers asked for,
    each once the one before is healthy: a specserve times its steps at start-up for the
    controller's cost model, and four started together timed theirs on a shared CPU, 2-4x too
    slow (one priced a draft row at 1.88 ms, alone 0.57). `num_other_engines`: engines this
    process runs beside them (benchmarks/agentic_offline.py), which take their share too."""
    servers = Servers(log_dir)
    wanted = [(LLAMA_NGRAM_CACHE, True)] + ([(LLAMA_PLAIN, False)] if llama_plain else [])
    wanted = wanted if llama_binary else []
    tree, cache_dir, baseline_methods = baseline or (None, "", [])
    ports = free_ports(len(methods) + len(baseline_methods) + len(wanted))
    server_args = [*server_args, *gpu_share_args(
        server_args, len(methods) + len(baseline_methods) + num_other_engines,
        serves_on_gpu(server_args))]
    for method, port in zip(methods, ports):
        servers.launch(method, specserve_command(method, port, server_args), port, ours=True)
        servers.wait_healthy(servers.targets[-1:])
    for method, port in zip(baseline_methods, ports[len(methods):]):
        servers.launch(method + BASELINE_SUFFIX, specserve_command(method, port, server_args),
                       port, ours=True, cwd=tree, env=baseline_env(tree, cache_dir))
        servers.wait_healthy(servers.targets[-1:])
    if wanted:
        model = default_gguf()
        for (label, ngram_cache), port in zip(wanted,
                                              ports[len(methods) + len(baseline_methods):]):
            command = llama_server_command(llama_binary, model, port, llama_threads, concurrency,
                                           ngram_cache)
            servers.launch(label, command, port, ours=False,
                           env={"OMP_NUM_THREADS": str(llama_threads)})
            servers.wait_healthy(servers.targets[-1:])
    servers.wait_healthy()
    return servers


WARM_UP_MESSAGES = [{"role": "user", "content": "Warm-up: name three colours."}]


def warm_up_targets(targets: list[Target], max_tokens: int) -> dict[str, float]:
    """One untimed chat request to each server before the timed ones (text no workload sends,
    so no cache learns a timed turn); seconds per label, reported apart from the results."""
    seconds = {}
    for target in targets:
        started = time.perf_counter()
        response = client_for(target.url).post("/v1/chat/completions", json={
            "messages": WARM_UP_MESSAGES, "max_tokens": max_tokens, "temperature": 0})
        response.raise_for_status()
        seconds[target.label] = round(time.perf_counter() - started, 3)
    return seconds
