"""The steering playground in headless Chromium (Selenium): the page served by `kvwire serve` at /,
on a tiny random chat model with two control vectors. Compare mode's streams equal the API's
replies; a vector trained from the page joins the served model; bad input reads as messages."""
import inspect
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import kvwire as kw  # noqa: E402
from kvwire.serve import create_app  # noqa: E402

from .playground_browser import Proxy, chromium_driver, wait_for  # noqa: E402
from .serve_fixtures import Server, control_vectors, tiny_chat_lm  # noqa: E402

PROMPT = "Tell me about your day"
TOKENS = 12  # per reply: the machine may be busy, and every token is a decode step


@pytest.fixture(scope="module")
def lm():
    return tiny_chat_lm()


@pytest.fixture(scope="module")
def server(lm):
    s = Server(create_app(lm, "tiny", max_batch=4, max_length=256, control_vectors=control_vectors(lm)))
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


def open_page(browser, url, max_tokens=TOKENS):
    browser.get(url + "/")
    wait_for(lambda: browser.execute_script("return document.body.dataset.ready === '1'"), what="the page to load")
    type_into(browser, "max-tokens", str(max_tokens))


def by_id(browser, element_id):
    return browser.find_element("id", element_id)


def text_of(browser, selector):
    return browser.execute_script(f"return document.querySelector({json.dumps(selector)}).textContent")


def message(browser):
    return browser.execute_script("const m = document.getElementById('message'); return m.hidden ? '' : "
                                  "m.className + ': ' + m.textContent")


def type_into(browser, element_id, text):
    box = by_id(browser, element_id)
    box.clear()
    box.send_keys(text)


def api_reply(api, strengths, mode="chat", max_tokens=TOKENS):
    body = dict(model="tiny", temperature=0, max_tokens=max_tokens, steer=strengths)
    if mode == "chat":
        out = api.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": PROMPT}]})
        return out.json()["choices"][0]["message"]["content"]
    return api.post("/v1/completions", json={**body, "prompt": PROMPT}).json()["choices"][0]["text"]


def vector_names(browser):
    return browser.execute_script("return [...document.querySelectorAll('#vector-list li')].map(li => li.dataset.name)")


def test_vectors_listed_slider_steers_the_chat(browser, server, api):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server.url)
    assert vector_names(browser) == ["happy", "formal"]
    assert "tiny" in by_id(browser, "model-name").text
    slider = by_id(browser, "strength-happy")
    for _ in range(6):  # step 0.05 per key
        slider.send_keys(Keys.ARROW_RIGHT)
    assert by_id(browser, "strength-box-happy").get_attribute("value") == "0.3"
    type_into(browser, "prompt", PROMPT)
    by_id(browser, "send").click()
    wait_for(lambda: by_id(browser, "regenerate").is_enabled(), what="the reply to finish")
    reply = text_of(browser, "#chat-log .msg.assistant")
    assert reply == api_reply(api, {"happy": 0.3, "formal": 0.0})
    assert '"happy": 0.3' in text_of(browser, "#snippet-curl") and "extra_body" in text_of(browser, "#snippet-python")


@pytest.mark.parametrize("mode", ["chat", "raw"])
def test_compare_mode_streams_three_strengths_equal_to_the_api(browser, server, api, mode, tmp_path):
    open_page(browser, server.url)
    by_id(browser, f"mode-{mode}").click()
    by_id(browser, "compare").click()
    type_into(browser, "compare-strengths", "-1, 0, 1")
    type_into(browser, "prompt", PROMPT)
    before = server.app.state.served.bridge.engine.stats.copy()
    by_id(browser, "send").click()
    wait_for(lambda: by_id(browser, "regenerate").is_enabled(), what="three streams to finish")
    columns = browser.execute_script("return [...document.querySelectorAll('#compare-output .column')].map(c => "
                                     "[c.dataset.strength, c.querySelector('.text').textContent, "
                                     "c.querySelector('.status').textContent])")
    assert [c[0] for c in columns] == ["-1", "0", "1"]
    assert all(c[2].startswith("done") for c in columns), columns
    expected = [api_reply(api, {"happy": s, "formal": 0.0}, mode) for s in (-1.0, 0.0, 1.0)]
    assert [c[1] for c in columns] == expected
    assert len(set(expected)) > 1  # the strengths change the text (else the test proves little)
    assert sum(server.app.state.served.bridge.engine.stats.values()) > sum(before.values())
    browser.save_screenshot(str(tmp_path / f"compare-{mode}.png"))
    assert (tmp_path / f"compare-{mode}.png").stat().st_size > 10_000


def test_train_a_vector_from_the_page(browser, server, api, tmp_path):
    open_page(browser, server.url)
    by_id(browser, "tabs").find_element("css selector", "[data-tab=train]").click()
    positive = tmp_path / "positive.txt"
    positive.write_text("I am so happy today\nWhat a wonderful surprise\n\nEverything went great\n")
    by_id(browser, "train-positive-file").send_keys(str(positive))  # picked from a file
    wait_for(lambda: "wonderful" in by_id(browser, "train-positive").get_attribute("value"), what="the file")
    type_into(browser, "train-negative", "I am so sad today\nWhat a terrible surprise\nEverything went wrong")
    type_into(browser, "train-name", "joy")
    type_into(browser, "train-layers", "1-3")
    by_id(browser, "train-button").click()
    wait_for(lambda: "joy" in vector_names(browser), timeout=60, what="the new vector's slider")
    assert 'trained "joy"' in by_id(browser, "train-status").text and "ready" in message(browser)
    assert by_id(browser, "strength-joy").is_displayed()
    browser.save_screenshot(str(tmp_path / "trained.png"))
    # the served model steers with it, and its GGUF is the served vector
    served = server.app.state.served.vectors["joy"]
    assert served.layers == [1, 2, 3]
    link = browser.find_element("css selector", "#vector-list li[data-name=joy] a.download").get_attribute("href")
    path = tmp_path / "joy.gguf"
    path.write_bytes(api.get(link).content)
    assert kw.ControlVector.load(path) == served
    steered = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                "steer": {"joy": 2.0}})
    assert steered.status_code == 200
    # and the graph tab now outlines its three layers
    by_id(browser, "tabs").find_element("css selector", "[data-tab=graph]").click()
    wait_for(lambda: browser.find_elements("css selector", "#graph-view svg"), what="the graph")
    from selenium.webdriver.support.ui import Select
    Select(by_id(browser, "graph-vector")).select_by_value("joy")
    assert len(browser.find_elements("css selector", "#graph-view g.node.highlight")) == 3
    assert "joy: 3 layers" in by_id(browser, "graph-legend").text


def test_train_an_ablation_at_a_site_from_the_page(browser, server, api):
    from selenium.webdriver.support.ui import Select

    open_page(browser, server.url)
    by_id(browser, "tabs").find_element("css selector", "[data-tab=train]").click()
    type_into(browser, "train-positive", "I am so happy today\nWhat a wonderful surprise\nEverything went great")
    type_into(browser, "train-negative", "I am so sad today\nWhat a terrible surprise\nEverything went wrong")
    type_into(browser, "train-name", "nojoy")
    type_into(browser, "train-layers", "1-2")
    assert Select(by_id(browser, "train-site")).first_selected_option.text == "block_out"
    Select(by_id(browser, "train-site")).select_by_value("attn_out")
    Select(by_id(browser, "train-operation")).select_by_value("ablate")
    by_id(browser, "train-button").click()
    wait_for(lambda: "nojoy" in vector_names(browser), timeout=60, what="the new vector's slider")
    served = server.app.state.served.vectors["nojoy"]
    assert (served.operation, served.site, served.layers) == ("ablate", "attn_out", [1, 2])
    label = browser.find_element("css selector", "#vector-list li[data-name=nojoy] .layers").text
    assert "ablate at attn_out" in label
    ablated = api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                "steer": {"nojoy": 1.0}})
    assert ablated.status_code == 200


def test_graph_tab_highlights_a_vectors_layers(browser, server):
    from selenium.webdriver.support.ui import Select

    open_page(browser, server.url)
    by_id(browser, "tabs").find_element("css selector", "[data-tab=graph]").click()
    wait_for(lambda: browser.find_elements("css selector", "#graph-view svg"), what="the graph")
    Select(by_id(browser, "graph-vector")).select_by_value("happy")
    titles = [e.get_attribute("textContent") for e in
              browser.find_elements("css selector", "#graph-view g.node.highlight title")]
    assert titles == ["layers_1__steer", "layers_2__steer"]
    # kw.plot fills inserted layers orange
    assert browser.find_elements("css selector", "#graph-view g.node path[fill='#ffb347']")


def test_sweep_tab_draws_the_sweep(browser, server, lm):
    open_page(browser, server.url)
    by_id(browser, "tabs").find_element("css selector", "[data-tab=sweep]").click()
    type_into(browser, "sweep-strengths", "-2, 0, 2")
    type_into(browser, "sweep-prompt", "Once upon")
    by_id(browser, "sweep-button").click()
    wait_for(lambda: len(browser.find_elements("css selector", "#sweep-chart circle.point")) == 3, what="the chart")
    rows = browser.execute_script("return [...document.querySelectorAll('#sweep-table tr')].slice(1)"
                                  ".map(r => [...r.cells].map(c => c.textContent))")
    expected = kw.steer.sweep(lm, server.app.state.served.vectors["happy"], [-2, 0, 2], prompt="Once upon")
    assert [r[0] for r in rows] == ["-2.00", "0.00", "2.00"]
    assert [r[1] for r in rows] == [f"{v:.3f}" for v in expected.values]
    assert [r[2] for r in rows] == ["Once upon" + t for t in expected.samples]


def test_bad_input_reads_as_messages(browser, server):
    open_page(browser, server.url)
    type_into(browser, "strength-box-happy", "abc")
    type_into(browser, "prompt", PROMPT)
    by_id(browser, "send").click()
    assert message(browser) == 'message error: the strength of "happy" must be a number like 0.5 or -1, got "abc"'
    assert "invalid" in by_id(browser, "strength-box-happy").get_attribute("class")
    by_id(browser, "compare").click()
    type_into(browser, "strength-box-happy", "0")
    type_into(browser, "compare-strengths", "-1, lots, 1")
    by_id(browser, "send").click()
    assert 'each of the compare strengths must be a number like 0.5 or -1, got "lots"' in message(browser)
    type_into(browser, "max-tokens", "ten")
    by_id(browser, "send").click()
    assert 'max tokens must be a number (a whole one), got "ten"' in message(browser)

    by_id(browser, "tabs").find_element("css selector", "[data-tab=train]").click()
    by_id(browser, "train-button").click()
    assert "The positive examples are empty" in message(browser)
    type_into(browser, "train-positive", "one\ntwo\nthree")
    type_into(browser, "train-negative", "uno\ndos")
    by_id(browser, "train-button").click()
    assert "The lists must pair up: 3 positive and 2 negative prompts" in message(browser)
    type_into(browser, "train-negative", "uno\ndos\ntres")
    type_into(browser, "train-name", "happy")  # the server refuses: taken
    by_id(browser, "train-button").click()
    wait_for(lambda: "already loaded" in message(browser), what="the server's refusal")
    assert "a control vector named 'happy' is already loaded; pick another name (HTTP 409)" in message(browser)
    type_into(browser, "train-name", "fresh")
    type_into(browser, "train-layers", "2-40")
    by_id(browser, "train-button").click()
    wait_for(lambda: "not blocks of this model" in message(browser), what="the server's refusal")
    assert "it has blocks 0-3" in message(browser)


def test_server_gone_mid_stream_then_back(browser, server, api):
    proxy = Proxy(int(server.url.rsplit(":", 1)[1]), delay=0.03)  # ~30 tokens a second reach the page
    try:
        open_page(browser, proxy.url, max_tokens=200)
        by_id(browser, "mode-raw").click()
        type_into(browser, "prompt", PROMPT)
        by_id(browser, "send").click()
        wait_for(lambda: len(text_of(browser, "#raw-output .completion")) >= 5, what="the stream to start")
        proxy.stop()
        wait_for(lambda: "went away mid-stream" in message(browser), what="the page to notice")
        assert "Lost the connection" not in message(browser)  # the stream's own message wins the banner
        assert by_id(browser, "connection").text == "server unreachable"
        assert by_id(browser, "send").is_enabled() and by_id(browser, "regenerate").is_enabled()
        proxy.delay = 0.0  # the rerun at full speed, and shorter
        type_into(browser, "max-tokens", str(TOKENS))
        proxy.start()
        wait_for(lambda: "The server is back" in message(browser), what="the page to see the server again")
        assert by_id(browser, "connection").text == "connected"
        by_id(browser, "regenerate").click()
        wait_for(lambda: "done in" in by_id(browser, "play-status").text, timeout=60, what="the rerun")
        assert text_of(browser, "#raw-output .completion") == api_reply(api, {"happy": 0.0, "formal": 0.0}, "raw")
    finally:
        proxy.stop()


RECORD = """window.sent = [];
const send = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) window.sent.push({url: String(url), body: JSON.parse(options.body)});
  return send(url, options);
};"""


def record_requests(browser):
    """From now on, window.sent lists the page's request bodies: [{url, body}]."""
    browser.execute_script(RECORD)


def sent(browser):
    return browser.execute_script("return window.sent")


def finish_send(browser):
    by_id(browser, "send").click()
    wait_for(lambda: by_id(browser, "regenerate").is_enabled(), timeout=60, what="the reply to finish")


def test_open_code_and_compare_columns_fit_the_window(browser, server):
    browser.set_window_size(1280, 1000)
    try:
        open_page(browser, server.url)
        by_id(browser, "compare").click()
        type_into(browser, "prompt", " ".join([PROMPT] * 8))  # long lines in the code
        finish_send(browser)
        browser.find_element("css selector", "#snippets summary").click()
        assert by_id(browser, "snippet-curl").is_displayed()
        width = browser.execute_script("return window.innerWidth")
        assert width <= 1280
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width
        rights = browser.execute_script("return [...document.querySelectorAll("
                                        "'#compare-output .column, #snippets pre')]"
                                        ".map(e => e.getBoundingClientRect().right)")
        assert len(rights) == 5 and max(rights) <= width, rights
        # the code scrolls inside its own box
        assert browser.execute_script("const p = document.getElementById('snippet-curl'); "
                                      "return p.scrollWidth > p.clientWidth")
    finally:
        browser.set_window_size(1400, 1000)


def test_compare_panel_hides_when_compare_is_off(browser, server):
    open_page(browser, server.url)
    panel = by_id(browser, "compare-output")
    display = "return getComputedStyle(document.getElementById('compare-output')).display"
    assert not panel.is_displayed() and browser.execute_script(display) == "none"
    by_id(browser, "compare").click()
    assert browser.execute_script(display) == "grid"
    by_id(browser, "compare").click()
    assert browser.execute_script(display) == "none"
    assert browser.execute_script("return document.getElementById('chat-log').hidden") is False


def test_vectors_the_server_forgot_leave_the_page(browser, server, lm, api):
    """A restarted server (here: another app behind the same address) no longer has a vector the
    page lists: the refused send re-reads the list, drops the name and says so; the next send works."""
    vectors = control_vectors(lm)
    before = Server(create_app(lm, "tiny", max_batch=2, max_length=256,
                               control_vectors={**vectors, "calm": vectors["happy"]}))
    proxy = Proxy(int(before.url.rsplit(":", 1)[1]))
    try:
        open_page(browser, proxy.url)
        assert vector_names(browser) == ["happy", "formal", "calm"]
        type_into(browser, "strength-box-happy", "0.5")
        proxy.stop()  # the restart: same address, a server without "calm"
        before.close()
        proxy.target = int(server.url.rsplit(":", 1)[1])
        proxy.start()
        type_into(browser, "prompt", PROMPT)
        by_id(browser, "send").click()
        wait_for(lambda: "calm" in message(browser), what="the refusal")
        names = list(server.app.state.served.names)  # happy, formal (and one trained by an earlier test)
        assert vector_names(browser) == names
        assert message(browser).startswith("message error: The server no longer has the control vector \"calm\"")
        assert by_id(browser, "strength-box-happy").get_attribute("value") == "0.5"
        assert by_id(browser, "prompt").get_attribute("value") == PROMPT  # ready to send again
        assert browser.find_elements("css selector", "#chat-log .msg") == []
        record_requests(browser)
        finish_send(browser)
        assert message(browser) == ""
        assert [r["body"]["steer"] for r in sent(browser)] == [{**dict.fromkeys(names, 0.0), "happy": 0.5}]
        assert text_of(browser, "#chat-log .msg.assistant") == api_reply(api, {"happy": 0.5, "formal": 0.0})
    finally:
        proxy.stop()
        before.close()


def test_train_tab_defaults_to_the_librarys_method(browser, server):
    default = inspect.signature(kw.ControlVector.train).parameters["method"].default
    open_page(browser, server.url)
    by_id(browser, "tabs").find_element("css selector", "[data-tab=train]").click()
    assert by_id(browser, "train-method").get_attribute("value") == default


def test_compare_sends_only_the_prompt_not_the_hidden_chat(browser, server):
    open_page(browser, server.url)
    type_into(browser, "prompt", PROMPT)
    finish_send(browser)
    reply = text_of(browser, "#chat-log .msg.assistant")
    record_requests(browser)
    by_id(browser, "compare").click()
    type_into(browser, "compare-strengths", "-1, 1")
    type_into(browser, "prompt", "And then?")
    finish_send(browser)
    assert [r["body"]["messages"] for r in sent(browser)] == [[{"role": "user", "content": "And then?"}]] * 2
    # the chat goes on from its own history
    by_id(browser, "compare").click()
    browser.execute_script("window.sent = []")
    type_into(browser, "prompt", "Why?")
    finish_send(browser)
    assert [r["body"]["messages"] for r in sent(browser)] == [[
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": reply},
        {"role": "user", "content": "Why?"}]]


def test_stop_reports_stopped(browser, server):
    proxy = Proxy(int(server.url.rsplit(":", 1)[1]), delay=0.03)  # a slow stream, so Stop comes first
    try:
        open_page(browser, proxy.url, max_tokens=200)
        by_id(browser, "mode-raw").click()
        type_into(browser, "prompt", PROMPT)
        by_id(browser, "send").click()
        wait_for(lambda: len(text_of(browser, "#raw-output .completion")) >= 3, what="the stream to start")
        by_id(browser, "stop").click()
        wait_for(lambda: by_id(browser, "send").is_enabled(), what="the stop")
        status = by_id(browser, "play-status").text
        assert status.startswith("stopped") and "done" not in status, status
        assert message(browser) == ""
        assert by_id(browser, "connection").text == "connected"
    finally:
        proxy.stop()


def test_top_p_zero_is_refused_on_the_page(browser, server):
    open_page(browser, server.url)
    record_requests(browser)
    type_into(browser, "top-p", "0")
    type_into(browser, "prompt", PROMPT)
    by_id(browser, "send").click()
    assert message(browser) == "message error: top_p must lie in (0, 1], got 0"
    assert "invalid" in by_id(browser, "top-p").get_attribute("class")
    assert sent(browser) == [] and browser.find_elements("css selector", "#chat-log .msg") == []
    assert by_id(browser, "prompt").get_attribute("value") == PROMPT
    type_into(browser, "top-p", "1")
    finish_send(browser)
    assert "invalid" not in by_id(browser, "top-p").get_attribute("class")
    assert len(sent(browser)) == 1


def test_api_docs_page_renders_offline(browser, server):
    browser.get(server.url + "/docs")
    paths = wait_for(lambda: browser.execute_script(
        "return [...document.querySelectorAll('.swagger-ui .opblock-summary-path')].map(e => e.textContent)"),
        what="Swagger UI's operations")
    assert "/v1/chat/completions" in paths and "/v1/completions" in paths
    requested = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert requested and all(url.startswith(server.url) for url in requested), requested
