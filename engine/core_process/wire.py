"""The messages between the API process and the engine process, and their encoding (msgpack,
by msgspec).

Every message is a tagged `msgspec.Struct`, so one decoder per direction knows each kind by its
tag and rebuilds the engine's own dataclasses (`RequestOutput`, `SamplingParams`, the stats)
field by field: no pickle crosses the socket, and a field that cannot be encoded fails at the
sender, loudly.

Engine to front: one `StepMessage` per engine step carries every request's delta, the step's and
the finished requests' stats, and what the commands since the last step answered (aborts, refused
adds). Outputs travel without their prompt (`prompt_token_ids`, `prompt`): the front holds the
request and puts them back, so a step's message grows with its new tokens, not with the prompts.
"""

from __future__ import annotations

import dataclasses

import msgspec

from engine.metrics.stats import RequestStats, StepStats
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.suffix_cache import SuffixCacheStats


# ------------------------------------------------------------------ front -> engine
class AddRequest(msgspec.Struct, tag="add"):
    """A request the front has validated (engine.core_process.front.FrontValidator); the engine
    rebuilds it with the same checks and compiles its grammar."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    cache_salt: str = ""
    # The front's stamps (time.monotonic: one clock for every process of the machine).
    arrival_time: float = 0.0
    rendered_time: float | None = None
    tokenized_time: float | None = None
    queued_time: float | None = None


class Abort(msgspec.Struct, tag="abort"):
    request_id: str


class AbortAll(msgspec.Struct, tag="abort_all"):
    pass


class SetBeforeStep(msgspec.Struct, tag="before_step"):
    """A pickled callable the engine process runs before each step (fault injection for
    tests), or empty bytes for none."""

    pickled: bytes = b""


class Stop(msgspec.Struct, tag="stop"):
    pass


Command = AddRequest | Abort | AbortAll | SetBeforeStep | Stop


# ------------------------------------------------------------------ engine -> front
class Ready(msgspec.Struct, tag="ready"):
    """The engine is built: what the front needs to tokenize, validate and report."""

    pid: int
    model_name: str
    model_folder: str  # the tokenizer's folder
    native_tokenizer: bool  # a GGUF metadata folder, read as engine/models/loader.py reads it
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_window: int | None  # the block manager's, for the KV capacity check of a request
    has_suffix_cache: bool


class BuildFailed(msgspec.Struct, tag="build_failed"):
    error_type: str  # "ValueError": a configuration the user can fix
    message: str


class RequestError(msgspec.Struct):
    """An add the engine refused (a ValueError), or a request that failed alone."""

    request_id: str
    message: str


class RequestTimes(msgspec.Struct):
    """A finished request's engine stamps, copied onto the front's Request (server/timeline.py
    reads them there)."""

    request_id: str
    status: str  # RequestStatus.value
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None


class StepMessage(msgspec.Struct, tag="step"):
    outputs: list[RequestOutput] = []
    errors: list[RequestError] = []
    finished: list[RequestTimes] = []
    step_stats: list[StepStats] = []
    request_stats: list[RequestStats] = []
    suffix_cache: SuffixCacheStats | None = None


class Dead(msgspec.Struct, tag="dead"):
    """A step failed in no one request's part: the engine process exits after this."""

    message: str


Event = Ready | BuildFailed | StepMessage | Dead


def without_prompt(output: RequestOutput) -> RequestOutput:
    """`output` as it travels: its prompt (ids and text) left out."""
    return dataclasses.replace(output, prompt_token_ids=[], prompt=None)


class Encoder:
    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: Command | Event) -> bytes:
        return self._encoder.encode(message)


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def event_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Event)
