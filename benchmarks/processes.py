"""Resident memory of a process tree, read from /proc: a server and its children (the chat
template workers). Shared by the benchmarks that measure a server's memory."""

from __future__ import annotations

from pathlib import Path


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/<pid>/stat; the command may hold spaces and
    parentheses, so the fields are read after its last ')')."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended while we read
        parents[int(stat.parent.name)] = int(fields[1])
    return parents


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending += children.get(pid, [])
    return tree


RSS_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def resident_bytes(pid: int) -> dict[str, int]:
    """A process's resident set and its parts (anonymous, file-backed, shared memory such as
    the KV cache's mapping), in bytes; zeros once it has ended."""
    found = dict.fromkeys(RSS_FIELDS.values(), 0)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name = line.split(":", 1)[0]
            if name in RSS_FIELDS:
                found[RSS_FIELDS[name]] = int(line.split()[1]) * 1024  # the kernel writes kB
    except OSError:
        pass
    return found


def tree_rss_bytes(root: int) -> dict:
    """The resident memory of `root` and its descendants, with each process's parts: growth
    in the server's anonymous memory reads differently from a template worker's."""
    pids = descendants(root, parent_pids())
    parts = {pid: resident_bytes(pid) for pid in pids}
    return {"rss_bytes": sum(p["rss"] for p in parts.values()), "processes": len(pids),
            "by_process": [{"pid": pid, **part} for pid, part in parts.items()]}
