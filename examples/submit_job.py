"""Submit a job spec to a Ray cluster from Python (what `jobrunner submit --wait` does).

    python examples/submit_job.py jobs/example.yaml http://127.0.0.1:8265 --set sampling.max_tokens=32

The cluster needs jobrunner installed on every node (see cluster.yaml). With Ray token authentication the
token is taken from $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token. Secrets in the spec must be
${env:NAME} references, set on the head (docs/driver.md, Secrets).
"""

import argparse
import sys

from jobrunner.driver.submit import follow_job, submit_job
from jobrunner.spec import load_spec, load_spec_data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job_file")
    parser.add_argument("address", help="Ray dashboard address, e.g. http://HEAD:8265")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = parser.parse_args()
    spec = load_spec(args.job_file, args.overrides, resolve_env=False)  # validate; ${env:NAME} stays as written
    data, _ = load_spec_data(args.job_file, args.overrides)
    client, job_id = submit_job(data, args.address)
    print(f"submitted {spec.name!r} as Ray job {job_id}")
    status = follow_job(client, job_id, sys.stdout)
    print(f"Ray job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
