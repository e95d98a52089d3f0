"""cluster.yaml against Ray's own cluster-config schema, and the promises its comments make: a current CUDA 12
DLAMI (not Ray's `latest_dlami`), Ray pinned to this machine's Ray, jobrunner installed from the wheel that
`make wheel` builds and `file_mounts` copies, no placeholder."""

from __future__ import annotations

import json
import re
import subprocess
import zipfile
from importlib.metadata import version
from importlib.util import find_spec
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((REPO / "cluster.yaml").read_text())
DLAMI_SSM = "resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"


def _setup_text() -> str:
    return "\n".join(CONFIG["setup_commands"])


def test_cluster_yaml_matches_rays_schema() -> None:
    schema_path = Path(find_spec("ray").origin).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(CONFIG), key=lambda e: list(e.path))
    assert [f"{list(e.path)}: {e.message}" for e in errors] == []


def test_every_node_boots_the_current_cuda12_dlami() -> None:
    for name, node in CONFIG["available_node_types"].items():
        assert node["node_config"]["ImageId"] == DLAMI_SSM, name
    assert "latest_dlami" not in (REPO / "cluster.yaml").read_text().split("(Ray's own `latest_dlami`")[0]


def test_ray_is_pinned_to_this_machines_ray() -> None:
    pins = set(re.findall(r"ray\[default\]==([0-9][0-9a-z.]*)", _setup_text()))
    assert pins == {version("ray")}, (f"cluster.yaml pins Ray {pins}, this machine has {version('ray')}: "
                                      "update the pins so nodes and the submitting machine match")


def test_jobrunner_comes_from_the_mounted_wheel_without_placeholders() -> None:
    assert CONFIG["file_mounts"] == {"~/jobrunner-dist": "./dist"}
    assert "pip install -q ~/jobrunner-dist/jobrunner-*.whl" in _setup_text()
    text = (REPO / "cluster.yaml").read_text()
    assert not re.search(r"YOUR_|<your|git\+https|pip install -e", text)


@pytest.mark.timeout(600)
def test_make_wheel_builds_the_wheel_the_setup_installs() -> None:
    # -o: treat the venv as up to date (never reinstall the shared venv from a test).
    result = subprocess.run(["make", "-o", "venv", "-o", ".venv/.installed", "wheel"], cwd=REPO,
                            capture_output=True, text=True, timeout=280, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    wheels = sorted((REPO / "dist").glob("jobrunner-*.whl"))
    assert len(wheels) == 1 and wheels[0].name == f"jobrunner-{version('jobrunner')}-py3-none-any.whl"
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "jobrunner/cli/__init__.py" in names and "jobrunner/driver/job.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "jobrunner = jobrunner.cli:main" in zipfile.ZipFile(wheels[0]).read(entry_points).decode()
