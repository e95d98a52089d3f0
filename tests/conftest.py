"""Fixtures shared by every test package.

- `s3_server`: a real S3-compatible server (moto in server mode) on 127.0.0.1, on a port the OS picks; if it
  cannot start, the S3 tests fail under ``CI=true`` and skip elsewhere (see ``tests/components.py``).
- `local_ray`: a small local Ray shared by the modules of one test process (see the fixture).
- `tiny_llama_hf_dir`: a 2-layer random Llama saved in Hugging Face layout with a small byte-level BPE
  tokenizer and a ChatML chat template (what `jobrunner.models.sources` accepts as a local model dir).

Heavy imports stay inside the fixtures so collecting tests that do not use them stays cheap.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `tests.*` helper modules import the same under `pytest` and `python -m pytest`
    sys.path.insert(0, str(REPO))

from tests.components import missing_component, require_import  # noqa: E402

_EXIT_STATUS: list[int] = []
LOCAL_RAY_CPUS = 2
_SHARED_RAY: dict[str, str] = {}  # the gcs address of the local Ray this process started for `local_ray`
_RAY_MODULES: set[str] = set()  # test modules with a test that uses `local_ray`


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--repeat N``: run each selected test N times in a row in one session (module and session fixtures, such as
    the fault tests' Ray cluster, are set up once): how a flaky-under-load claim is checked, e.g.
    ``stress --cpu 2 & pytest -x --repeat 30 tests/driver/test_faults.py::test_restart_cap_...``."""
    parser.addoption("--repeat", type=int, default=1, help="run each selected test N times in a row")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test`` runs two workers) the workers share the machine's cores: each runs torch
    on one thread, so two CPU-bound tests never run four OpenMP threads on two cores (threads spinning on each
    other made such a test 30x slower). A test that needs more threads sets them itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    repeat = metafunc.config.getoption("repeat")
    if repeat > 1:
        metafunc.fixturenames.append("repeat_index")
        metafunc.parametrize("repeat_index", range(repeat))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _RAY_MODULES.update(item.nodeid.split("::")[0] for item in items if "local_ray" in item.fixturenames)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A module that does not use `local_ray` never sees it: a shared Ray left up by an earlier module is shut down
    first (a test running `jobrunner run` in-process must start its own local Ray, as a user's would)."""
    if item.nodeid.split("::")[0] not in _RAY_MODULES and _SHARED_RAY:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        _SHARED_RAY.clear()


def _shared_ray_is_up(ray) -> bool:
    if not ray.is_initialized() or not _SHARED_RAY:
        return False
    try:
        return ray.get_runtime_context().gcs_address == _SHARED_RAY["address"]
    except Exception:  # noqa: BLE001 - a half-closed connection: start a new one
        return False


def _all_cpus_free(ray, wait_s: float = 30.0) -> bool:
    """Whether every CPU of the shared Ray is free again (the workers of a module's jobs have exited): polled up
    to ``wait_s`` (a loaded machine ends Ray workers slowly; a free Ray answers at once)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= LOCAL_RAY_CPUS:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest):
    """A small local Ray (2 CPUs, no dashboard), shared by the modules of one test process in turn.

    Starting Ray costs ~5 s; one instance serves every module that asks for it. A module that needs another Ray (a
    multi-node cluster, a head started as a user would) shuts this one down first, and the next module that asks
    starts a new one. After each module every CPU must be free again (its jobs' workers gone); if not, the
    instance is shut down, so that no module inherits another's actors, and the module FAILS, named: a job whose
    workers outlive it is a bug (of the job or of the test).
    """
    import ray

    if not _shared_ray_is_up(ray):
        if ray.is_initialized():
            ray.shutdown()
        # address="local": always a new instance, even while another test's cluster (same machine) has written
        # /tmp/ray/ray_current_cluster, which a bare ray.init() would try to join.
        ray.init(address="local", num_cpus=LOCAL_RAY_CPUS, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
        _SHARED_RAY["address"] = ray.get_runtime_context().gcs_address
    yield
    if ray.is_initialized() and not _all_cpus_free(ray):
        held = {k: v for k, v in ray.available_resources().items() if k == "CPU"}
        ray.shutdown()
        _SHARED_RAY.clear()
        pytest.fail(f"{request.module.__name__} left work on the shared local Ray: 30 s after its last test "
                    f"{LOCAL_RAY_CPUS} CPUs were not free again (available: {held or 'none'}); its jobs' "
                    "workers must end with the job", pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def no_leaked_ray(request: pytest.FixtureRequest):
    """A module that connects to a Ray of its own (a cluster, a head started as a user would) shuts it down
    itself; one left connected after the module's fixtures ended FAILS that module, named (it was shut down
    silently before, and the next module then started on another module's Ray)."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or _shared_ray_is_up(ray):
        return
    try:
        address = ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a half-closed connection still counts as left open
        address = "unknown address"
    ray.shutdown()
    pytest.fail(f"{request.module.__name__} left a Ray connection open ({address}) after its tests: shut it down "
                "in the fixture that started it", pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close this process's Ray connection (tests that run ``jobrunner run`` in-process open one)."""
    _EXIT_STATUS.append(int(exitstatus))
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the process with pytest's status once every report is written, skipping interpreter teardown.

    A full suite once passed (721 passed) and then died with SIGSEGV at exit: the kernel log put the fault in a
    gRPC thread of Ray's ``cygrpc`` extension, jumping to freed memory while the interpreter was being torn down.
    That is a race inside gRPC's shutdown, not in any test, but it turned a green run red.
    ``JOBRUNNER_TESTS_HARD_EXIT=0`` restores the normal teardown.
    """
    if _EXIT_STATUS and os.environ.get("JOBRUNNER_TESTS_HARD_EXIT", "1") != "0":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Batch inference runs many prompts together; a block holds sixteen tokens.",
    "Hello world! 0123456789 What is the capital of France? Paris.",
]


@pytest.fixture(scope="session")
def s3_server():
    """Start moto's S3 server once per session; yields {"endpoint_url", "storage_options"} for s3fs.

    Buckets are shared by the whole session: give each test its own bucket name.
    """
    moto_server = require_import("moto.server", "the S3 tests need moto's server (pip install 'moto[server]')")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    try:
        server.start()
    except Exception as exc:  # noqa: BLE001 - any reason it cannot start is the same missing component
        missing_component(f"moto's S3 server did not start on 127.0.0.1: {exc!r}")
    host, port = server.get_host_and_port()
    endpoint_url = f"http://{host}:{port}"
    storage_options = {
        "key": "testing",
        "secret": "testing",
        "endpoint_url": endpoint_url,
    }
    yield {"endpoint_url": endpoint_url, "storage_options": storage_options}
    server.stop()


@pytest.fixture(scope="session")
def tiny_llama_hf_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama (hidden 64) + tokenizer saved with save_pretrained; read-only for tests."""
    out_dir = tmp_path_factory.mktemp("tiny_llama_hf")
    tokenizer = make_tiny_tokenizer()
    model = make_tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def tiny_smolvlm_dir(tmp_path_factory) -> Path:
    """A random tiny SmolVLM (Idefics3) + its processor saved with save_pretrained (tests/vision_helpers.py);
    read-only for tests."""
    from tests.vision_helpers import build_tiny_smolvlm

    return build_tiny_smolvlm(tmp_path_factory.mktemp("tiny_smolvlm"))


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer (~300 tokens) with ChatML special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TINY_CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_llama(vocab_size: int, eos_token_id: int):
    """A seeded random LlamaForCausalLM: 2 layers, hidden 64, 4 heads, 2 kv heads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()
