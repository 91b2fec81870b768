"""A GGUF that claims an absurd context (issue 29): `llama.context_length` = 2^32 - 1 in an
otherwise sound file. Served with `--max-model-len 4096` it starts and costs what the real model
costs, because the rotary tables are sized by the limit, not by the file's claim (without the
limit they would take terabytes, so that run is not made here)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.conftest import make_tiny_model
from tests.servers import running_server

HOSTILE_CONTEXT = 2**32 - 1
MAX_MODEL_LEN = 4096
STEM = "hostile-context-length"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    raise AssertionError(f"no VmRSS for process {pid}")


def _served_rss_mb(model: str) -> tuple[float, dict]:
    """The resident memory of a server of `model` once it is ready, and its /v1/models card."""
    with running_server(["--model", model, "--speculative-method", "none",
                         "--max-model-len", str(MAX_MODEL_LEN)], model) as server:
        card = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]
        return _rss_mb(server.process.pid), card


def _write_hostile_copy(source, target) -> None:
    """A copy of `source` that differs in one metadata value: the context length, rewritten in
    place through gguf's own reader (as its gguf-set-metadata does), so nothing else moves."""
    import gguf

    shutil.copyfile(source, target)
    reader = gguf.GGUFReader(target, "r+")
    field = reader.fields["llama.context_length"]
    assert field.types == [gguf.GGUFValueType.UINT32]
    field.parts[field.data[0]][0] = HOSTILE_CONTEXT
    reader.data.flush()


@pytest.fixture
def hostile_gguf(tmp_path):
    from engine.core.cache_dir import cache_dir
    from engine.models.loader import locate_model

    path = tmp_path / f"{STEM}.gguf"
    _write_hostile_copy(locate_model(None)[0], path)
    yield path
    # The server caches the file's config and tokenizer under the user's cache, keyed by this
    # temporary path: a folder nobody will read again.
    for folder in (cache_dir() / "gguf-meta").glob(f"{STEM}-*"):
        shutil.rmtree(folder, ignore_errors=True)


def test_a_gguf_claiming_a_huge_context_costs_no_more_memory(hostile_gguf):
    import gguf

    from engine.core.cache_dir import cache_dir
    from engine.models import gguf_native
    from engine.models.loader import locate_model

    field = gguf.GGUFReader(hostile_gguf).fields["llama.context_length"]
    assert field.parts[field.data[0]][0] == HOSTILE_CONTEXT  # the rewrite took
    # The metadata folder is made here, as the default model's was before: a server that makes
    # it keeps transformers' GGUF conversion imported, ~110 MB more resident whatever the file
    # claims, and that is not what this test compares.
    metadata = gguf_native.metadata_folder(hostile_gguf, cache_dir())
    # Negative control, cheaply: the claim is read (without the limit the tables would need
    # terabytes, a run not made here) and the limit is what the server serves.
    config = json.loads((metadata / "config.json").read_text())
    assert config["max_position_embeddings"] == HOSTILE_CONTEXT

    # Side by side: each start loads its GGUF for tens of seconds on a small machine.
    with ThreadPoolExecutor(2) as pool:
        (default_rss, _), (hostile_rss, card) = pool.map(
            _served_rss_mb, [str(locate_model(None)[0]), str(hostile_gguf)])
    assert card["max_model_len"] == MAX_MODEL_LEN
    print(f"resident memory: default GGUF {default_rss:.0f} MB, hostile {hostile_rss:.0f} MB")
    # Within 10%, plus 30 MB for what differs between two starts of one model: the allocator's
    # arenas and the pages the warm-up happens to touch.
    assert hostile_rss <= default_rss * 1.10 + 30, (hostile_rss, default_rss)


def test_position_tables_follow_max_model_len(tmp_path):
    from engine.models.loader import load_model

    make_tiny_model(tmp_path, max_position_embeddings=1_000_000)
    capped = load_model(str(tmp_path), torch.device("cpu"), torch.float32, with_tokenizer=False,
                        max_model_len=256).model
    assert capped.rotary.cos.shape[0] == 256
    # Negative control: without a limit the table follows the file.
    assert load_model(str(tmp_path), torch.device("cpu"), torch.float32, with_tokenizer=False
                      ).model.rotary.cos.shape[0] == 1_000_000
