"""The dashboard's answers gzipped when the client takes gzip (its `Accept-Encoding`), as a
browser does: the run page and its polled charts, on a real gateway over loopback."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import httpx
import pytest

from reins.monitor.dashboard import GZIP_MIN_BYTES, accepts_gzip
from tests.conftest import Gateway
from tests.monitor.factory import write_run


def raw_get(gateway: Gateway, path: str, accept_encoding: str | None) -> httpx.Response:
    """`path` as sent, its body not decoded (a raw read of the stream)."""
    headers = {"Authorization": f"Bearer {gateway.api_key}"}
    if accept_encoding is not None:
        headers["Accept-Encoding"] = accept_encoding
    with (
        httpx.Client(base_url=gateway.url, timeout=60) as client,
        client.stream("GET", path, headers=headers) as response,
    ):
        response.read_raw = b"".join(response.iter_raw())  # type: ignore[attr-defined]
        return response


def many_keys_run(runs_dir: Path, keys: int, steps: int) -> None:
    """A run whose metrics have `keys` numeric keys of their own (a chart each)."""
    folder = runs_dir / "wide"
    folder.mkdir()
    lines = [
        json.dumps({"step": step, **{f"agent/k{k}": (step * k) % 7 / 7 for k in range(keys)}})
        for step in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_a_changed_chart_fragment_is_gzipped_for_a_client_that_takes_gzip(
    gateway: Gateway, runs_dir: Path
) -> None:
    """A changed charts fragment (and the run page holding the same charts) was sent whole,
    12.9 MB at 600 metric keys, to a browser that takes gzip; now gzipped, and the same text
    once decoded. A client that does not take gzip gets it as it is."""
    many_keys_run(runs_dir, keys=60, steps=50)
    for path in ("/ui/runs/wide/charts", "/ui/runs/wide"):
        plain = raw_get(gateway, path, "identity")
        packed = raw_get(gateway, path, "gzip, deflate, br")
        assert plain.status_code == packed.status_code == 200
        assert "content-encoding" not in plain.headers
        assert packed.headers["content-encoding"] == "gzip"
        assert "Accept-Encoding" in packed.headers["vary"]
        whole = plain.read_raw  # type: ignore[attr-defined]
        sent = packed.read_raw  # type: ignore[attr-defined]
        assert int(packed.headers["content-length"]) == len(sent)
        assert gzip.decompress(sent) == whole
        assert len(sent) * 5 < len(whole)
        assert packed.headers.get("etag") == plain.headers.get("etag")
    # The page's poll, gzipped, still names the charts it shows: unchanged, a 304 with no body.
    charts = raw_get(gateway, "/ui/runs/wide/charts", "gzip")
    same = gateway.http.get(
        "/ui/runs/wide/charts", headers={"if-none-match": charts.headers["etag"]}
    )
    assert (same.status_code, same.content) == (304, b"")


def test_a_client_that_refuses_gzip_gets_the_answer_as_it_is(
    gateway: Gateway, runs_dir: Path
) -> None:
    write_run(runs_dir, "plain", steps=20)
    for refusal in ("gzip;q=0, identity", "*;q=0, identity", "br", ""):
        answer = raw_get(gateway, "/ui/runs/plain/charts", refusal)
        assert "content-encoding" not in answer.headers, refusal
        assert b"<svg" in answer.read_raw  # type: ignore[attr-defined]
    # A small answer is not worth it: sent as it is whatever the client takes.
    small = raw_get(gateway, "/ui/rollouts/none", "gzip")
    assert small.status_code == 404
    assert len(small.read_raw) < GZIP_MIN_BYTES  # type: ignore[attr-defined]
    assert "content-encoding" not in small.headers


@pytest.mark.parametrize(
    ("header", "takes"),
    [
        ("gzip", True),
        ("GZIP ; q=0.5", True),
        ("deflate, gzip;q=1.0, *;q=0.5", True),
        ("*", True),
        ("x-gzip", True),
        ("gzip;q=0", False),
        ("gzip;q=0.000, *", False),
        ("*;q=0", False),
        ("br, identity", False),
        ("gzip;q=oops", False),
        ("", False),
    ],
)
def test_accept_encoding_is_read_with_its_weights(header: str, takes: bool) -> None:
    assert accepts_gzip(header) is takes
