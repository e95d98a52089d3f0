"""An engine double whose error texts carry the credential it was built with (as a real client's errors may):
for the secrets tests (tests/driver/test_secrets_job.py).

`engine.factory: tests.driver.secret_engine:make_engine`, `engine.factory_options: {api_key: ...}`. A prompt
containing ROWERR finishes as an error row whose text quotes the key in three forms (`{"api_key": "<key>-q1"}`,
`'token': '<key>-q2'`, `"password":"<key>-q3"`); REJECT makes add_request raise with `'token': '<key>-rj'`;
CRASH makes step() raise with `Authorization: Bearer <key>-cr` (the worker's engine fails, the row is isolated).
"""

from __future__ import annotations

from tests.driver.fake_engine import FakeEngine


class SecretEngine(FakeEngine):
    """FakeEngine with credential-bearing error texts."""

    def __init__(self, api_key: str, **kwargs) -> None:
        super().__init__(fail_on="CRASH", **kwargs)
        self.api_key = api_key

    def add_request(self, request_id: str, prompt, params, **kwargs) -> None:
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        if "REJECT" in text:
            raise ValueError(f"upstream refused the request: {{'token': '{self.api_key}-rj'}}")
        super().add_request(request_id, prompt, params, **kwargs)
        if "ROWERR" in text:
            self._waiting[-1].error = (f'upstream error {{"api_key": "{self.api_key}-q1"}}, '
                                       f"'token': '{self.api_key}-q2', \"password\":\"{self.api_key}-q3\"")

    def rebuild(self) -> SecretEngine:
        """The same engine anew (the worker rebuilds it after a crash, to isolate the crashing row)."""
        return SecretEngine(self.api_key, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            step_delay_s=self.step_delay_s)

    def step(self):
        try:
            return super().step()
        except RuntimeError:
            raise RuntimeError(f"backend down; sent Authorization: Bearer {self.api_key}-cr") from None


def make_engine(spec, api_key: str, step_delay_s: float = 0.0) -> SecretEngine:
    """Factory for `engine.factory: tests.driver.secret_engine:make_engine`."""
    return SecretEngine(api_key, max_num_seqs=spec.engine.max_num_seqs,
                        max_model_len=spec.engine.max_model_len or 512, step_delay_s=step_delay_s)


def make_engine_with_credentials(spec, **credentials) -> FakeEngine:
    """Factory taking any named options, as a hosted client's would (`hub_pass`, `dsn`, `passphrase`, ...):
    they are only carried, so that a test can look for them in what the job writes and prints."""
    return FakeEngine(max_num_seqs=spec.engine.max_num_seqs, max_model_len=spec.engine.max_model_len or 512)


class LoginEngine(FakeEngine):
    """An engine double whose errors quote its credentials in free text, as a hosted client's may: a prompt
    containing LOGIN finishes as an error row `login refused for credential <api_key> and <hub_pass>`; one
    containing OPTIONS as an error row that prints every option it was built with (a dict repr)."""

    def __init__(self, options: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.options = options

    def add_request(self, request_id: str, prompt, params, **kwargs) -> None:
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        super().add_request(request_id, prompt, params, **kwargs)
        if "LOGIN" in text:
            self._waiting[-1].error = (f"login refused for credential {self.options['api_key']} and "
                                       f"{self.options['hub_pass']}")
        elif "OPTIONS" in text:
            self._waiting[-1].error = f"cannot connect with {self.options}"

    def rebuild(self) -> LoginEngine:
        """The same engine anew."""
        return LoginEngine(self.options, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)


def make_login_engine(spec, **options) -> LoginEngine:
    """Factory for `engine.factory: tests.driver.secret_engine:make_login_engine` (symptom 12 of issue 47): any
    options (api_key, hub_pass, passcode, conn_str, pat, url_pw, ...); `fail_load: true` makes the factory
    itself raise, printing them."""
    if options.get("fail_load"):
        raise RuntimeError(f"login refused for credential {options.get('api_key')}; options {options}")
    return LoginEngine(options, max_num_seqs=spec.engine.max_num_seqs,
                       max_model_len=spec.engine.max_model_len or 512)
