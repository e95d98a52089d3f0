"""A tensor-parallel worker as `status` and `report` show it, read from the manifest alone: the worker's ranks
(``workers.<id>.ranks``: device, cores, bytes per rank) and the model's split (``model.tensor_parallel_size``,
``rank_weights_bytes``, ``rank_kv_bytes``: rank 0's engine, driver/rank_group.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any


def rank_summary(record: Any) -> dict[str, Any] | None:
    """``{"count", "devices" ({device: ranks}), "cores" (per rank), "weights_bytes" (per rank)}`` of a worker
    record with ranks; None for a worker of one process."""
    ranks = record.get("ranks") if isinstance(record, dict) else None
    ranks = [r for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else []
    if not ranks:
        return None
    return {"count": len(ranks), "devices": dict(Counter(str(r.get("device") or "?") for r in ranks)),
            "cores": [list(r["cores"]) if isinstance(r.get("cores"), list) else [] for r in ranks],
            "weights_bytes": [_int(r.get("weights_bytes")) for r in ranks]}


def describe_ranks(summary: dict[str, Any]) -> str:
    """``2 ranks x cpu, cores [0] [1]`` (``cores not pinned`` where no rank pinned any)."""
    devices = ", ".join(f"{n} x {d}" if n != summary["count"] else d for d, n in sorted(summary["devices"].items()))
    cores = summary["cores"]
    pinned = " ".join(f"[{','.join(str(c) for c in rank)}]" for rank in cores) if any(cores) else "not pinned"
    return f"{summary['count']} ranks x {devices}, cores {pinned}"


def model_split(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The tensor-parallel split of the job's model: ``tensor_parallel_size``, ``rank_weights_bytes``,
    ``rank_kv_bytes`` (rank 0's), and ``workers`` ({id: rank_summary}); None for a model on one rank."""
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    workers = manifest.get("workers") if isinstance(manifest.get("workers"), dict) else {}
    groups = {wid: s for wid, s in ((wid, rank_summary(w)) for wid, w in sorted(workers.items())) if s}
    size = _int(model.get("tensor_parallel_size")) or max((s["count"] for s in groups.values()), default=1)
    if size <= 1:
        return None
    return {"tensor_parallel_size": size, "rank_weights_bytes": _int(model.get("rank_weights_bytes")) or None,
            "rank_kv_bytes": _int(model.get("rank_kv_bytes")) or None, "workers": groups}


def describe_split(split: dict[str, Any]) -> str:
    """``tensor parallel 2: per rank weights 1.2 MB, KV cache 4.2 MB; w0: 2 ranks x cpu, cores [0] [1]``."""
    sizes = [f"{name} {_size(split[key])}" for name, key in (("weights", "rank_weights_bytes"),
                                                             ("KV cache", "rank_kv_bytes")) if split.get(key)]
    per_rank = f": per rank {', '.join(sizes)}" if sizes else ""
    groups = describe_groups(split)
    return f"tensor parallel {split['tensor_parallel_size']}{per_rank}" + (f"; {groups}" if groups else "")


def describe_groups(split: dict[str, Any]) -> str:
    """``w0: 2 ranks x cpu, cores [0] [1]; w1: ...`` (empty where no worker recorded its ranks)."""
    return "; ".join(f"{wid}: {describe_ranks(s)}" for wid, s in split["workers"].items())


def _size(num_bytes: int) -> str:
    if num_bytes >= 1e9:
        return f"{num_bytes / 1e9:.2f} GB"
    return f"{num_bytes / 1e6:.1f} MB" if num_bytes >= 1e5 else f"{num_bytes / 1e3:.1f} kB"


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
