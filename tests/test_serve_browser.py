"""The web page of `ragspec serve` in headless Chromium (Debian's /usr/bin/chromium driven by Playwright): the
page loads, an answer streams in with at least one highlighted citation, and clicking it shows the source
document at exactly that span. The screenshot is README's (docs/serve.png; rewritten when RAGSPEC_SCREENSHOT
names a path, else saved under the test's tmp folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api")

from serve_util import SPEC, LiveServer, build_test_index, make_pipeline  # noqa: E402 - after the skips

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
QUESTION = "Where does the Danube rise and where does it end?"

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed")


@pytest.fixture(scope="module")
def live(tmp_path_factory, embedder):
    from ragspec.models.generator import load_generator
    from ragspec.serve.app import Server, create_app

    index_path = build_test_index(tmp_path_factory.mktemp("browser"), embedder)
    pipe = make_pipeline(index_path, embedder, *load_generator(SPEC["generator"]["model"]))
    srv = LiveServer(create_app(Server(pipe, model_name=SPEC["generator"]["model"], index_label=str(index_path))))
    yield srv
    srv.stop()


def test_page_streams_an_answer_with_clickable_citations(live, tmp_path):
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1180, "height": 620})
            page.goto(live.url + "/")
            assert page.title() == "ragspec"
            page.fill("#question", QUESTION)
            page.click("#go")
            # text streams in before the answer is done
            page.wait_for_function("document.getElementById('answer').textContent.length > 0", timeout=60_000)
            page.wait_for_selector("body[data-done='1']", timeout=120_000)
            assert page.locator("#sources li").count() >= 1
            marks = page.locator("#answer mark")
            assert marks.count() >= 1, "at least one highlighted citation"
            stats = page.inner_text("#stats")
            assert "tokens/step" in stats and "time to first token" in stats

            mark = max((marks.nth(i) for i in range(marks.count())), key=lambda m: len(m.inner_text()))
            mark.click()
            page.wait_for_selector("#doc mark#span", timeout=10_000)
            shown = page.inner_text("#doc mark#span")
            quote = mark.get_attribute("title")  # "[n] path start–end"
            start, end = (int(x) for x in quote.rsplit(" ", 1)[1].split("–"))
            path = quote.split(" ", 1)[1].rsplit(" ", 1)[0]
            with open(path, encoding="utf-8", newline="") as f:
                assert f.read()[start:end] == shown
            assert page.locator("#doc mark#span").is_visible()

            target = Path(os.environ.get("RAGSPEC_SCREENSHOT") or tmp_path / "serve.png")
            target.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(target))
            assert target.stat().st_size > 1000
        finally:
            browser.close()
