"""jobrunner.redaction on the shapes secrets take in error texts and URLs: each case plants a secret and checks
that it is gone and that the redaction marker took its place (so a no-op redactor fails)."""

from __future__ import annotations

import pytest

from jobrunner.redaction import REDACTED, find_secrets, is_secret_key, redact, redact_counts, redact_text

SECRET = "Zq8vK2mP9xL4"


def _assert_redacted(text: str, *secrets: str) -> str:
    out = redact_text(text)
    for secret in secrets or (SECRET,):
        assert secret not in out, out
    assert REDACTED in out, out
    return out


@pytest.mark.parametrize("text", [
    f'engine said {{"api_key": "{SECRET}"}}',
    f"engine said {{'token': '{SECRET}'}}",
    f'"password":"{SECRET}"',
    f"{{'key': 'AKIA', 'secret': '{SECRET} with spaces'}}",
    f'client_secret = "{SECRET}"',
    f"X-Api-Key: '{SECRET}'",
    f'{{\\"api_key\\": \\"{SECRET}\\"}}',  # JSON inside a JSON string
    f"aws_session_token={SECRET}",
    f"password: {SECRET}",
])
def test_quoted_and_plain_pairs(text):
    _assert_redacted(text)


def test_quoted_pair_keeps_the_name_and_quotes():
    assert redact_text(f'{{"api_key": "{SECRET}", "model": "m"}}') == '{"api_key": "***", "model": "m"}'
    assert redact_text(f"{{'token': '{SECRET}'}}") == "{'token': '***'}"


@pytest.mark.parametrize("url,kept", [
    (f"https://user:{SECRET}@models.example.com/llama/v1?token={SECRET}&rev=main",
     "https://***@models.example.com/llama/v1?token=***&rev=main"),
    ("http://127.0.0.1:9000/b/prompts.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     f"&X-Amz-Credential=AKIA%2F20261201%2Fus-east-1%2Fs3&X-Amz-Date=20261201T000000Z&X-Amz-Expires=3600"
     f"&X-Amz-Security-Token={SECRET}&X-Amz-Signature=0a1b2c3d4e5f60718293a4b5c6d7e8f9{SECRET}",
     "http://127.0.0.1:9000/b/prompts.jsonl?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***"
     "&X-Amz-Date=20261201T000000Z&X-Amz-Expires=3600&X-Amz-Security-Token=***&X-Amz-Signature=***"),
    (f"https://acc.blob.core.windows.net/c/in.parquet?sv=2022-11-02&sp=r&se=2026-12-02&sig={SECRET}%3D",
     "https://acc.blob.core.windows.net/c/in.parquet?sv=2022-11-02&sp=r&se=2026-12-02&sig=***"),
    (f"https://storage.googleapis.com/b/o.parquet?X-Goog-Date=20261201T000000Z&X-Goog-Signature={SECRET}",
     "https://storage.googleapis.com/b/o.parquet?X-Goog-Date=20261201T000000Z&X-Goog-Signature=***"),
    # a query value that looks generated is cut whatever its name
    (f"https://cdn.example.com/f.jsonl?download=1&k9=aB3dE5gH7jK9mN1pQ3sT5vX7z{SECRET}",
     "https://cdn.example.com/f.jsonl?download=1&k9=***"),
    (f"https://ghp_{SECRET}abcdefghijkl@github.com/org/repo", "https://***@github.com/org/repo"),
])
def test_urls_keep_scheme_host_path_and_lose_credentials(url, kept):
    assert redact_text(url) == kept
    assert redact_text(f"cannot read {url}: 403") == f"cannot read {kept}: 403"


def test_plain_urls_and_container_names_are_kept():
    for text in ("abfs://container@acc.dfs.core.windows.net/out", "s3://bucket/prefix/in.parquet?versionId=3",
                 "https://huggingface.co/org/model?revision=main"):
        assert redact_text(text) == text


@pytest.mark.parametrize("token", [
    f"hf_{SECRET}abcdefghijklmnop", f"sk-proj-{SECRET}abcdefghijklm", f"ghp_{SECRET}abcdefghijklmn",
    "AKIAIOSFODNN7EXAMPLE", f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.{SECRET}",
])
def test_token_shapes_are_cut_anywhere(token):
    _assert_redacted(f"upstream refused the request made with {token} (401)", token)


def test_module_paths_are_not_pairs():
    text = "engine.factory 'tests.driver.secret_engine:make_engine' and my_secrets.loader:build"
    assert redact_text(text) == text


def test_tokenizer_names_and_counts_are_not_secrets():
    assert not any(is_secret_key(k) for k in ("eos_token", "pad_token", "stop_token_ids", "max_tokens",
                                              "num_output_tokens", "token_ids"))
    assert all(is_secret_key(k) for k in ("token", "auth_token", "X-Amz-Security-Token", "sig", "apiKey"))
    text = "KeyError: 'prompt'; eos_token: '<|im_end|>'; max_tokens=5; key=3"
    assert redact_text(text) == text


def test_redact_counts_redacts_keys_and_merges():
    counts = {f'engine crashed: {{"api_key": "{SECRET}"}}': 2, 'engine crashed: {"api_key": "other"}': 3,
              "prompt too long": 1}
    assert redact_counts(counts) == {'engine crashed: {"api_key": "***"}': 5, "prompt too long": 1}


def test_redact_walks_structures():
    data = {"storage_options": {"key": "AK", "secret": SECRET, "endpoint_url": "http://h"},
            "errors": [f"password={SECRET}"], "stop_token_ids": [1, 2]}
    assert redact(data) == {"storage_options": {"key": "***", "secret": "***", "endpoint_url": "http://h"},
                            "errors": ["password=***"], "stop_token_ids": [1, 2]}


# Credential names as users write them: every case and separator, camelCase, one word.
CREDENTIAL_NAMES = [
    "pass", "PASS", "hub_pass", "HUB-PASS", "hubPass", "db.pass", "password", "Passwd", "pwd", "passphrase",
    "ssh_passphrase", "keyPassphrase", "secret", "client_secret", "token", "TOKEN", "hf_token", "HFToken",
    "accesstoken", "AccessToken", "access_token", "access-token", "ACCESSTOKEN", "apitoken", "api_token",
    "apiToken", "api_key", "API-KEY", "apikey", "x-api-key", "dsn", "DSN", "sentry_dsn", "SentryDsn",
    "sentrydsn", "credentials", "gcs_credentials", "creds", "auth", "Authorization", "refresh_token",
    "session_token", "private_key", "account_key", "connection_string",
]
# Names with a credential-looking word that are counts or vocabulary entries.
NOT_CREDENTIAL_NAMES = [
    "max_tokens", "num_tokens", "min_tokens", "maxTokens", "max_num_batched_tokens", "num_output_tokens",
    "skip_special_tokens", "eos_token", "pad_token", "stop_token_ids", "token_ids", "tokenizer",
    "tokenizer_path", "passes", "num_passes", "bypass", "compass", "author", "dsns_found", "model", "url",
]


@pytest.mark.parametrize("name", CREDENTIAL_NAMES)
def test_credential_names_match_whatever_their_case_and_separators(name):
    assert is_secret_key(name)
    assert redact({name: SECRET}) == {name: REDACTED}
    _assert_redacted(f"{name}={SECRET}")


@pytest.mark.parametrize("name", NOT_CREDENTIAL_NAMES)
def test_counts_and_vocabulary_names_are_no_credentials(name):
    assert not is_secret_key(name)
    assert redact({name: "kept"}) == {name: "kept"}


def test_a_count_is_kept_under_any_name():
    assert redact({"passes": 3, "token": 7, "pass": True}) == {"passes": 3, "token": 7, "pass": True}


def test_keys_are_scrubbed_too():
    """YAML turns `hf_...: 1` or a URL with a password followed by a colon into a key."""
    token_a, token_b = f"hf_{SECRET}abcdefghijklmnop", f"hf_{SECRET}qrstuvwxyzabcdef"
    data = {"factory_options": {token_a: 1, token_b: 2, f"https://u:{SECRET}@h/m": "x", "plain": "y"}}
    assert redact(data) == {"factory_options": {"***": 1, "*** #2": 2, "https://***@h/m": "x", "plain": "y"}}
    assert find_secrets(data) == ["factory_options.*** (a key)", "factory_options.*** (a key)",
                                  "factory_options.https://***@h/m (a key)"]


def _calls_in(package_dirs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(file, dotted callee) for every call in the files under `package_dirs` of jobrunner/."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "jobrunner"
    found = []
    for folder in package_dirs:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    name = ast.unparse(node.func)
                    no_args = not node.args and not node.keywords
                    found.append((path.relative_to(root).as_posix(), f"{name}()" if no_args else name))
    return found


def test_every_line_of_the_driver_and_the_cli_goes_through_the_redacting_path():
    """Printing, echoing and logging in driver/, io/, cli/ and reports/ only through the doors of
    jobrunner.redaction (say, redacting_logger) and cli/echo.py; `logging.getLogger()` (the root, no name)
    is read by the progress bar to find stream handlers, not logged to."""
    doors = {"cli/echo.py": {"click.echo"}}
    banned = {"print", "click.echo", "click.secho", "logging.getLogger", "sys.stderr.write", "sys.stdout.write",
              "warnings.warn", "tqdm.write", "logging.warning", "logging.info", "logging.error"}
    calls = _calls_in(("driver", "io", "cli", "reports"))
    assert ("driver/job.py", "redacting_logger") in calls and ("cli/job.py", "echo") in calls
    assert sorted({(f, c) for f, c in calls if c in banned and c not in doors.get(f, ())}) == []


def test_log_records_are_scrubbed_with_their_arguments_and_traceback(caplog):
    import logging

    from jobrunner.redaction import redacting_logger

    log = redacting_logger("jobrunner.tests.redaction")
    assert redacting_logger("jobrunner.tests.redaction").filters == log.filters and len(log.filters) == 1
    with caplog.at_level(logging.INFO):
        log.info("loading model %s", f"https://u:{SECRET}@h/m?token={SECRET}")
        try:
            raise ValueError(f"refused: password={SECRET}")
        except ValueError:
            log.exception("engine failed for %r", {"api_key": SECRET})
    assert [r.getMessage() for r in caplog.records] == ["loading model https://***@h/m?token=***",
                                                        "engine failed for {'api_key': '***'}"]
    assert SECRET not in caplog.text and "ValueError: refused: password=***" in caplog.text


def test_say_prints_one_redacted_line():
    import io

    from jobrunner.redaction import say

    out = io.StringIO()
    say(f"worker w0 placed; loading model https://u:{SECRET}@h/m", out)
    assert out.getvalue() == "worker w0 placed; loading model https://***@h/m\n"


FILE_NAMES = ["key_typo.yaml", "keys.parquet", "session_2026-12-02.json", "sessions.jsonl", "auth_config.yml",
              "private_notes.txt", "secret_santa.csv", "token_counts.csv", "tokens.json", "passwords_policy.md",
              "credentials_howto.md", "signature_check.py", "cookie_jar.log", "private_key.pem", "auth.toml",
              "dsn_list.ini", "pass_rates.tsv", "keyframes.arrow", "model.safetensors", "key_results.txt"]


@pytest.mark.parametrize("name", FILE_NAMES)
def test_a_message_about_a_file_keeps_every_word(name):
    for text in (f"Error: /home/me/jobs/{name}: job spec: model.source is required",
                 f"{name}: cannot read (permission denied)", f"cannot open ./data/{name}: no such file",
                 f"C:\\jobs\\{name}: bad line 3"):
        assert redact_text(text) == text


def test_credentials_beside_file_names_still_go():
    text = "jobs/key_typo.yaml: api_key: abc123 token=xyz password: hunter2"
    assert redact_text(text) == "jobs/key_typo.yaml: api_key: *** token=*** password: ***"
    assert redact_text("key: v") == "key: ***" and redact_text("session_token: v") == "session_token: ***"


# ---- issue 47: more credential names, counts beside a credential word, secrets by value ---------------------
@pytest.mark.parametrize("name", ["passcode", "conn_str", "connStr", "pat", "PAT", "url_pw", "db_pw", "hub_pass",
                                  "otp", "passkey", "github_pat", "DB_PASSCODE"])
def test_more_credential_names(name):
    assert is_secret_key(name)
    assert redact({name: SECRET}) == {name: REDACTED}
    _assert_redacted(f"{name}={SECRET}")


@pytest.mark.parametrize("name", ["pattern", "path", "include_stop_str_in_output", "power", "compat", "spot"])
def test_words_that_only_contain_the_new_names_are_no_credentials(name):
    assert not is_secret_key(name)


@pytest.mark.parametrize("text", ["secret-adv: 3/6 shards committed, 8 rows", "secret-adv: 12 rows",
                                  "token: 4.5%", "key=3"])
def test_a_count_beside_a_credential_word_is_kept(text):
    assert redact_text(text) == text


def test_known_values_are_cut_whatever_their_shape_or_name():
    from jobrunner.redaction import known_secret_values, remember_secrets

    key, pw = "JRknownKey47abc", "JRknown/Pw 47+x"
    remember_secrets([key, pw, "short"])
    assert {key, pw} <= set(known_secret_values()) and "short" not in known_secret_values()
    assert redact_text(f"login refused for credential {key} and {pw}") == "login refused for credential *** and ***"
    assert redact_text("pw as URL https://h/x?q=JRknown%2FPw+47%2Bx and JSON \"JRknown/Pw 47+x\"") == \
        'pw as URL https://h/x?q=*** and JSON "***"'
    assert redact({"note": f"digits folded later: {key}"}) == {"note": "digits folded later: ***"}


def test_secret_values_of_a_spec():
    from jobrunner.redaction import secret_values

    data = {"engine": {"factory_options": {
        "api_key": "JRv1apiKey", "hub_pass": "JRv1hubPass", "conn_str": "Server=db;Uid=jr;Pwd=JRv1connPw",
        "url": "https://jr:JRv1urlPw9@h.example.com/m", "model": "gpt-4o-mini", "key": "testing",
        "token": "abc", "retries": 3, "bearer_note": "use Bearer JRv1bearerTok"}},
        "input": {"url": "s3://bucket/in/"}}
    found = secret_values(data, env_values=["JRv1fromEnv", "tiny"])
    assert found == {"JRv1apiKey", "JRv1hubPass", "Server=db;Uid=jr;Pwd=JRv1connPw", "JRv1connPw",
                     "jr:JRv1urlPw9", "JRv1urlPw9", "use Bearer JRv1bearerTok", "JRv1bearerTok", "JRv1fromEnv"}


def test_an_endpoint_api_key_is_cut_by_value_from_an_answer_that_quotes_it(tmp_path, monkeypatch):
    """engine.backend openai: the key from ${env:NAME} (any shape, here a plain word) is known once the spec is
    loaded and once a worker builds its engine, so a server's 401 that quotes it never shows it."""
    import yaml

    from jobrunner.endpoint_backend.build import build_endpoint_engine
    from jobrunner.spec import load_spec

    monkeypatch.setenv("JR_ENDPOINT_KEY", "plainendpointkeyword")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(yaml.safe_dump({
        "name": "e", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "p"},
        "output": {"url": str(tmp_path / "out")}, "model": {"source": str(tmp_path / "no-tokenizer-here")},
        "engine": {"backend": "openai", "endpoint": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                                     "api_key": "${env:JR_ENDPOINT_KEY}"}}}))
    spec = load_spec(spec_file)
    assert spec.redacted()["engine"]["endpoint"]["api_key"] == "***"
    answer = "HTTP 401: Incorrect API key provided: plainendpointkeyword. You can find your key at ..."
    assert redact_text(answer) == "HTTP 401: Incorrect API key provided: ***. You can find your key at ..."
    monkeypatch.setenv("OPENAI_API_KEY", "otherplainkeyfromenv")  # a worker's own $OPENAI_API_KEY
    build_endpoint_engine(spec.model_copy(update={"engine": spec.engine.model_copy(update={
        "endpoint": spec.engine.endpoint.model_copy(update={"api_key": None})})})).close()
    assert redact_text("refused otherplainkeyfromenv") == "refused ***"
