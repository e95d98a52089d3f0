"""The bench's per-run engine counters: speculative decoding's acceptance rate is the run's own, not a difference."""

from jobrunner.bench.ours import stats_delta


def test_acceptance_rate_is_recomputed_from_the_run_counts():
    before = {"num_draft_tokens": 100, "num_accepted_tokens": 90, "draft_acceptance_rate": 0.9}
    after = {"num_draft_tokens": 300, "num_accepted_tokens": 140, "draft_acceptance_rate": 140 / 300}
    out = stats_delta(before, after)
    assert out["num_draft_tokens"] == 200 and out["num_accepted_tokens"] == 50
    assert out["draft_acceptance_rate"] == 0.25
