import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_hf_model, make_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def hf_llama():
    return make_hf_model("llama")
