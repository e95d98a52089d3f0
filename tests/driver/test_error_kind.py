"""The error kinds a run's summary groups error rows by (driver/worker.error_kind)."""

from jobrunner.driver.worker import error_kind, error_kinds


def test_http_status_kept_other_numbers_folded():
    unauthorized = 'endpoint: HTTP 401: {"error":"Unauthorized"}'
    assert error_kind(unauthorized) == unauthorized
    assert error_kind("endpoint: gave up after 7 attempts (engine.endpoint.max_retries=6); last: HTTP 429: slow down") \
        == "endpoint: gave up after N attempts (engine.endpoint.max_retries=N); last: HTTP 429: slow down"
    assert error_kind("prompt has 9000 tokens (row p017)") == "prompt has N tokens"


def test_kinds_of_rows_group_by_status():
    rows = [{"error": "endpoint: HTTP 404: no such model"}, {"error": "endpoint: HTTP 404: no such model"},
            {"error": "endpoint: HTTP 400: bad field"}, {"error": None}]
    assert error_kinds(rows) == {"endpoint: HTTP 404: no such model": 2, "endpoint: HTTP 400: bad field": 1}


def test_connection_error_kind_not_cut_mid_word():
    error = ("endpoint: gave up after 7 attempts (engine.endpoint.max_retries=6); last: connection failed: "
             "ConnectionRefusedError: [Errno 111] Connection refused")
    assert error_kind(error).endswith("ConnectionRefusedError: [Errno N] Connection refused")
