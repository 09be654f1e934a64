"""Draw the README's pictures of steering: a sweep plot of the shipped happy vector on the default
model (docs/sweep.png) and a screenshot of the playground in compare mode (docs/playground.png),
taken in headless Chromium (Debian's chromium + chromium-driver) driven by Selenium.

    python examples/playground_docs.py [--out docs]
"""
import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch

import kvwire as kw
from kvwire.serve import create_app

HERE = Path(__file__).parent
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,980"]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in FLAGS + [f"--user-data-dir={tempfile.mkdtemp()}"]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)


def serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait(condition, timeout=600):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not finish in time")
        time.sleep(0.1)


def screenshot(lm, vec, path, prompt="I think that today is", tokens=40):
    server, url = serve(create_app(lm, "gemma3-270m", max_batch=4, max_length=512, control_vectors={"happy": vec}))
    driver = browser()
    try:
        driver.get(url + "/")
        wait(lambda: driver.execute_script("return document.body.dataset.ready === '1'"))
        find = lambda i: driver.find_element("id", i)  # noqa: E731
        find("mode-raw").click()
        find("compare").click()
        find("max-tokens").clear()
        find("max-tokens").send_keys(str(tokens))
        find("prompt").send_keys(prompt)
        find("send").click()
        wait(lambda: find("regenerate").is_enabled())
        find("snippets").click()  # open the "as code" panel
        driver.save_screenshot(str(path))
    finally:
        driver.quit()
        server.should_exit = True


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(HERE.parent / "docs"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    torch.set_grad_enabled(False)
    lm = kw.load("gemma3-270m")
    vec = kw.ControlVector.load(HERE / "data" / "happy.gguf")
    start = time.perf_counter()
    result = kw.steer.sweep(lm, vec, [-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0], max_new_tokens=24)
    print(result)
    result.plot(out / "sweep.png", title="examples/data/happy.gguf on gemma3-270m (blocks 3-12)")
    print(f"sweep: {time.perf_counter() - start:.1f} s, wrote {out / 'sweep.png'}")
    screenshot(lm, vec, out / "playground.png")
    print(f"wrote {out / 'playground.png'}")


if __name__ == "__main__":
    main()
