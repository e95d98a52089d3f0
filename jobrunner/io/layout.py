"""Names of things under a job's output URL (see docs/contracts.md).

Data lives under `parts/`; every other file has a name that starts with `_`, which Parquet readers (pyarrow,
Spark, DuckDB, Ray Data) skip, so they can open the output URL itself.
"""

MANIFEST = "_manifest.json"
MANIFEST_FORMAT_VERSION = 3  # written by the driver, checked by report readers
# 1: no commit records; 2: `_commits/` records beside the manifest; 3: the shards in a Parquet table
READABLE_MANIFEST_VERSIONS = (1, 2, 3)
SHARDS_DIR = "_shards"  # the manifest's shard table, `_shards/<generation>.parquet` (format 3)
SUCCESS = "_SUCCESS"
PARTS_DIR = "parts"
TEMP_DIR = "_temporary"
COMMITS_DIR = "_commits"  # one small record per committed shard, folded into the manifest by compaction
LEASE = "_lease.json"  # the run that owns this output (run id, generation, host, pid, heartbeat)
LEASE_GENERATION = "lease_generation"  # manifest key: the generation (fencing epoch) of the run that wrote it
REPORT_DIR = "_report"  # `_` so Parquet readers pointed at the output URL skip it
REPORT_FILES = (f"{REPORT_DIR}/report.json", f"{REPORT_DIR}/report.html")
OPENAI_DIR = "_openai"  # an OpenAI batch job's output.jsonl / errors.jsonl (io/openai_files.py)
RUNS_DIR = "_runs"  # one record per run: its status, workers and worker-seconds (io/run_records.py)
# Every top-level name a jobrunner output may hold: `output.mode=overwrite` deletes a folder holding only these
# (and a manifest of the same job). A new top-level file or folder must be added here.
OUTPUT_ENTRIES = frozenset({PARTS_DIR, MANIFEST, SUCCESS, TEMP_DIR, COMMITS_DIR, LEASE, REPORT_DIR, OPENAI_DIR,
                            RUNS_DIR,
                            "_shards",  # `_shards/`: the manifest's shard table (format 3)
                            "_plan",  # `_plan/`: the row order of prefix-grouped input files (io/row_order.py)
                            "_input",  # a pipeline stage's input files (io/stage_input.py)
                            "stages", "_pipeline.json"})  # a pipeline's stage outputs and its record
STAGE_INPUT_DIR = "_input"  # a pipeline stage's input files, under its output (io/stage_input.py)
PART_PREFIX = "part-"  # every file under parts/ starts with it


def part_key(shard_id: str, row_start: int | None = None) -> str:
    """Relative key of a shard's committed part (`row_start` names one piece of a bisected shard)."""
    suffix = "" if row_start is None else f"-r{row_start}"
    return f"{PARTS_DIR}/part-{shard_id}{suffix}.parquet"


def attempt_part_key(attempt_id: str, shard_id: str, row_start: int) -> str:
    """Temporary key a worker writes one attempt of a shard (piece) to; only the driver commits it."""
    return f"{TEMP_DIR}/{attempt_id}/part-{shard_id}-r{row_start}.parquet.tmp"


def commit_record_key(shard_id: str) -> str:
    """Key of a shard's commit record."""
    return f"{COMMITS_DIR}/{shard_id}.json"
