"""CUDA-graph warm-up: which buckets are captured up front, once, before any step (the capture itself needs
CUDA, so here a recording stand-in replaces ``_capture``; the buckets, the padding step and the once-only
logic are the real code)."""

import torch

from jobrunner.attention.decode_graphs import MAX_GRAPHS, MAX_PADDED_KEYS, DecodeGraphs
from jobrunner.attention.step_graphs import StepGraphs
from jobrunner.attention.triton_backend import TritonBackend


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _recording(cls):
    class Recording(cls):
        captured: list

        def _capture(self, *args):
            self.captured = getattr(self, "captured", [])
            self.captured.append(args)
            return _Graph(), torch.zeros(4096, 8)
    return Recording


def test_step_graphs_warm_up_captures_every_bucket_once():
    backend = TritonBackend(4, 2, 16, torch.device("cpu"), max_num_seqs=8, max_model_len=256)
    kv = torch.zeros(1, 2, 17 * 16, 2, 8)
    graphs = _recording(StepGraphs)(torch.nn.Identity(), kv, backend, max_num_seqs=8, max_num_tokens=64,
                                    max_model_len=256, scratch_block=16, capture=True)
    keys = graphs.warm_up_keys()
    decode = [(b, 16, 0) for b in (1, 2, 4, 8)]                       # decode-only steps: tokens = rows <= 8
    chunk = [(b, 64, 0) for b in (2, 4, 8, 16, 24, 32, 48, 64)]        # steps with a prompt chunk: every bucket
    assert keys == sorted(decode + chunk)
    assert graphs.warm_up() == len(keys) and sorted(graphs.graphs) == keys and len(graphs.captured) == len(keys)
    t, meta = graphs.captured[-1]                                      # an all-padding step: no tile, scratch slots
    assert (meta.tile_row == -1).all() and (t["slot_mapping"] // 16 == 16).all()
    assert graphs.warm_up() == len(keys) and len(graphs.captured) == len(keys)   # once only
    assert graphs.stats()["graph_warmup_s"] is not None


def test_decode_graphs_warm_up_captures_the_smallest_shapes_once():
    kv = torch.zeros(1, 2, 8 * 16, 1, 4)
    graphs = _recording(DecodeGraphs)(torch.nn.Identity(), kv, 16, 256, 8192, scratch_block=7, capture=True)
    keys = graphs.warm_up_keys()
    assert len(keys) == MAX_GRAPHS and all(b * n * 16 <= MAX_PADDED_KEYS for b, n in keys)
    assert keys[0] == (1, graphs.context_buckets[0]) and len(set(keys)) == len(keys)
    assert [b * n for b, n in keys] == sorted(b * n for b, n in keys)
    assert graphs.warm_up() == MAX_GRAPHS and graphs.warm_up() == MAX_GRAPHS
    assert [c for c in graphs.captured] == keys                       # each once, in order
    batch = keys[-1][0]
    assert (graphs.slots[:batch] == 7 * 16).all()                      # padding rows write the scratch block


def test_step_graphs_warm_up_adds_split_decode_graphs_where_the_backend_may_split():
    """auto: decode buckets whose grid (rows x kv heads) is under the target get a split-K graph as well (fixed
    grid: the most segments a row can have); on: decode buckets are captured split only."""
    kv = torch.zeros(1, 2, 17 * 16, 2, 8)
    for mode, unsplit, split in (("auto", (1, 2, 4, 8), (1, 2, 4)), ("on", (), (1, 2, 4, 8))):
        backend = TritonBackend(4, 2, 16, torch.device("cpu"), max_num_seqs=8, max_model_len=256,
                                split_decode=mode, segment_keys=64)
        backend.target_programs = 16                                   # rows x 2 kv heads < 16: rows <= 7
        graphs = _recording(StepGraphs)(torch.nn.Identity(), kv, backend, max_num_seqs=8, max_num_tokens=16,
                                        max_model_len=256, scratch_block=16, capture=True)
        decode = [k for k in graphs.warm_up_keys() if k[1] == 16]
        assert decode == sorted([(b, 16, 0) for b in unsplit] + [(b, 16, 4) for b in split]), mode
        assert graphs.warm_up() == len(graphs.warm_up_keys())
        _, meta = graphs.captured[0]
        assert meta.num_segments in (0, 4)
