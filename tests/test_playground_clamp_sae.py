"""The playground's per-request clamps and SAE features in headless Chromium (Selenium): a vector
made to clamp gets lo/hi boxes whose bounds the reply obeys (== `lm.clamp`), and a server started
with an SAE gets a features control whose reply == `steer_features`; bad input reads as messages."""
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402
from kvwire.steer.sae import SAE, steer_features  # noqa: E402

from .playground_browser import chromium_driver, wait_for  # noqa: E402
from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402
from .test_sae import random_sae, write_sae  # noqa: E402

PROMPT = "Tell me about your day"
TOKENS = 12
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def calm(lm):
    return kw.ControlVector(control_vectors(lm)["formal"].directions, operation="clamp")


@pytest.fixture(scope="module")
def sae(tmp_path_factory):
    return SAE.load(write_sae(tmp_path_factory.mktemp("sae") / "blocks.1", random_sae(jumprelu=True)))


@pytest.fixture(scope="module")
def server(lm, calm, sae):
    vectors = {"happy": control_vectors(lm)["happy"], "calm": calm}
    s = Server(create_app(lm, "tiny", max_batch=4, max_length=256, control_vectors=vectors, sae=sae, sae_slots=4,
                          sae_per_request=2))
    yield s
    s.close()


@pytest.fixture(scope="module")
def api(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def browser():
    driver = chromium_driver()
    yield driver
    driver.quit()


def by_id(browser, element_id):
    return browser.find_element("id", element_id)


def type_into(element, text):
    element.clear()
    element.send_keys(text)


def js(browser, script):
    return browser.execute_script(script)


def open_page(browser, url):
    browser.get(url + "/")
    wait_for(lambda: js(browser, "return document.body.dataset.ready === '1'"), what="the page to load")
    type_into(by_id(browser, "max-tokens"), str(TOKENS))


def send(browser, prompt=PROMPT):
    """A new chat (no earlier turns) with `prompt`."""
    by_id(browser, "clear").click()
    type_into(by_id(browser, "prompt"), prompt)
    by_id(browser, "send").click()


def reply(browser):
    wait_for(lambda: by_id(browser, "regenerate").is_enabled(), what="the reply to finish")
    return js(browser, "return [...document.querySelectorAll('#chat-log .msg.assistant')].pop().textContent")


def message(browser):
    return js(browser, "const m = document.getElementById('message'); return m.hidden ? '' : m.textContent")


def api_reply(api, **fields):
    body = dict(model="tiny", temperature=0, max_tokens=TOKENS, messages=CHAT, **fields)
    r = api.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_clamp_vector_takes_lo_and_hi(browser, server, api, lm, calm, tmp_path):
    open_page(browser, server.url)
    controls = js(browser, "return [...document.querySelectorAll('#vector-list li[data-name=calm] input')]"
                           ".map(i => i.id + ':' + i.type)")
    assert controls == ["lo-box-calm:text", "hi-box-calm:text"]  # bounds, no strength slider
    assert "clamp at block_out" in js(browser, "return document.querySelector('#vector-list li[data-name=calm]')"
                                               ".textContent")
    assert js(browser, "return [...document.getElementById('compare-vector').options].map(o => o.value)") == ["happy"]
    type_into(by_id(browser, "lo-box-calm"), "1")
    type_into(by_id(browser, "hi-box-calm"), "1")
    send(browser)
    text = reply(browser)
    assert text == api_reply(api, steer={"calm": {"lo": 1.0, "hi": 1.0}})
    assert text == lm.clamp(calm, 1.0, 1.0).chat(CHAT, max_new_tokens=TOKENS)
    assert text != lm.chat(CHAT, max_new_tokens=TOKENS)  # the bounds bite
    curl = js(browser, "return document.getElementById('snippet-curl').textContent")
    assert '"calm": {' in curl and '"lo": 1' in curl and '"hi": 1' in curl
    # hi alone: the other side unbounded
    type_into(by_id(browser, "lo-box-calm"), "")
    type_into(by_id(browser, "hi-box-calm"), "-3")
    send(browser)
    assert reply(browser) == api_reply(api, steer={"calm": {"hi": -3.0}})
    browser.save_screenshot(str(tmp_path / "clamp.png"))
    # inverted bounds: said on the page, nothing sent, the prompt kept
    type_into(by_id(browser, "lo-box-calm"), "2")
    type_into(by_id(browser, "hi-box-calm"), "1")
    send(browser, "another prompt")
    wait_for(lambda: 'the bounds of "calm" are inverted: lo 2 > hi 1' in message(browser), what="the refusal")
    assert "invalid" in by_id(browser, "lo-box-calm").get_attribute("class")
    assert by_id(browser, "prompt").get_attribute("value") == "another prompt"


def test_sae_features_set_add_and_clamp(browser, server, api, lm, sae, tmp_path):
    open_page(browser, server.url)
    assert by_id(browser, "sae-section").is_displayed()
    assert js(browser, "return [...document.getElementById('sae-mode').options].map(o => o.value)") == \
        ["set", "add", "clamp"]
    assert "96 features at block_out of block 1" in by_id(browser, "sae-hint").text

    def row(k):
        return browser.find_elements("css selector", "#sae-list li")[k]

    type_into(row(0).find_element("class name", "sae-index"), "5")
    type_into(row(0).find_element("class name", "sae-value"), "6")
    assert not row(0).find_element("class name", "sae-hi").is_displayed()
    send(browser)
    text = reply(browser)
    assert text == api_reply(api, sae_features={"5": 6.0}, sae_mode="set")
    assert text == steer_features(lm, sae, {5: 6.0}).chat(CHAT, max_new_tokens=TOKENS)
    assert text != lm.chat(CHAT, max_new_tokens=TOKENS)  # the feature bites
    assert '"sae_features": {"5": 6}' in js(browser, "return document.getElementById('snippet-python').textContent")

    # clamp two features: a second row, lo and hi boxes (blank: unbounded)
    from selenium.webdriver.support.ui import Select

    Select(by_id(browser, "sae-mode")).select_by_value("clamp")
    by_id(browser, "sae-add").click()
    assert not by_id(browser, "sae-add").is_enabled()  # at most 2 per request on this server
    assert row(0).find_element("class name", "sae-hi").is_displayed()
    type_into(row(0).find_element("class name", "sae-value"), "")
    type_into(row(0).find_element("class name", "sae-hi"), "0.1")
    type_into(row(1).find_element("class name", "sae-index"), "9")
    type_into(row(1).find_element("class name", "sae-value"), "2")
    type_into(row(1).find_element("class name", "sae-hi"), "3")
    send(browser)
    features = {5: (None, 0.1), 9: (2.0, 3.0)}
    text = reply(browser)
    assert text == api_reply(api, sae_features={"5": [None, 0.1], "9": [2.0, 3.0]}, sae_mode="clamp")
    assert text == steer_features(lm, sae, features, mode="clamp").chat(CHAT, max_new_tokens=TOKENS)
    browser.save_screenshot(str(tmp_path / "sae.png"))

    # an index past the SAE: said on the page, nothing sent
    type_into(row(1).find_element("class name", "sae-index"), "96")
    send(browser, "another prompt")
    wait_for(lambda: "an SAE feature index must lie in [0, 95], got 96" in message(browser), what="the refusal")
    assert "invalid" in row(1).find_element("class name", "sae-index").get_attribute("class")
    row(1).find_element("class name", "sae-remove").click()
    assert len(browser.find_elements("css selector", "#sae-list li")) == 1 and by_id(browser, "sae-add").is_enabled()
    assert server.app.state.sae.held == [None] * 4  # every slot given back


def test_no_sae_section_without_an_sae(browser, lm):
    s = Server(create_app(lm, "tiny", max_batch=1, max_length=128))
    try:
        open_page(browser, s.url)
        assert not by_id(browser, "sae-section").is_displayed()
        send(browser)
        assert "sae_features" not in js(browser, "return document.getElementById('snippet-curl').textContent")
        reply(browser)
    finally:
        s.close()
