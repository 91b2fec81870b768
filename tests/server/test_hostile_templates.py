"""A hostile chat template against a real server (issue 29): renderings that spin, grow, flood,
recurse or refuse are answered with 400s while other requests are served; `/ready` reports a
pool whose renderers are all stuck; SIGTERM is not held up by a spinning rendering; and a
template that breaks its limits on a sample conversation stops the server at startup."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import assert_error
from tests.server.test_chat_templates import HOSTILE_TEMPLATE
from tests.servers import engine_test_args, free_port, running_server, wait_until

TIMEOUT_S = 3.0


def _args(template_file, timeout_s: float = TIMEOUT_S) -> list[str]:
    return ["--served-model-name", "tiny", "--speculative-method", "none",
            "--chat-template", str(template_file), "--chat-template-timeout", str(timeout_s)]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile-template") / "template.jinja"
    path.write_text(HOSTILE_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_chat_model_folder, template_file, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("hostile-template-log") / "server.log"
    with open(log_path, "w") as log, running_server(
            ["--model", str(tiny_chat_model_folder), *_args(template_file),
             "--log-level", "info"], "tiny", log_file=log) as running:
        running.log_path = log_path
        yield running


def _chat(server, content: str, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=timeout,
                      json={"model": "tiny", "max_tokens": 4,
                            "messages": [{"role": "user", "content": content}]})


def _chat_ignoring_errors(server, content: str, timeout: float) -> None:
    try:
        _chat(server, content, timeout)
    except httpx.TransportError:  # the server went away under it: what is being tested
        pass


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_a_spinning_rendering_is_stopped_and_blocks_nobody(server):
    outcome = {}

    def spin():
        started = time.monotonic()
        outcome["response"] = _chat(server, "spin")
        outcome["seconds"] = time.monotonic() - started

    spinner = threading.Thread(target=spin)
    spinner.start()
    time.sleep(0.3)
    started = time.monotonic()
    assert _chat(server, "hello").status_code == 200
    assert time.monotonic() - started < TIMEOUT_S  # served while the other rendering spins
    spinner.join()
    error = assert_error(outcome["response"], 400, param="messages", code="chat_template_limit")
    assert "--chat-template-timeout" in error["message"]
    assert TIMEOUT_S <= outcome["seconds"] < TIMEOUT_S + 5


def test_ready_fails_while_every_renderer_is_stuck(server):
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
    spinners = [threading.Thread(target=_chat, args=(server, "spin")) for _ in range(3)]
    # The first spins on the renderer the server started with, the second on one the pool
    # grows for it (up to two, the default), and the third waits: no more may start.
    for spinner in spinners:
        spinner.start()
    def refused():  # the 503 itself is read: the renderers are killed TIMEOUT_S after they start
        response = httpx.get(f"{server.base_url}/ready")
        return response if response.status_code == 503 else None

    busy = wait_until(refused, 2 * TIMEOUT_S, "/ready to fail")
    assert busy.json()["status"] == "chat_template_busy"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # alive all along
    for spinner in spinners:
        spinner.join()
    wait_until(lambda: httpx.get(f"{server.base_url}/ready").status_code == 200, 10,
               "/ready to recover")


@pytest.mark.parametrize(("attack", "code", "words"), [
    ("grow", "chat_template_limit", "memory limit"),
    ("flood", "chat_template_limit", "--chat-template-max-bytes"),
    ("recurse", None, "recursed too deeply"),
    ("refuse", None, "roles must alternate"),
])
def test_every_other_attack_is_a_400_and_costs_the_server_no_memory(server, attack, code,
                                                                    words):
    before = _rss_kib(server.process.pid)
    error = assert_error(_chat(server, attack), 400, param="messages", code=code)
    assert words in error["message"]
    assert _rss_kib(server.process.pid) - before < 50 * 1024  # the child took the blow
    assert _chat(server, "hello").status_code == 200


def test_no_attack_left_a_5xx_or_a_traceback(server):
    for attack in ("grow", "recurse", "refuse"):  # also when this test runs alone
        _chat(server, attack)
    text = httpx.get(f"{server.base_url}/metrics").text
    five_hundreds = [line for line in text.splitlines()
                     if line.startswith("specserve:http_requests_total") and 'status="5' in line
                     and 'route="/ready"' not in line]  # its 503s above were the point
    assert not five_hundreds or all(line.endswith(" 0.0") for line in five_hundreds)
    assert "Traceback" not in server.log_path.read_text()


def test_sigterm_is_not_held_up_by_a_spinning_rendering(tiny_chat_model_folder,
                                                        template_file):
    slow = 120.0  # a rendering limit far beyond the drain: shutdown must not wait for it
    with running_server(["--model", str(tiny_chat_model_folder),
                         *_args(template_file, timeout_s=slow)], "tiny") as running:
        answers = []
        spinner = threading.Thread(target=lambda: answers.append(_chat(running, "spin", slow)))
        spinner.start()
        time.sleep(0.5)
        started = time.monotonic()
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=60) == 0
        assert time.monotonic() - started < 10  # not the rendering's limit, nor the drain's
        spinner.join()
    # The request had not been admitted: it is turned away like any other during a drain.
    assert_error(answers[0], 503, code="server_draining")


def test_a_template_that_breaks_its_limits_on_a_sample_stops_the_server(tiny_chat_model_folder,
                                                                        tmp_path):
    always_spins = tmp_path / "spin.jinja"
    always_spins.write_text("{% for i in range(100000) %}{% for j in range(100000) %}"
                            "{% endfor %}{% endfor %}{{ messages[0].content }}")
    command = [sys.executable, "-m", "server", "serve", "--port", str(free_port()),
               *engine_test_args([]), "--model", str(tiny_chat_model_folder),
               *_args(always_spins, timeout_s=1.0)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 2, finished.stderr[-2000:]
    lines = finished.stderr.strip().splitlines()
    assert lines[-1].startswith("specserve: error: the chat template took longer than 1 s")
    assert "Traceback" not in finished.stderr
