"""Lost replies: a move or a put that happened on the server but whose reply never came back is resolved by
looking at the destination, on local disk and on the S3 server (the real moto server through s3fs)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from jobrunner.io.layout import part_key
from jobrunner.io.parts import commit_parts, read_part, write_attempt_part
from jobrunner.io.storage import Storage
from tests.io.test_io_storage import make_bucket


def _storage(where: str, tmp_path, request) -> Storage:
    if where == "file":
        return Storage(str(tmp_path / "out"))
    s3 = request.getfixturevalue("s3_server")
    return Storage(f"s3://{make_bucket(s3)}/out", s3["storage_options"])


class _LoseReplies:
    """Wraps one filesystem method: the first `n` calls do their work on the server, then raise as a
    connection dropped before the reply would (what a retry then sees is the server's real state)."""

    def __init__(self, real, n: int = 1, before: bool = False) -> None:
        self.real, self.n, self.before, self.calls = real, n, before, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.n:
            if not self.before:
                self.real(*args, **kwargs)
            raise ConnectionResetError("connection reset by peer (reply lost)")
        return self.real(*args, **kwargs)


TABLE = pa.table({"id": ["a", "b", "c"], "x": [1, 2, 3]})


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_move_whose_reply_was_lost_is_a_success(where, tmp_path, request, monkeypatch):
    storage = _storage(where, tmp_path, request)
    temp = write_attempt_part(storage, "att1", "s1", 0, TABLE)
    lose = _LoseReplies(storage.fs.mv)
    monkeypatch.setattr(storage.fs, "mv", lose)
    [size] = commit_parts(storage, [temp], [part_key("s1")])  # the retry finds no source: it looks at the part
    assert lose.calls == 1 and not storage.exists(temp)
    assert read_part(storage, part_key("s1")).equals(TABLE) and size == storage.fs.info(storage.path(
        part_key("s1")))["size"]


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_move_that_did_not_happen_is_retried(where, tmp_path, request, monkeypatch):
    storage = _storage(where, tmp_path, request)
    temp = write_attempt_part(storage, "att1", "s1", 0, TABLE)
    lose = _LoseReplies(storage.fs.mv, before=True)
    monkeypatch.setattr(storage.fs, "mv", lose)
    commit_parts(storage, [temp], [part_key("s1")])
    assert lose.calls == 2 and read_part(storage, part_key("s1")).equals(TABLE)


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_missing_source_with_another_destination_still_fails(where, tmp_path, request):
    storage = _storage(where, tmp_path, request)
    temp = write_attempt_part(storage, "att1", "s1", 0, TABLE)
    other = write_attempt_part(storage, "att2", "s1", 0, TABLE.slice(1))
    commit_parts(storage, [other], [part_key("s1")])
    storage.delete(temp)
    with pytest.raises(FileNotFoundError, match="no temporary key"):
        commit_parts(storage, [temp], [part_key("s1")])


@pytest.mark.parametrize("where", ["file", "s3"])
def test_a_put_whose_reply_was_lost_is_not_sent_again(where, tmp_path, request, monkeypatch):
    storage = _storage(where, tmp_path, request)
    lose = _LoseReplies(storage.put)
    monkeypatch.setattr(storage, "put", lose)
    storage.put_retried("_temporary/k", b"payload")
    assert lose.calls == 1 and storage.read_bytes("_temporary/k") == b"payload"
    # a put that did not happen is sent again
    lose = _LoseReplies(storage.put.real, before=True)
    monkeypatch.setattr(storage, "put", lose)
    storage.put_retried("_temporary/j", b"other")
    assert lose.calls == 2 and storage.read_bytes("_temporary/j") == b"other"
