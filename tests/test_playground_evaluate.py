"""The playground's Evaluate tab in headless Chromium (Selenium): for the chosen vector it draws the
behaviour curve and the side effects as SVG paths with one point per strength, and its table holds
the numbers POST /kvwire/evaluate answers (== `kw.steer.evaluate`); a server without analysis and bad
input read as messages."""
import json
import re

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402

from .playground_browser import chromium_driver, wait_for  # noqa: E402
from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

EXAMPLES = [{"prompt": "I feel", "positive": " good", "negative": " bad"},
            {"prompt": "The day was", "positive": " fine", "negative": " awful"}]
NEUTRAL = "The river runs past the mill and on to the sea. Boats go by."
COLUMNS = ["strengths", "logit_diff", "kl", "perplexity", "ppl_increase"]
CHARTS = {"eval-curve": "logit_diff", "eval-kl": "kl", "eval-ppl": "ppl_increase"}


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def vectors(lm):
    clamped = kw.ControlVector(control_vectors(lm)["formal"].directions, operation="clamp")
    return {**control_vectors(lm), "calm": clamped}


@pytest.fixture(scope="module")
def server(lm, vectors):
    s = Server(create_app(lm, "tiny", max_batch=2, max_length=256, control_vectors=vectors))
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser():
    driver = chromium_driver()
    yield driver
    driver.quit()


def js(browser, script):
    return browser.execute_script(script)


def by_id(browser, element_id):
    return browser.find_element("id", element_id)


def type_into(browser, element_id, text):
    box = by_id(browser, element_id)
    box.clear()
    box.send_keys(text)


def open_tab(browser, url):
    browser.get(url + "/")
    wait_for(lambda: js(browser, "return document.body.dataset.ready === '1'"), what="the page to load")
    by_id(browser, "tabs").find_element("css selector", "[data-tab=evaluate]").click()


def choose(browser, select_id, value):
    js(browser, f"const s = document.getElementById({json.dumps(select_id)}); s.value = {json.dumps(value)}; "
                "s.dispatchEvent(new Event('change'))")


def message(browser):
    return js(browser, "const m = document.getElementById('message'); return m.hidden ? '' : m.textContent")


def evaluate_on_page(browser, strengths):
    type_into(browser, "eval-strengths", strengths)
    js(browser, "document.getElementById('eval-table').replaceChildren()")
    by_id(browser, "eval-button").click()
    wait_for(lambda: js(browser, "return document.querySelectorAll('#eval-table tr').length") > 1 or message(browser),
             timeout=120, what="the evaluation")
    assert message(browser) == ""


def path_points(browser, chart):
    d = js(browser, f"return document.querySelector('#{chart} path.series').getAttribute('d')")
    return re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d)


def table(browser):
    """Per row, per column: (the text shown, the exact value in data-value)."""
    return js(browser, "return [...document.querySelectorAll('#eval-table tr')].slice(1).map(r => [...r.cells]"
                       ".map(c => [c.textContent, c.dataset.value]))")


def check_page_against(browser, answer, strengths):
    for chart, key in CHARTS.items():
        points = path_points(browser, chart)
        assert len(points) == len(strengths) == len(answer[key]), (chart, points)
        xs = [float(x) for x, _ in points]
        assert xs == sorted(xs) and len(set(xs)) == len(xs)  # one point per strength, left to right
    rows = table(browser)
    assert len(rows) == len(strengths)
    for i, row in enumerate(rows):
        for (text, exact), key in zip(row, COLUMNS):
            value = answer[key][i]
            assert float(exact) == value, (key, i)
            assert float(text) == pytest.approx(value, rel=1e-3, abs=1e-9), (key, i, text)  # 4 significant digits
    summary = by_id(browser, "eval-summary").text
    assert f"({len(answer['per_example'])} examples)" in summary and answer["dataset"] in summary


def test_the_tab_draws_the_served_vectors_evaluation(browser, server, lm, vectors):
    open_tab(browser, server.url)
    assert js(browser, "return [...document.getElementById('eval-vector').options].map(o => o.value)") == \
        ["happy", "formal", "calm"]  # a clamp's strength is the value it holds: it is offered too
    assert js(browser, "return document.getElementById('eval-dataset').value") == "sentiment-ab"
    by_id(browser, "eval-neutral").find_element("xpath", "..").click()  # open the <details>
    type_into(browser, "eval-neutral", NEUTRAL)
    evaluate_on_page(browser, "-2, 0, 1, 3")
    body = {"vector": "happy", "strengths": [-2, 0, 1, 3], "dataset": "sentiment-ab", "neutral": NEUTRAL}
    with httpx.Client(base_url=server.url, timeout=300) as client:
        answer = client.post("/kvwire/evaluate", json=body).json()
    expected = kw.steer.evaluate(lm, vectors["happy"], "sentiment-ab", [-2, 0, 1, 3], neutral=NEUTRAL)
    assert answer["logit_diff"] == pytest.approx(expected.logit_diff, rel=1e-5, abs=1e-6)
    check_page_against(browser, answer, [-2, 0, 1, 3])


def test_the_tab_takes_examples_and_a_clamp(browser, server):
    open_tab(browser, server.url)
    choose(browser, "eval-vector", "calm")
    choose(browser, "eval-dataset", "custom")
    assert by_id(browser, "eval-examples").is_displayed()
    type_into(browser, "eval-examples", "\n".join(json.dumps(e) for e in EXAMPLES))
    evaluate_on_page(browser, "-1, 1")
    body = {"vector": "calm", "strengths": [-1, 1], "examples": EXAMPLES}
    with httpx.Client(base_url=server.url, timeout=300) as client:
        answer = client.post("/kvwire/evaluate", json=body).json()
    assert answer["dataset"] == "examples" and answer["operation"].startswith("clamp (value)")
    check_page_against(browser, answer, [-1, 1])
    by_id(browser, "eval-generated-only").click()  # the answers alone: the endpoint's generated_only
    evaluate_on_page(browser, "-1, 1")
    with httpx.Client(base_url=server.url, timeout=300) as client:
        answer = client.post("/kvwire/evaluate", json={**body, "generated_only": True}).json()
    assert answer["operation"].endswith("generated positions")
    check_page_against(browser, answer, [-1, 1])
    assert by_id(browser, "eval-summary").text.split(" on ")[0] == answer["operation"]


def test_bad_input_reads_as_messages(browser, server):
    open_tab(browser, server.url)
    type_into(browser, "eval-strengths", "1")
    by_id(browser, "eval-button").click()
    assert message(browser) == "give at least two strengths (a slope needs two)"
    choose(browser, "eval-dataset", "custom")
    type_into(browser, "eval-examples", '{"prompt": "I feel"')
    type_into(browser, "eval-strengths", "0, 1")
    by_id(browser, "eval-button").click()
    assert message(browser).startswith("examples line 1 is not JSON")
    type_into(browser, "eval-examples", '{"prompt": "I", "positive": " a", "negative": " a"}')
    by_id(browser, "eval-button").click()
    wait_for(lambda: "The evaluation failed" in message(browser), what="the server's refusal")
    assert "examples line 1: the two answers are the same (' a'); they must differ (HTTP 400)" in message(browser)


def test_a_server_without_analysis_says_so(browser, lm):
    server = Server(create_app(lm, "tiny", max_batch=2, max_length=64, control_vectors=control_vectors(lm),
                               analysis=False))
    try:
        open_tab(browser, server.url)
        type_into(browser, "eval-strengths", "0, 1")
        by_id(browser, "eval-button").click()
        wait_for(lambda: message(browser), what="the refusal")
        assert "(started with --no-analysis) (HTTP 403)" in message(browser)
        assert js(browser, "return document.querySelectorAll('#eval-table tr').length") == 0
    finally:
        server.close()
