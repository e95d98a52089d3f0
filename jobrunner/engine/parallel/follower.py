"""Ranks > 0 of a tensor-parallel group: receive each step's commands, apply them, run the same step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobrunner.engine.parallel.commands import Control, broadcast_commands
from jobrunner.engine.parallel.group import leave_group, object_group
from jobrunner.engine.parallel.leader import apply_commands

if TYPE_CHECKING:
    from jobrunner.models.parallel import TensorParallel


class Follower:
    """A follower rank over its :class:`LLMEngine` (outputs are the leader's to hand back; a follower's are
    dropped)."""

    def __init__(self, engine: Any, tp: TensorParallel) -> None:
        self.engine = engine
        self.tp = tp
        self.num_steps = 0

    def serve(self) -> None:
        """Loop until the leader closes: receive a step's commands, apply them, step. Returns on ``close``;
        raises :class:`~jobrunner.engine.parallel.ParallelDivergence` on a divergence and the collective's
        error when a rank is lost (its timeout). Leaves the group either way."""
        try:
            while self._serve_one():
                pass
        finally:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            leave_group()

    def _serve_one(self) -> bool:
        """One message from the leader; False when it said ``close``."""
        commands = broadcast_commands(None, object_group(self.tp))
        controls = [c.word for c in commands if isinstance(c, Control)]
        if "close" in controls:
            return False
        if "rebuild" in controls:
            self.engine = self.engine.rebuild()
            return True
        if "replace" in controls:
            self.engine.close()
            self.engine = None
            self.engine = commands[0].options["build"](self.tp)
            return True
        if "idle" in controls:
            return True
        apply_commands(self.engine, commands)
        self.engine.step()
        self.num_steps += 1
        return True

