"""The dashboard at /ui on a real gateway over loopback, on SQLite and PostgreSQL: auth, the
rollouts table (filters, sort, search, pages, live fragment), the rollout page, the run pages."""

from __future__ import annotations

import errno
import html as markup
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from fastapi.responses import HTMLResponse

from reins.monitor import dashboard, runs
from reins.monitor.dashboard import COOKIE, PAGE_SIZE
from tests.conftest import Gateway
from tests.monitor.factory import (
    chat_call,
    coding_rollout,
    declare,
    many_rollouts,
    post,
    write_run,
)


def ids_in(html: str) -> list[str]:
    return re.findall(r'href="/ui/rollouts/([^"/?]+)"', html)


def test_ui_needs_the_admin_key(gateway: Gateway) -> None:
    anonymous = gateway.client()
    response = anonymous.get("/ui", follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/login?next=/ui"
    assert gateway.client("wrong").get("/ui").status_code == 401
    assert anonymous.get("/ui/rows", follow_redirects=False).status_code == 303
    assert anonymous.get("/metrics").status_code == 401


def test_bearer_admin_key_gets_the_dashboard_html(gateway: Gateway) -> None:
    response = gateway.http.get("/ui")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "<h1>Rollouts</h1>" in response.text


def test_login_sets_a_cookie_that_opens_the_dashboard(gateway: Gateway) -> None:
    browser = gateway.client()
    wrong = browser.post("/ui/login", data={"key": "nope", "next": "/ui/runs"})
    assert wrong.status_code == 401
    assert "not the gateway" in wrong.text
    response = browser.post(
        "/ui/login", data={"key": gateway.api_key, "next": "/ui/runs"}, follow_redirects=False
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/ui/runs"
    cookie = response.cookies[COOKIE]
    assert gateway.api_key not in cookie
    assert "httponly" in response.headers["set-cookie"].lower()
    assert browser.get("/ui/runs").status_code == 200
    browser.post("/ui/logout")
    assert browser.get("/ui", follow_redirects=False).status_code == 303


def test_login_redirects_only_inside_the_dashboard(gateway: Gateway) -> None:
    response = gateway.client().post(
        "/ui/login",
        data={"key": gateway.api_key, "next": "https://evil.example/"},
        follow_redirects=False,
    )
    assert response.headers["location"] == "/ui"


def test_table_shows_reward_calls_tokens_and_versions(gateway: Gateway) -> None:
    coding_rollout(gateway, "fix-bug-1")
    html = gateway.http.get("/ui").text
    row = html[html.index('href="/ui/rollouts/fix-bug-1"') :].split("</tr>")[0]
    assert "succeeded" in row
    assert "reward-pos" in row and ">1<" in row
    assert ">6 <" in row and "(1 failed)" in row  # six model_request events, one failed
    assert "v3\u2013v4" in row
    assert "task-17" in row
    assert "demo</a> · 4" in row


def test_table_filters_by_status_mode_run_group_and_search(gateway: Gateway) -> None:
    many_rollouts(gateway, 20, run="alpha")
    many_rollouts(gateway, 3, run="beta")
    get = lambda query: ids_in(gateway.http.get(f"/ui?{query}").text)  # noqa: E731
    assert sorted(get("run=beta")) == ["beta-s1-r000", "beta-s1-r001", "beta-s1-r002"]
    assert sorted(get("run=alpha&status=failed")) == ["alpha-s1-r006", "alpha-s1-r013"]
    assert sorted(get("run=alpha&mode=val")) == ["alpha-s1-r009", "alpha-s1-r019"]
    assert sorted(get("group=alpha-g1")) == [f"alpha-s1-r00{i}" for i in range(4, 8)]
    assert get("q=what%20is%2017%20%2B") == ["alpha-s1-r017"]
    assert get("q=WHAT%20IS%2017%20%2B") == ["alpha-s1-r017"]
    assert get("q=100%25") == []  # LIKE wildcards are taken literally


def test_table_sorts_by_reward_and_pages(gateway: Gateway) -> None:
    ids = many_rollouts(gateway, PAGE_SIZE + 5, run="big")
    first = gateway.http.get("/ui?run=big&sort=reward&dir=asc").text
    assert "page 1 of 2" in first and f"{PAGE_SIZE + 5} rollouts" in first
    lowest = ids_in(first)[:5]
    assert all(int(rid[-3:]) % 3 == 0 for rid in lowest)  # reward 0 first
    second = ids_in(gateway.http.get("/ui?run=big&sort=reward&dir=asc&page=2").text)
    assert len(second) == 5
    assert set(ids_in(first)) | set(second) == set(ids)


def test_rows_fragment_picks_up_new_rollouts(gateway: Gateway) -> None:
    many_rollouts(gateway, 2, run="live")
    before = ids_in(gateway.http.get("/ui/rows?run=live").text)
    many_rollouts(gateway, 1, run="live", step=2)
    after = ids_in(gateway.http.get("/ui/rows?run=live").text)
    assert len(before) == 2 and len(after) == 3
    assert "<html" not in gateway.http.get("/ui/rows").text


def test_rollout_page_shows_calls_boundaries_logprobs_and_logs(gateway: Gateway) -> None:
    coding_rollout(gateway, "fix-bug-1")
    html = gateway.http.get("/ui/rollouts/fix-bug-1").text
    assert html.count('class="card call"') == 6
    assert "opens sequence 1" in html
    assert "merged into sequence 1" in html
    assert "split (unknown)" in html  # the reply was upper-cased before it went back
    assert "split (branch)" in html  # the summary prompt starts a fresh conversation
    assert "dropped as a retry: call 4 has the same prompt" in html
    assert "not trained on: failed call (status 502)" in html
    assert '<span class="t0 id"' in html  # a token sampled with p < 0.01 stands out
    assert "tool_result" in html and "sed -i ..." in html
    tool = html[html.index('class="card event tool"') :].split("</details>")[0]
    assert '<b class="mono">run_shell</b>' in tool and "failed" in tool
    assert "curl -s https://example.com/pager.py" in tool
    assert "Could not resolve host: example.com" in tool
    assert "3 passed in 0.12s" in html
    assert "3 training sequences" in html
    assert "3 earlier messages, as in call 1, not repeated" in html


def test_rollout_page_of_an_unknown_rollout_is_404(gateway: Gateway) -> None:
    assert gateway.http.get("/ui/rollouts/nope").status_code == 404


def test_raw_event_returns_the_stored_event(gateway: Gateway) -> None:
    coding_rollout(gateway, "fix-bug-1")
    seq = gateway.http.get("/api/rollouts/fix-bug-1/events").json()[0]["seq"]
    event = gateway.http.get(f"/ui/rollouts/fix-bug-1/events/{seq}").json()
    assert event["type"] == "model_request"
    assert event["data"]["prompt_token_ids"]
    assert gateway.http.get(f"/ui/rollouts/fix-bug-1/events/{seq + 1000}").status_code == 404


def test_rollout_version_changes_when_an_event_arrives(gateway: Gateway) -> None:
    gateway.http.post("/api/rollouts", json=[{"rollout_id": "r"}])
    gateway.http.post("/api/rollouts/r/attempts")
    before = gateway.http.get("/ui/rollouts/r/version").json()["version"]
    gateway.http.post("/api/rollouts/r/attempt/1/events", json={"type": "note", "data": {}})
    assert gateway.http.get("/ui/rollouts/r/version").json()["version"] != before


def test_run_pages_draw_the_trainers_curves(gateway: Gateway, runs_dir: Path) -> None:
    write_run(runs_dir, "demo")
    listing = gateway.http.get("/ui/runs").text
    assert 'href="/ui/runs/demo"' in listing
    html = gateway.http.get("/ui/runs/demo").text
    for title in (
        "Reward",
        "Policy entropy",
        "One-sample-rollout ratio",
        "Samples per rollout",
        "Split reasons",
        "Step time split",
        "my_custom/accuracy",  # a key no panel names gets a chart of its own
    ):
        assert f'aria-label="{title}' in html, title
    assert "1 unreadable line skipped" in html
    assert "group_size: 4" in html
    assert gateway.http.get("/ui/runs/demo/charts").text.count("<svg") >= 7
    assert gateway.http.get("/ui/runs/missing").status_code == 404
    assert gateway.http.get("/ui/runs/%2E%2E").status_code == 404


def test_dashboard_works_without_runs_dir(gateway: Gateway, runs_dir: Path) -> None:
    assert "No run yet" in gateway.http.get("/ui/runs").text
    runs_dir.rmdir()
    assert f"<code>{runs_dir}</code> does not exist (yet)." in gateway.http.get("/ui/runs").text
    assert gateway.http.get("/ui").status_code == 200
    runs_dir.write_text("a file where runs should be")
    assert f"<code>{runs_dir}</code> is not a folder" in gateway.http.get("/ui/runs").text
    assert gateway.http.get("/ui").status_code == 200


def test_ui_escapes_harness_text(gateway: Gateway) -> None:
    gateway.http.post(
        "/api/rollouts", json=[{"rollout_id": "x", "input": {"q": "<script>alert(1)</script>"}}]
    )
    html = gateway.http.get("/ui/rollouts/x").text
    assert "<script>alert(1)" not in html
    assert "&lt;script&gt;alert(1)" in html


def test_metrics_need_the_admin_key(gateway: Gateway) -> None:
    assert httpx.get(f"{gateway.url}/metrics").status_code == 401
    assert gateway.http.get("/metrics").status_code == 200


def test_run_page_shows_a_time_that_is_not_a_unix_time_as_written(
    gateway: Gateway, runs_dir: Path
) -> None:
    # metrics.jsonl may come from any tool: an ISO time, or a number past time_t, was a 500.
    for name, time in (("iso", '"2026-01-01T00:00:00"'), ("far", "1e20"), ("unix", "0")):
        (runs_dir / name).mkdir()
        (runs_dir / name / "metrics.jsonl").write_text(
            f'{{"step": 1, "reward/mean": 0.5, "time": {time}}}\n'
        )
    iso = gateway.http.get("/ui/runs/iso")
    assert iso.status_code == 200
    assert "at 2026-01-01T00:00:00" in iso.text
    far = gateway.http.get("/ui/runs/far")
    assert far.status_code == 200
    assert "at 1e+20" in far.text
    assert gateway.http.get("/ui/runs/unix").status_code == 200


def test_links_to_a_run_lead_to_it_whatever_its_name(gateway: Gateway, runs_dir: Path) -> None:
    # A run name put into a link as it is loses what follows a `#` or `&`: every link to the
    # run (its page, its rollouts) led to another run, or to none.
    name = "lr=1e-6&bs=8 #2+50%"
    write_run(runs_dir, name, steps=3)
    declare(
        gateway,
        [
            {"rollout_id": rid, "input": {}, "metadata": {"run": run, "step": 1}}
            for rid, run in (("mine-1", name), ("mine-2", name), ("theirs", "other"))
        ],
    )

    def hrefs(page: str) -> list[str]:
        return [markup.unescape(h) for h in re.findall(r'href="(/ui[^"]*)"', page)]

    rollout_page = gateway.http.get("/ui/rollouts/mine-1").text
    pages = gateway.http.get("/ui/runs").text, gateway.http.get("/ui").text, rollout_page
    run_links = {h for page in pages for h in hrefs(page) if h.startswith("/ui/runs/l")}
    assert run_links
    title = f'Run <span class="mono">{markup.escape(name)}</span>'
    for link in run_links:
        assert title in gateway.http.get(link).text, link
    run_page = gateway.http.get(run_links.pop()).text
    table_links = [h for page in (*pages, run_page) for h in hrefs(page) if "run=" in h]
    assert len(table_links) >= 6
    for link in table_links:
        assert parse_qs(urlsplit(link).query)["run"] == [name], link
        if "status=" not in link and "mode=" not in link:
            assert sorted(ids_in(gateway.http.get(link).text)) == ["mine-1", "mine-2"], link


def test_reading_a_run_does_not_hold_up_the_gateway(
    gateway: Gateway, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # metrics.jsonl was read on the event loop: a long run's megabytes held up every request of
    # the gateway (the proxy's included), and the rollouts page read every run's file for names.
    write_run(runs_dir, "demo")
    reading, release = threading.Event(), threading.Event()
    read, summary = runs.read_metrics, runs.summary

    def held(path: Path) -> runs.Metrics:
        reading.set()
        release.wait(60)
        return read(path)

    def held_summary(path: Path) -> tuple[int, dict[str, object]]:
        reading.set()
        release.wait(60)
        return summary(path)

    monkeypatch.setattr(runs, "read_metrics", held)
    monkeypatch.setattr(runs, "summary", held_summary)  # the runs list's read
    for path in ("/ui/runs", "/ui/runs/demo", "/ui/runs/demo/charts"):
        reading.clear()
        release.clear()
        with ThreadPoolExecutor(1) as pool:
            page = pool.submit(gateway.http.get, path)
            assert reading.wait(30)
            try:  # while the file is being read, the gateway answers
                assert httpx.get(f"{gateway.url}/healthz", timeout=5).status_code == 200
            finally:
                release.set()
            assert page.result().status_code == 200
    reading.clear()
    html = gateway.http.get("/ui").text  # its run filter names the runs, reading none
    assert '<option value="demo">' in html and not reading.is_set()


def test_rendering_a_rollout_does_not_hold_up_the_gateway(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long rollout's page (megabytes of token spans) was rendered on the event loop: seconds
    # in which the gateway answered nothing, the proxy included.
    coding_rollout(gateway, "fix-bug-1")
    rendering, release = threading.Event(), threading.Event()
    render = dashboard._html

    def held(name: str, **context: object) -> HTMLResponse:
        if name == "rollout.html":
            rendering.set()
            release.wait(60)
        return render(name, **context)

    monkeypatch.setattr(dashboard, "_html", held)
    with ThreadPoolExecutor(1) as pool:
        page = pool.submit(gateway.http.get, "/ui/rollouts/fix-bug-1")
        assert rendering.wait(30)
        try:
            assert httpx.get(f"{gateway.url}/healthz", timeout=5).status_code == 200
        finally:
            release.set()
        assert "call 6" in page.result().text


def test_a_tool_call_nested_past_the_json_reader_still_shows_its_rollout(
    gateway: Gateway,
) -> None:
    """Arguments are a string the harness or the model writes: ~1,000 brackets made Python's
    reader recurse past its stack, and the rollout's page a 500; shown as written instead."""
    arguments = "[" * 2000 + "]" * 2000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    declare(gateway, [{"rollout_id": "deep"}])
    gateway.http.post("/api/rollouts/deep/attempts")
    post(gateway, "deep", [chat_call(messages, "done")])
    page = gateway.http.get("/ui/rollouts/deep")
    assert page.status_code == 200, page.text[:300]
    assert "[" * 2000 in page.text


@pytest.mark.parametrize("run", [["x"], [1, 2], {"a": 1}, 7, True])
def test_a_run_that_is_not_a_string_leaves_the_table_and_its_rollout_readable(
    gateway: Gateway, run: object
) -> None:
    """Jinja's `urlencode` reads a list as key/value pairs: one rollout whose `metadata.run`
    was a list made the rollouts table a 500 for everyone. Its link carries the value's JSON."""
    declare(
        gateway,
        [
            {"rollout_id": "odd", "metadata": {"run": run, "step": 1}},
            {"rollout_id": "plain", "metadata": {"run": "demo", "step": 1}},
        ],
    )
    for path in ("/ui", "/ui/rows", "/ui/rollouts/odd"):
        response = gateway.http.get(path)
        assert response.status_code == 200, (path, response.text[:300])
    table = gateway.http.get("/ui").text
    assert sorted(ids_in(table)) == ["odd", "plain"]
    text = json.dumps(run, ensure_ascii=False)
    assert f'href="/ui/runs/{quote(text, safe="/")}"' in table


def test_a_run_name_no_folder_can_have_is_404(gateway: Gateway, runs_dir: Path) -> None:
    for path in ("/ui/runs/" + "a" * 256, "/ui/runs/" + "a" * 256 + "/charts"):
        response = gateway.http.get(path)
        assert response.status_code == 404, (path, response.text[:200])
        assert "is not a run name" in response.json()["error"]
    write_run(runs_dir, "b" * 255)
    assert gateway.http.get("/ui/runs/" + "b" * 255).status_code == 200


def test_dashboard_answers_may_not_be_framed_or_sniffed(gateway: Gateway) -> None:
    coding_rollout(gateway, "fix-bug-1")
    seq = gateway.http.get("/api/rollouts/fix-bug-1/events").json()[0]["seq"]
    anonymous = httpx.get(f"{gateway.url}/ui/login")
    for response in (
        gateway.http.get("/ui"),
        gateway.http.get("/ui/rollouts/fix-bug-1"),
        gateway.http.get(f"/ui/rollouts/fix-bug-1/events/{seq}"),
        anonymous,
    ):
        assert response.status_code == 200, response.text[:200]
        for name, value in dashboard.PAGE_HEADERS.items():
            assert response.headers.get(name) == value, name
    assert "frame-ancestors 'none'" in dashboard.PAGE_HEADERS["Content-Security-Policy"]
    assert "x-frame-options" not in gateway.http.get("/api/rollouts").headers


def test_every_dashboard_answer_carries_the_page_headers_errors_included(
    gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were only on the answers the handlers returned, not on those of what they raised."""
    anonymous = gateway.client()

    def broken(*args: object) -> None:
        raise RuntimeError("a defect")

    monkeypatch.setattr(dashboard, "_table", broken)
    answers = {
        "login redirect": (anonymous.get("/ui/runs", follow_redirects=False), 303),
        "wrong key": (gateway.client("wrong").get("/ui/runs"), 401),
        "no such rollout": (gateway.http.get("/ui/rollouts/nope"), 404),
        "no such run": (gateway.http.get("/ui/runs/nope"), 404),
        "no such page": (gateway.http.get("/ui/nope"), 404),
        "trailing slash": (gateway.http.get("/ui/runs/", follow_redirects=False), 307),
        "invalid query": (gateway.http.get("/ui/rollouts/nope?attempt=0"), 422),
        "defect": (gateway.http.get("/ui"), 500),
    }
    for what, (response, status) in answers.items():
        assert response.status_code == status, what
        for name, value in dashboard.PAGE_HEADERS.items():
            assert response.headers.get(name) == value, (what, name)
    assert answers["login redirect"][0].headers["location"] == "/ui/login?next=/ui/runs"
    assert answers["trailing slash"][0].headers["location"].endswith("/ui/runs")
    assert "no such route" in answers["no such page"][0].json()["error"]
    assert "RuntimeError" in answers["defect"][0].json()["error"]


def test_the_run_filter_is_the_run_name_as_written(gateway: Gateway) -> None:
    """It was stripped and cut to 200 characters: " lead" and a 230-character run found none."""
    long = "r" * 230
    declare(
        gateway,
        [
            {"rollout_id": "spaced", "metadata": {"run": " lead"}},
            {"rollout_id": "plain", "metadata": {"run": "lead"}},
            {"rollout_id": "long", "metadata": {"run": long}},
            {"rollout_id": "longer", "metadata": {"run": long + "r"}},
        ],
    )
    get = lambda run: ids_in(gateway.http.get("/ui", params={"run": run}).text)  # noqa: E731
    assert get(" lead") == ["spaced"]
    assert get("lead") == ["plain"]
    assert get(long) == ["long"]


def test_an_agent_log_tail_is_shown_once(gateway: Gateway) -> None:
    coding_rollout(gateway, "fix-bug-1")
    html = gateway.http.get("/ui/rollouts/fix-bug-1").text
    assert html.count("3 passed in 0.12s") == 1
    assert 'href="#log-tail"' in html and 'id="log-tail"' in html


def test_the_runs_list_shows_a_finished_runs_reward_and_its_training_steps(
    gateway: Gateway, runs_dir: Path
) -> None:
    """A finished run's last line is the final validation: the list showed no training reward,
    and counted that line as a step."""
    folder = write_run(runs_dir, "done", steps=20)
    metrics = folder / "metrics.jsonl"
    complete = metrics.read_text().rpartition("\n")[0] + "\n"  # without the half-written line
    final = {"step": 20, "time": 1_760_000_700, "val/reward_mean": 0.875, "weight_version": 20}
    metrics.write_text(complete + json.dumps(final) + "\n")
    last_reward = json.loads(complete.splitlines()[-1])["reward/mean"]
    html = gateway.http.get("/ui/runs").text
    row = html[html.index('href="/ui/runs/done"') :].split("</tr>")[0]
    cells = re.findall(r'<td class="num">([^<]*)</td>', row)
    assert cells == ["20", dashboard._number(last_reward), "0.875", "20"]
    page = gateway.http.get("/ui/runs/done").text
    assert "<dt>steps</dt><dd>20" in page


def test_a_run_whose_metrics_cannot_be_read_is_listed_with_why(
    gateway: Gateway, runs_dir: Path
) -> None:
    """One unreadable metrics.jsonl (another user's, a failing disk) made the runs list a 500
    for every run. Here the file reads as an I/O error: a link to the reader's own memory file,
    which is a regular file whose first page is never mapped (the tests run as root, whom no
    permission stops)."""
    write_run(runs_dir, "fine", steps=3)
    broken = runs_dir / "broken"
    broken.mkdir()
    (broken / "metrics.jsonl").symlink_to("/proc/self/mem")
    answer = gateway.http.get("/ui/runs")
    assert answer.status_code == 200
    row = answer.text[answer.text.index('href="/ui/runs/broken"') :].split("</tr>")[0]
    assert "cannot read metrics.jsonl: Input/output error" in row
    assert 'href="/ui/runs/fine"' in answer.text


@pytest.mark.parametrize("name", ["%41", "50% a+b", "é?x=1#y"])
def test_login_comes_back_to_the_page_asked_for_whatever_its_name(
    gateway: Gateway, runs_dir: Path, name: str
) -> None:
    """A run folder named `%41` came back after the login as `/ui/runs/%41`: run `A`'s page."""
    write_run(runs_dir, name, steps=3)
    write_run(runs_dir, "A", steps=3)
    browser = gateway.client()
    asked = f"/ui/runs/{quote(name, safe='')}?live=1"
    to_login = browser.get(asked, follow_redirects=False)
    assert to_login.status_code == 303
    form = browser.get(to_login.headers["location"]).text
    found = re.search(r'name="next" value="([^"]*)"', form)
    assert found is not None, form
    logged_in = browser.post(
        "/ui/login",
        data={"key": gateway.api_key, "next": markup.unescape(found.group(1))},
        follow_redirects=False,
    )
    assert logged_in.status_code == 303
    assert logged_in.headers["location"] == asked
    page = browser.get(logged_in.headers["location"])
    assert f'Run <span class="mono">{markup.escape(name)}</span>' in page.text


def test_a_run_folder_whose_name_is_not_utf8_leaves_the_pages_readable(
    gateway: Gateway, runs_dir: Path
) -> None:
    """A folder named in Latin-1 (`caf\\xe9`) made /ui and /ui/runs a 500: its name, read with a
    surrogate for the byte, could not be written into a page."""
    write_run(runs_dir, "fine", steps=3)
    write_run(runs_dir, os.fsdecode(b"caf\xe9 run"), steps=3)
    assert "fine" in gateway.http.get("/ui").text
    listing = gateway.http.get("/ui/runs")
    assert listing.status_code == 200
    assert 'href="/ui/runs/fine"' in listing.text
    assert "caf\ufffd run" in listing.text
    assert "its folder&#39;s name is not UTF-8 text" in listing.text


def test_logout_is_a_post_of_the_dashboards_own_pages(gateway: Gateway) -> None:
    """A GET logged out: any link or image on a page the viewer opened signed the viewer out.
    Now a GET shows the button, and a POST from another site's page is refused."""
    browser = gateway.client()
    browser.post("/ui/login", data={"key": gateway.api_key})
    page = browser.get("/ui")
    assert '<form class="logout" method="post" action="/ui/logout">' in page.text
    assert 'href="/ui/logout"' not in page.text
    shown = browser.get("/ui/logout")
    assert shown.status_code == 200
    assert '<form method="post" action="/ui/logout">' in shown.text
    assert shown.text.count('action="/ui/logout"') == 1  # its own button, none in the header
    assert "set-cookie" not in shown.headers
    # Nobody to log out on the login page: its one form is the login's (a header Log out
    # button came first, and a browser's Enter or first button posted the logout).
    login = gateway.client().get("/ui/login")
    assert "/ui/logout" not in login.text and login.text.count("<form") == 1
    assert browser.get("/ui", follow_redirects=False).status_code == 200  # still logged in
    foreign_pages = (
        {"origin": "https://evil.example"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site", "origin": "https://other.example"},
    )
    for foreign in foreign_pages:
        refused = browser.post("/ui/logout", headers=foreign, follow_redirects=False)
        assert refused.status_code == 403
        assert browser.get("/ui", follow_redirects=False).status_code == 200
    # Its own page, behind a TLS proxy: the browser's origin is https, the gateway's http.
    own = {"origin": gateway.url.replace("http://", "https://"), "sec-fetch-site": "same-origin"}
    for headers in (own, {"origin": own["origin"]}, {}):
        browser.post("/ui/login", data={"key": gateway.api_key})
        out = browser.post("/ui/logout", headers=headers, follow_redirects=False)
        assert (out.status_code, out.headers["location"]) == (303, "/ui/login")
        assert browser.get("/ui", follow_redirects=False).status_code == 303


def test_a_chart_poll_that_finds_no_change_sends_no_charts(
    gateway: Gateway, runs_dir: Path
) -> None:
    """Each open run page polls its charts every 10 s and got them all every time (~12 MB for
    600 metric keys of 200 steps), changed or not. The page names the tag of what it shows;
    unchanged, the poll is a 304 with no body."""
    folder = write_run(runs_dir, "polled", steps=5)
    page = gateway.http.get("/ui/runs/polled").text
    found = re.search(r'data-etag="([^"]+)"', page)
    assert found is not None, page
    shown = markup.unescape(found.group(1))
    same = gateway.http.get("/ui/runs/polled/charts", headers={"if-none-match": shown})
    assert (same.status_code, same.content, same.headers["etag"]) == (304, b"", shown)
    with (folder / "metrics.jsonl").open("a") as metrics:
        metrics.write("\n" + json.dumps({"step": 6, "reward/mean": 0.123456}) + "\n")
    changed = gateway.http.get("/ui/runs/polled/charts", headers={"if-none-match": shown})
    assert changed.status_code == 200
    assert "0.123" in changed.text and changed.headers["etag"] != shown
    again = gateway.http.get(
        "/ui/runs/polled/charts", headers={"if-none-match": changed.headers["etag"]}
    )
    assert again.status_code == 304
    # The rollouts table's polled body too.
    many_rollouts(gateway, 2, run="live")
    rows = gateway.http.get("/ui/rows?run=live")
    unchanged = gateway.http.get(
        "/ui/rows?run=live", headers={"if-none-match": rows.headers["etag"]}
    )
    assert (unchanged.status_code, unchanged.content) == (304, b"")


def _denied_under(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Looking into `folder` fails as it does for a folder without search permission (EACCES;
    the tests run as root, whom no permission stops)."""
    stat = Path.stat

    def denied(path: Path, *args: object, **kwargs: object) -> os.stat_result:
        if path.parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "stat", denied)


def test_a_run_folder_it_may_not_look_into_leaves_the_pages_readable(
    gateway: Gateway, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Path.is_file` raises for EACCES: a run folder without search permission made /ui and
    /ui/runs a 500 for every run."""
    write_run(runs_dir, "fine", steps=3)
    locked = write_run(runs_dir, "locked", steps=3)
    _denied_under(monkeypatch, locked)
    table = gateway.http.get("/ui")
    assert table.status_code == 200
    assert '<option value="fine">' in table.text and '<option value="locked">' not in table.text
    listing = gateway.http.get("/ui/runs")
    assert listing.status_code == 200
    row = listing.text[listing.text.index('href="/ui/runs/locked"') :].split("</tr>")[0]
    assert "cannot look into its folder: Permission denied" in row
    assert 'href="/ui/runs/fine"' in listing.text
    assert gateway.http.get("/ui/runs/locked").status_code == 404


def test_a_runs_dir_it_may_not_read_says_so(
    gateway: Gateway, runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_run(runs_dir, "hidden", steps=3)

    def denied(path: object) -> list[str]:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "listdir", denied)
    monkeypatch.setattr(os, "scandir", denied)
    assert gateway.http.get("/ui").status_code == 200
    listing = gateway.http.get("/ui/runs")
    assert listing.status_code == 200
    assert "cannot be read: Permission denied" in listing.text
