"""Names of things under a job's output URL (see docs/contracts.md)."""

MANIFEST = "_manifest.json"
MANIFEST_FORMAT_VERSION = 1  # written by the driver, checked by report readers
SUCCESS = "_SUCCESS"
PARTS_DIR = "parts"
TEMP_DIR = "_temporary"
REPORT_DIR = "_report"  # `_` so Parquet readers pointed at the output URL skip it
REPORT_FILES = (f"{REPORT_DIR}/report.json", f"{REPORT_DIR}/report.html")


def part_key(shard_id: str) -> str:
    """Relative key of a shard's committed part."""
    return f"{PARTS_DIR}/part-{shard_id}.parquet"
