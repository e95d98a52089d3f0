"""Ray's 'token authentication is enabled' notice: shown the first time on a machine, then folded away; the
warning that authentication is disabled is never hidden. Driven through Ray's own warning functions, so a
change of Ray's wording fails here."""

from __future__ import annotations

import logging

import pytest
from ray._private.authentication import authentication_token_setup as ray_auth

from jobrunner.driver.session import _TOKEN_LOGGER, TokenNoticeOnce, fold_token_notice


@pytest.fixture
def notice_logger():
    logger = logging.getLogger(_TOKEN_LOGGER)
    before = list(logger.filters)
    logger.filters = [f for f in before if not isinstance(f, TokenNoticeOnce)]
    yield logger
    logger.filters = before


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == _TOKEN_LOGGER]


def test_the_enabled_notice_shows_once_per_machine(tmp_path, caplog, notice_logger):
    marker = tmp_path / "cache" / "ray-token-notice-shown"
    fold_token_notice(marker)
    fold_token_notice(marker)  # a second job in the same process installs nothing more
    assert sum(isinstance(f, TokenNoticeOnce) for f in notice_logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=_TOKEN_LOGGER):
        ray_auth._warn_token_auth_enabled()
        ray_auth._warn_token_auth_enabled()
    shown = _messages(caplog)
    assert len(shown) == 1 and shown[0].startswith("Token authentication is enabled for this Ray cluster")
    assert marker.exists()


def _logged_on_a_machine_that_showed_it(tmp_path, caplog, warn, times: int) -> list[str]:
    """What Ray's ``warn`` logs ``times`` times in a process after the notice was shown on this machine."""
    marker = tmp_path / "ray-token-notice-shown"
    marker.write_text("shown\n")
    fold_token_notice(marker)
    with caplog.at_level(logging.WARNING, logger=_TOKEN_LOGGER):
        for _ in range(times):
            warn()
    return _messages(caplog)


def test_a_later_process_on_the_same_machine_does_not_show_it(tmp_path, caplog, notice_logger):
    assert _logged_on_a_machine_that_showed_it(tmp_path, caplog, ray_auth._warn_token_auth_enabled, 1) == []


def test_the_disabled_warning_always_shows(tmp_path, caplog, notice_logger):
    shown = _logged_on_a_machine_that_showed_it(tmp_path, caplog, ray_auth._warn_token_auth_disabled, 2)
    assert len(shown) == 2 and all(m.startswith("Token authentication is disabled") for m in shown)


def test_a_read_only_cache_keeps_ray_behaviour(tmp_path, caplog, notice_logger):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder\n")
    fold_token_notice(blocker / "ray-token-notice-shown")  # the marker's folder cannot be made
    with caplog.at_level(logging.WARNING, logger=_TOKEN_LOGGER):
        ray_auth._warn_token_auth_enabled()
        ray_auth._warn_token_auth_enabled()
    assert len(_messages(caplog)) == 2
