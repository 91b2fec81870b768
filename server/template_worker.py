"""The child process that renders chat templates for `server.templates`.

A chat template is code from the model file, and model files come from hubs: rendering one in the
server's own process could spin a thread forever or grow its memory without bound (Jinja's sandbox
stops file and attribute access, not loops or `'x' * 10**10`). Here it renders under an address
space limit, and the parent kills the whole process when it overruns its time.

It renders exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does, with jinja2 and
our own copy of the environment transformers defines (server/chat_render.py): without transformers
a worker is ~20 MB resident, not ~60. It speaks frames on stdin and stdout: a decimal byte count on a line,
then that many bytes of JSON. The first frame in is the setup (the tokenizer's special tokens and
the limits); each later frame is one rendering, answered by `{"text"}` or `{"error", "message"}`.
"""

from __future__ import annotations

import ctypes
import json
import resource
import signal
import sys
from typing import BinaryIO

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def read_frame(stream: BinaryIO) -> dict | None:
    """The next frame's JSON, or None at the end of the stream."""
    header = stream.readline()
    if not header:
        return None
    return json.loads(stream.read(int(header)))


def encode_frame(value: dict) -> bytes:
    data = json.dumps(value).encode()  # ASCII escapes: any string survives the pipe
    return b"%d\n" % len(data) + data


def write_frame(stream: BinaryIO, value: dict) -> None:
    stream.write(encode_frame(value))
    stream.flush()


def render(setup: dict, request: dict) -> dict:
    from server.chat_render import render_chat

    try:
        text = render_chat(request["template"], request["messages"], request["tools"],
                           request["add_generation_prompt"], setup["special_tokens"])
        size = len(text.encode())
    except MemoryError:
        return {"error": "memory", "message": "the rendering ran out of its memory limit"}
    except RecursionError:
        return {"error": "template", "message": "the template recursed too deeply"}
    except Exception as error:  # the template's own raise_exception, or its code failing
        message = str(error) if _is_template_error(error) else f"{type(error).__name__}: {error}"
        return {"error": "template", "message": message}
    if size > setup["max_bytes"]:
        return {"error": "size", "message": f"the rendered prompt is {size} bytes"}
    return {"text": text}


def _is_template_error(error: Exception) -> bool:
    from jinja2 import TemplateError

    return isinstance(error, TemplateError)


def _limit_memory(budget_bytes: int) -> None:
    """Address space: what is mapped now (the interpreter, jinja2) plus
    `budget_bytes`, so a runaway template gets MemoryError, not the machine's memory."""
    with open("/proc/self/status") as status:
        vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    limit = vm_kib * 1024 + budget_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent() -> None:
    """Killed with the server even when the server itself is killed (SIGKILL, a second SIGTERM),
    so a spinning template never outlives it."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's kill on close still holds
        pass


def main() -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the server's to handle
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    setup = read_frame(source)
    import server.chat_render  # noqa: F401  (jinja2 mapped before the limit)

    _limit_memory(setup["memory_bytes"])
    write_frame(sink, {"ready": True})
    while (request := read_frame(source)) is not None:
        write_frame(sink, render(setup, request))


if __name__ == "__main__":
    main()
