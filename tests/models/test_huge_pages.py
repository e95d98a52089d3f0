"""Huge pages asked for under the KV cache and the packed weights (models/huge_pages.py): the advice reaches the
kernel (the mapping's VmFlags carry `hg`, MADV_HUGEPAGE), and it is skipped where it cannot apply."""

from __future__ import annotations

import sys

import pytest
import torch

from jobrunner.models import huge_pages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside, flags = False, None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            flags = line.split()[1:]
    assert flags is not None, "no mapping holds the address"
    return flags


@linux
def test_a_large_tensor_gets_the_advice_before_it_is_written(monkeypatch):
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "weights")
    t = huge_pages.empty_huge(8 << 20, dtype=torch.uint8)
    first = -(-t.data_ptr() // huge_pages.HUGE) * huge_pages.HUGE
    assert "hg" in _vm_flags(first)
    t.fill_(1)
    assert int(t.sum()) == 8 << 20


@linux
def test_where_it_does_not_apply_nothing_is_asked(monkeypatch):
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "weights")
    assert not huge_pages.advise_huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # no whole 2 MB page
    big = torch.empty(8 << 20, dtype=torch.uint8)
    assert not huge_pages.advise_huge_pages(big, "kv_cache")  # weights only
    assert huge_pages.huge_pages_for("weights") and not huge_pages.huge_pages_for("kv_cache")
    monkeypatch.delenv(huge_pages.HUGE_PAGES_ENV)  # the default: none
    assert not huge_pages.advise_huge_pages(big) and not huge_pages.huge_pages_for("weights")
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "all")
    assert huge_pages.huge_pages_for("kv_cache")
    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "some")
    with pytest.raises(ValueError, match="expected one of 0, weights, all"):
        huge_pages.huge_pages_for("weights")


@linux
def test_the_engines_cpu_kv_cache_asks_for_huge_pages_when_told(monkeypatch):
    from tests.engine.tiny import engine_from_hf, make_hf_model, make_tokenizer

    monkeypatch.setenv(huge_pages.HUGE_PAGES_ENV, "all")
    engine = engine_from_hf(make_hf_model("llama"), make_tokenizer(), num_kv_blocks=2048)
    cache = engine.runner.kv_cache
    assert cache.untyped_storage().nbytes() >= 4 * huge_pages.HUGE and not cache.any()  # zeroed, as before
    assert "hg" in _vm_flags(-(-cache.data_ptr() // huge_pages.HUGE) * huge_pages.HUGE)
