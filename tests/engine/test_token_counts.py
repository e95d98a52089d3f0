"""Penalty state kept on the device and updated per step gives the penalized logits of counting afresh."""

import random

import torch

from jobrunner.engine.request import Request, RequestStatus
from jobrunner.engine.sampling import penalties
from jobrunner.engine.sampling.token_counts import MIN_CAPACITY, DevicePenaltyState
from jobrunner.engine.sampling_params import SamplingParams

VOCAB = 97


def _request(rid: str, rng: random.Random, sample_index: int = 0, length: int = 0) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(length or rng.randrange(1, 30))]
    params = SamplingParams(max_tokens=64, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7)
    return Request(rid, prompt, params, 0.0, sample_index=sample_index)


def _both_ways(state: DevicePenaltyState, requests: list[Request], repetition: list[float], seed: int):
    logits = torch.randn(len(requests) + 2, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    rows = list(range(1, len(requests) + 1))    # rows 0 and last are not penalized
    presence, frequency = [0.4, -0.3, 0.0, 1.1][:len(requests)], [0.7, 0.0, 0.25, -0.5][:len(requests)]
    want = logits.clone()
    penalties.apply_penalties(want, rows, [r.prompt_token_ids for r in requests],
                              [r.output_token_ids for r in requests], repetition, presence, frequency)
    got = logits.clone()
    state.apply(got, rows, requests, repetition, presence, frequency)
    return got, want


def test_incremental_counts_equal_counting_afresh_every_step():
    rng = random.Random(0)
    counts = DevicePenaltyState(torch.device("cpu"))
    live = [_request("a", rng), _request("a", rng, sample_index=1), _request("b", rng, length=240)]
    for step in range(40):
        for r in live:                            # one new token each (a repeat now and then)
            r.output_token_ids.append(rng.choice(r.all_token_ids) if rng.random() < 0.4 else rng.randrange(VOCAB))
        # repetition penalty only from step 5 on; the second "b" outgrows the id table's first width (256)
        repetition = [1.0] * len(live) if step < 5 else [1.3, 1.0, 0.8, 1.6][:len(live)]
        got, want = _both_ways(counts, live, repetition, step)
        assert torch.equal(got, want), step
        if step == 12:                            # "b" finishes; a new request takes its key and a fresh row
            live[2].status = RequestStatus.FINISHED_STOPPED
            counts.release(live[2].key)
            live[2] = _request("b", rng, length=240)
        if step == 20:                            # a different request under a key still held: counted afresh
            live[1] = _request("a", rng, sample_index=1)
        if step == 30:                            # an output rolled back (e.g. rejected draft tokens)
            del live[0].output_token_ids[-3:]
    assert counts.capacity == MIN_CAPACITY and len(counts.rows) == 3 and counts.ids.shape[1] == 512


def test_rows_of_finished_requests_are_reclaimed_before_the_table_grows():
    rng = random.Random(1)
    counts = DevicePenaltyState(torch.device("cpu"))
    for i in range(3 * MIN_CAPACITY):             # never released, but finished before the next one starts
        r = _request(f"r{i}", rng)
        r.output_token_ids += [1, 2, 2]
        got, want = _both_ways(counts, [r], [1.2], i)
        assert torch.equal(got, want)
        r.status = RequestStatus.FINISHED_LENGTH
    assert counts.capacity == MIN_CAPACITY
