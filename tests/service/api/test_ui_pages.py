"""The web pages, in-process: what each page shows, that it escapes what clients sent, reads like the JSON routes
(tokens included), writes nothing, stays bounded, and answers errors as pages. On SQLite: the pages' reads are
tested on both backends in tests/service/test_page_reads.py, and in a real browser in
tests/service/test_ui_browser.py."""

from __future__ import annotations

import base64
import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from remat.client.measurement import Measurement
from remat.client.planning.planners import PLANNERS
from remat.service import jobs, migrate, repository
from remat.service.api.app import create_app
from remat.service.config import ServiceSettings
from remat.service.db import Database
from remat.service.models import MeasurementRow
from remat.service.ui.links import key_url
from remat.service.ui.pages import PAGE_SIZE
from tests.service.factories import TOKEN, closed_port_url
from tests.utils.ui_seed import Seeded, architecture_hash, seed_jobs, seed_keys

READ_TOKEN = "ui-read-token"


@pytest.fixture(scope="module")
def migrated_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty database at the schema's head, copied for each store below (migrating takes half a second)."""
    path = tmp_path_factory.mktemp("ui-template") / "empty.sqlite"
    db = Database(f"sqlite:///{path}")
    migrate.upgrade(db)
    db.dispose()
    return path


@dataclass
class Store:
    db: Database
    url: str
    clients: list[TestClient]

    def client(self, **settings: Any) -> TestClient:
        values: dict[str, Any] = {"database_url": self.url, "redis_url": None, "broker_url": closed_port_url(),
                                  "api_token": TOKEN, "auto_migrate": False, **settings}
        client = TestClient(create_app(ServiceSettings(**values)))
        self.clients.append(client)
        return client.__enter__()

    def close(self) -> None:
        for client in self.clients:
            client.__exit__(None, None, None)
        self.db.dispose()


def _store(template: Path, directory: Path) -> Store:
    path = directory / "plans.sqlite"
    shutil.copy(template, path)
    url = f"sqlite:///{path}"
    return Store(db=Database(url), url=url, clients=[])


@pytest.fixture(scope="module")
def site(migrated_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Seeded]]:
    """One seeded store and its app for the tests that only read: three keys, a job in each state, a batch."""
    store = _store(migrated_file, tmp_path_factory.mktemp("ui-site"))
    seeded = seed_jobs(store.db, into=seed_keys(store.db, 3))
    yield store.client(), seeded
    store.close()


@pytest.fixture
def fresh(migrated_file: Path, tmp_path: Path) -> Iterator[Store]:
    """An empty store of the test's own."""
    store = _store(migrated_file, tmp_path)
    yield store
    store.close()


@pytest.fixture
def client(site: tuple[TestClient, Seeded]) -> TestClient:
    return site[0]


@pytest.fixture
def seeded(site: tuple[TestClient, Seeded]) -> Seeded:
    return site[1]


def _text(html: str) -> str:
    """The page's text, tags dropped and entities decoded (what a reader sees)."""
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)))


def _links(html: str) -> list[str]:
    return [unescape(h) for h in re.findall(r'(?:href|src)="([^"]+)"', html)]


def test_the_front_page_links_the_web_pages_and_the_api(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert {"/ui/", "/docs", "/healthz"} <= set(_links(page.text))


def test_the_architectures_page_lists_every_key_with_its_figures(client: TestClient, seeded: Seeded) -> None:
    page = client.get("/ui/")
    assert page.status_code == 200
    text = _text(page.text)
    assert "3 stored plan keys" in text
    for key, name in zip(seeded.keys, seeded.names, strict=True):
        assert name in text and key.model_hash[:10] in text
        assert key_url(key) in _links(page.text)
    row = re.search(r"<tr>\s*<td><a class=\"key\".*?</tr>", page.text, re.S)
    assert row is not None
    cells = _text(row.group(0))
    assert re.search(r"\d+\.\d MiB .*\d+\.\d MiB (?:linear|nested) .*\d+\.\d% .*[+-]\d+\.\d% .*[+-]\d+\.\d%",
                     cells), cells


def test_every_link_of_every_page_answers(client: TestClient, seeded: Seeded) -> None:
    seen: set[str] = set()
    shown: set[str] = set()  # a key's page is followed for one chosen plan (each answers alike)
    todo = ["/ui/", "/ui/jobs", "/ui/zoo"]
    while todo:
        url = todo.pop()
        page = re.sub(r"&algorithm=[^&#]*", "", url)
        if url in seen or (".svg" not in url and page in shown):
            continue
        seen.add(url)
        shown.add(page)
        response = client.get(url)
        assert response.status_code == 200, (url, response.status_code, _text(response.text)[:300])
        if response.headers["content-type"].startswith("text/html"):
            todo.extend(link.split("#")[0] for link in _links(response.text)
                        if link.startswith("/ui") and link.split("#")[0] not in seen)
    assert len([u for u in seen if u.startswith("/ui/plans/") and ".svg" not in u]) >= 3
    assert len([u for u in seen if u.startswith("/ui/jobs/")]) >= 4


def test_search_matches_a_name_substring_or_a_hash_prefix(fresh: Store) -> None:
    seed_keys(fresh.db, 3, names=["torchvision:resnet50", "hf:gpt2", "100%_sure"], stages=(12,))
    client = fresh.client()
    by_name = _text(client.get("/ui/", params={"q": "RESNET"}).text)
    assert "torchvision:resnet50" in by_name and "hf:gpt2" not in by_name and "1 stored plan key " in by_name
    by_hash = _text(client.get("/ui/", params={"q": architecture_hash(1)[:8]}).text)
    assert "hf:gpt2" in by_hash and "resnet50" not in by_hash
    # LIKE's wildcards are searched for as themselves
    assert "100%_sure" in _text(client.get("/ui/", params={"q": "0%_s"}).text)
    assert "No stored key matches" in _text(client.get("/ui/", params={"q": "r%t"}).text)


def test_a_frontier_point_below_the_chains_names_its_planner(fresh: Store) -> None:
    """The key page's frontier says whose plan its tightest point is, as ``plan MODEL`` says ``budget (nested)``."""
    from remat.client.plan_key import PlanKey
    from remat.client.planning.plans import plans_to_store
    from remat.service import repository
    from tests.client.planning.test_max_batch import NESTING_WINS
    from tests.client.test_derived_trace import profile

    trace = profile(8, NESTING_WINS, torch_version="2.15", model_hash="ab" * 32)
    plans = plans_to_store(trace)
    assert any(p.budget_bytes and p.planned_by == "nested" for p in plans)  # the case this test needs
    with fresh.db.write_session() as session:
        repository.store_profile(session=session, trace=trace, plans=plans, measurements={})
    page = fresh.client().get(key_url(PlanKey.from_trace(trace)))
    assert page.status_code == 200
    frontier = _text(page.text.split('<section id="frontier">')[1].split("</section>")[0])
    assert re.search(r"MiB nested: [\d,]+ \(nested's plan\)", frontier), frontier
    assert frontier.count("'s plan") == 1  # the chain points are the frontier's own


def test_the_architectures_page_is_paginated_and_small(fresh: Store) -> None:
    seed_keys(fresh.db, PAGE_SIZE + 1, stages=(12,), timelines=False)
    client = fresh.client()
    first = client.get("/ui/")
    assert first.text.count('class="key"') == PAGE_SIZE
    assert len(first.content) < 200_000
    assert '/ui/?page=2' in first.text
    second = client.get("/ui/", params={"page": 2})
    assert second.text.count('class="key"') == 1 and "page 2 of 2" in _text(second.text)
    assert client.get("/ui/", params={"page": 0}).status_code == 422


def test_the_key_page_shows_every_plan_predicted_beside_measured(client: TestClient, seeded: Seeded) -> None:
    key = seeded.keys[0]
    page = client.get(key_url(key))
    assert page.status_code == 200
    text = _text(page.text)
    for algorithm in PLANNERS:
        assert re.search(rf"<th scope=\"row\">{re.escape(algorithm)}</th>", page.text), algorithm
    assert "2 measured" in text  # the frontier's validated points
    assert key.model_hash in text and seeded.names[0] in text
    # the pictures, the stages and the lines that fetch the plan
    assert key_url(key, "/timeline.svg", algorithm="linear") in _links(page.text)
    assert key_url(key, "/frontier.svg", algorithm="linear") in _links(page.text)
    assert "features.12.block" in text
    assert ("remat.client.fetch_and_apply(model, (2, 3, 64, 64), server='http://testserver', algorithm='linear', "
            "dtype='float32', grads='none', mode='train', device='cpu')") in text
    assert (f"remat-client plan {seeded.names[0]} --batch-size 2 --input-shape 3,64,64 --dtype float32 --device cpu "
            f"--grads none --algorithm linear --server http://testserver") in text
    assert f"curl -s 'http://testserver/v1/plans/{key.model_hash}?input_shape=2%2C3%2C64%2C64" in text
    chosen = client.get(key_url(key, algorithm="chen-sqrt"))
    assert key_url(key, "/timeline.svg", algorithm="chen-sqrt") in _links(chosen.text)
    assert "--algorithm chen-sqrt" in _text(chosen.text)


def test_the_curl_line_fetches_exactly_the_plan(client: TestClient, seeded: Seeded) -> None:
    key = seeded.keys[1]
    text = _text(client.get(key_url(key)).text)
    url = re.search(r"curl -s '([^']+)'", text)
    assert url is not None
    record = client.get(url.group(1).removeprefix("http://testserver"))
    assert record.status_code == 200 and record.json()["key"] == key.to_dict()
    assert record.json()["plan"]["algorithm"] == "linear"


def test_a_key_of_a_call_signature_links_and_fetches_exactly(fresh: Store) -> None:
    signature = "input_ids: int64[2, 64]; mask=a&b+c%20; use_cache=False"
    key = seed_keys(fresh.db, 1, stages=(12,), names=["hf:gpt2"], metadata={"inputs": signature,
                                                                            "input_shape": [2, 64]}).keys[0]
    assert key.inputs == signature and key.input_shape == (2, 64)
    client = fresh.client()
    listing = client.get("/ui/")
    assert key_url(key) in _links(listing.text)
    page = client.get(key_url(key))
    assert page.status_code == 200
    text = _text(page.text)
    assert signature in text
    assert "remat.client.fetch_and_apply(model, inputs, server='http://testserver'" in text
    assert "remat-client plan hf:gpt2 --batch-size 2 --seq-len 64 " in text
    curl = re.search(r"curl -s '([^']+)'", text)
    assert curl is not None
    record = client.get(curl.group(1).removeprefix("http://testserver"))
    assert record.status_code == 200 and record.json()["key"]["inputs"] == signature
    for picture in re.findall(r'src="([^"]+\.svg[^"]*)"', page.text):
        assert client.get(unescape(picture)).status_code == 200


def test_a_long_trace_shows_its_stages_a_page_at_a_time(fresh: Store) -> None:
    key = seed_keys(fresh.db, 1, stages=(250,)).keys[0]
    client = fresh.client()
    first = _text(client.get(key_url(key)).text)
    assert "stages 1–200 of 250" in first and "features.200.block" in first and "features.201.block" not in first
    second = _text(client.get(key_url(key, stages=2)).text)
    assert "stages 201–250 of 250" in second and "features.250.block" in second
    assert "features.200.block" not in second


def test_the_pictures_are_svg_drawn_once_per_version_of_the_keys_rows(fresh: Store) -> None:
    key = seed_keys(fresh.db, 1, stages=(12,)).keys[0]
    client, db = fresh.client(), fresh.db
    for what in ("/timeline.svg", "/frontier.svg"):
        url = key_url(key, what, algorithm="linear")
        picture = client.get(url)
        assert picture.status_code == 200 and picture.headers["content-type"] == "image/svg+xml"
        root = ET.fromstring(picture.content)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert root.find("{http://www.w3.org/2000/svg}path") is not None  # a drawn curve, not the empty picture
        assert picture.headers["content-security-policy"] == "default-src 'none'"
        etag = picture.headers["etag"]
        assert client.get(url, headers={"If-None-Match": etag}).status_code == 304
    timeline = client.get(key_url(key, "/timeline.svg", algorithm="linear")).text
    assert "no checkpointing: measured, peak" in timeline and "linear plan: measured, peak" in timeline
    frontier = ET.fromstring(client.get(key_url(key, "/frontier.svg", algorithm="linear")).content)
    circles = frontier.findall(".//{http://www.w3.org/2000/svg}circle")
    assert len(circles) >= len(PLANNERS) + 2  # every plan measured, two frontier points, legend marks
    # a new measurement is a new version: the picture is drawn again and its ETag changes
    url = key_url(key, "/timeline.svg", algorithm="linear")
    before = client.get(url).headers["etag"]
    with db.write_session() as session:
        repository.store_measurement(session=session, key=key, algorithm="linear",
                                     measurement=Measurement(measured_peak_bytes=123, step_ms=1.0))
    after = client.get(url, headers={"If-None-Match": before})
    assert after.status_code == 200 and after.headers["etag"] != before


def test_plans_measured_at_one_point_share_one_label_in_the_trade_picture(fresh: Store) -> None:
    key = seed_keys(fresh.db, 1, stages=(12,)).keys[0]
    with fresh.db.write_session() as session:  # one step, measured once: both plans carry its figures
        for algorithm in ("linear", "nested"):
            repository.store_measurement(session=session, key=key, algorithm=algorithm,
                                         measurement=Measurement(measured_peak_bytes=5 * 2**20, step_ms=900.0))
    for chosen in ("linear", "cubic"):
        picture = ET.fromstring(fresh.client().get(key_url(key, "/frontier.svg", algorithm=chosen)).content)
        labels = ["".join(t.itertext()) for t in picture.iter("{http://www.w3.org/2000/svg}text")]
        assert "linear, nested" in labels, labels
        assert "linear" not in labels and "nested" not in labels, labels


def test_a_picture_without_a_timeline_says_why(fresh: Store) -> None:
    key = seed_keys(fresh.db, 1, stages=(12,)).keys[0]
    client = fresh.client()
    with fresh.db.write_session() as session:  # measurements stored before timelines were recorded
        session.execute(update(MeasurementRow).values(extra=None))
    empty = client.get(key_url(key, "/timeline.svg", algorithm="linear"))
    assert empty.status_code == 200 and "carry no timeline" in empty.text and "<path" not in empty.text
    assert "<path" in client.get(key_url(key, "/frontier.svg")).text  # drawn from the measured peaks alone


def test_an_unknown_key_job_or_batch_is_a_404_page(client: TestClient, seeded: Seeded) -> None:
    key = seeded.keys[0]
    for url in (key_url(key).replace(key.model_hash, "f" * 64), f"/ui/jobs/{'0' * 8}-0000-0000-0000-{'0' * 12}",
                f"/ui/zoo/{'0' * 8}-0000-0000-0000-{'0' * 12}", "/ui/nothing-here",
                key_url(key, "/timeline.svg").replace(key.model_hash, "f" * 64)):
        response = client.get(url)
        assert response.status_code == 404, url
        assert response.headers["content-type"].startswith("text/html")
        assert "<h1>404</h1>" in response.text
    malformed = client.get("/ui/jobs/not-a-uuid")
    assert malformed.status_code == 422 and "job_id" in _text(malformed.text)
    assert client.get(key_url(key, algorithm="no-such-planner")).status_code == 422


def test_jobs_show_state_progress_and_why_they_failed(client: TestClient, seeded: Seeded) -> None:
    page = client.get("/ui/jobs")
    text = _text(page.text)
    for state in ("pending", "queued", "running", "succeeded", "failed"):
        assert f'class="state state-{state}"' in page.text
    assert "measuring linear" in text and "40%" in text
    assert "RuntimeError: out of memory while profiling stage features.3" in text
    assert '<meta http-equiv="refresh" content="2">' in page.text  # work is running
    failed = client.get(f"/ui/jobs/{seeded.jobs['failed'].id}")
    assert "Failed because" in _text(failed.text) and '<meta http-equiv="refresh"' not in failed.text
    running = client.get(f"/ui/jobs/{seeded.jobs['running'].id}")
    assert '<meta http-equiv="refresh" content="2">' in running.text
    succeeded = client.get(f"/ui/jobs/{seeded.jobs['succeeded'].id}")
    assert key_url(seeded.keys[0]) in _links(succeeded.text)
    assert all(re.search(rf"<th scope=\"row\">{re.escape(a)}</th>", succeeded.text) for a in PLANNERS)
    only_failed = _text(client.get("/ui/jobs", params={"state": "failed"}).text)
    assert "measuring linear" not in only_failed and "RuntimeError" in only_failed


def test_a_planning_job_reads_as_one(fresh: Store) -> None:
    with fresh.db.write_session() as session:
        job, _ = jobs.create_job(session=session, kind="plan", queue="plan",
                                 request={"trace_id": 7, "algorithms": ["cubic"]}, request_key="plan:7")
    client = fresh.client()
    assert "trace 7: cubic" in _text(client.get("/ui/jobs").text)
    page = client.get(f"/ui/jobs/{job.id}")
    assert page.status_code == 200 and "trace 7: cubic" in _text(page.text)


def test_a_page_of_finished_jobs_does_not_reload(client: TestClient) -> None:
    assert '<meta http-equiv="refresh"' not in client.get("/ui/jobs", params={"state": "succeeded"}).text


def test_zoo_batches_show_each_models_row_or_reason(client: TestClient, seeded: Seeded) -> None:
    listing = client.get("/ui/zoo")
    assert f"/ui/zoo/{seeded.batch_id}" in _links(listing.text)
    assert '<meta http-equiv="refresh" content="2">' in listing.text
    batch = client.get(f"/ui/zoo/{seeded.batch_id}")
    text = _text(batch.text)
    assert "2 of 4 finished" in text
    for model in ("torchvision:resnet18", "torchvision:mobilenet_v3_small", "torchvision:resnet50",
                  "torchvision:vgg11"):
        assert model in text
    assert "RuntimeError: out of memory" in text and "measuring linear" in text
    assert re.search(r"\d+\.\d MiB \d+\.\d MiB \d+\.\d% \+\d+\.\d%", text)  # the finished model's row


def test_everything_clients_sent_is_escaped(fresh: Store) -> None:
    seed_jobs(fresh.db, into=seed_keys(fresh.db, 1, names=['<img src=x onerror="alert(1)">'], stages=(12,)))
    client = fresh.client()
    for url in ("/ui/", "/ui/jobs", "/ui/?q=%3Cscript%3E"):
        html = client.get(url).text
        assert "<img src=x" not in html and "<script>x</script>" not in html and "<script>" not in html
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in client.get("/ui/").text


def test_pages_carry_a_strict_policy_and_no_script_or_inline_style(client: TestClient, seeded: Seeded) -> None:
    for url in ("/ui/", key_url(seeded.keys[0]), "/ui/jobs", f"/ui/jobs/{seeded.jobs['running'].id}", "/ui/zoo",
                f"/ui/zoo/{seeded.batch_id}"):
        response = client.get(url)
        policy = response.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "unsafe-inline" not in policy
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "<script" not in response.text and ' style="' not in response.text
        assert not re.search(r"<[a-zA-Z][^>]*\son[a-z]+\s*=", response.text)  # no inline event handler


def test_pages_write_nothing(client: TestClient, seeded: Seeded) -> None:
    for url in ("/ui/", key_url(seeded.keys[0]), "/ui/jobs", f"/ui/zoo/{seeded.batch_id}"):
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            response = client.request(method, url)
            assert response.status_code == 405, (method, url)
            assert response.headers["content-type"].startswith("text/html")


def test_pages_are_not_in_the_api_schema(client: TestClient) -> None:
    assert not [path for path in client.get("/openapi.json").json()["paths"] if path == "/" or path.startswith("/ui")]


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_pages_follow_the_read_token_rule(fresh: Store) -> None:
    key = seed_keys(fresh.db, 1, stages=(12,)).keys[0]
    client = fresh.client(read_token_required=True, read_token=READ_TOKEN)
    for url in ("/ui/", key_url(key), key_url(key, "/frontier.svg"), "/ui/jobs", "/ui/static/ui.css"):
        refused = client.get(url)
        assert refused.status_code == 401, url
        assert refused.headers["www-authenticate"].startswith("Basic realm=")  # the browser asks for the token
        for headers in (_basic("someone", "wrong"), {"Authorization": "Bearer wrong"}, _basic(READ_TOKEN, ""),
                        {"Authorization": "Basic %%%"}):
            assert client.get(url, headers=headers).status_code == 401, (url, headers)
        for headers in (_basic("someone", READ_TOKEN), _basic("", TOKEN), {"Authorization": f"Bearer {READ_TOKEN}"}):
            assert client.get(url, headers=headers).status_code == 200, (url, headers)
    assert client.get("/").status_code == 200  # the front page holds links only
    assert client.get(key_url(key), headers=_basic("u", READ_TOKEN)).text.count('REMAT_READ_TOKEN') >= 2
    assert fresh.client().get("/ui/").status_code == 200  # open by default, like the JSON routes


def test_the_picture_cache_is_bounded(fresh: Store) -> None:
    keys = seed_keys(fresh.db, 3, stages=(12,)).keys
    client = fresh.client()
    cache = client.app.state.ui_pictures  # type: ignore[attr-defined]
    cache.size = 4
    for key in keys:
        for what in ("/timeline.svg", "/frontier.svg"):
            assert client.get(key_url(key, what)).status_code == 200
    assert len(cache) == 4
