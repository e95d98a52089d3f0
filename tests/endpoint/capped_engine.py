"""`engine.factory: tests.endpoint.capped_engine:make_engine`: the fake engine (tests/driver/fake_engine.py)
with a spending cap counted in finished rows, as the endpoint engine behaves at its cap: the requests in
flight finish, then `step()` raises EngineStopped while rows wait."""

from __future__ import annotations

from jobrunner.engine.contract import EngineStopped
from jobrunner.engine.request import RequestOutput
from tests.driver.fake_engine import FakeEngine


class CappedEngine(FakeEngine):
    """Finishes at most `max_rows` rows, then stops."""

    def __init__(self, max_rows: int, **settings) -> None:
        super().__init__(**settings)
        self.max_rows = max_rows

    def step(self) -> list[RequestOutput]:
        room = self.max_rows - self._num_finished
        if room <= 0:
            raise EngineStopped(f"cost.max_usd reached: this worker finished its {self.max_rows} rows; "
                                f"{self.num_unfinished_requests} request(s) not sent")
        held, self._waiting = self._waiting[room:], self._waiting[:room]  # only what the cap lets go
        try:
            return super().step()
        finally:
            self._waiting += held


def make_engine(spec, max_rows: int = 6) -> CappedEngine:
    return CappedEngine(max_rows, max_num_seqs=spec.engine.max_num_seqs,
                        max_model_len=spec.engine.max_model_len or 512)
