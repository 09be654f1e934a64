"""Helpers for the playground's browser tests: headless Debian Chromium driven by Selenium, and a
TCP proxy that can slow a stream down and vanish mid-stream (then come back on the same port)."""
import shutil
import socket
import tempfile
import threading
import time

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# what a closed network needs: no background connections (refused many at a time otherwise)
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]


def chromium_driver():
    """A Selenium Chrome driver on Debian's chromium + chromium-driver (skips when they are absent)."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found: install Debian's chromium and chromium-driver "
                    f"(apt-get install -y chromium chromium-driver; .ci/run does)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="kvwire-chromium-")
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.profile_dir = profile
    return driver


def wait_for(condition, timeout=30, poll=0.05, what="condition"):
    """Poll `condition()` until it returns something truthy; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


class Proxy:
    """Forwards 127.0.0.1:port to `target_port`, delaying each upstream chunk by `delay` seconds
    (a slow stream); `stop()` drops every connection and the listener, `start()` listens again."""

    def __init__(self, target_port, delay=0.0):
        self.target, self.delay = target_port, delay
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sockets, self.lock, self.listener = set(), threading.Lock(), None
        self.start()

    def start(self):
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(32)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self):
        with self.lock:
            doomed, self.sockets = list(self.sockets) + [self.listener], set()
        for s in doomed:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.delay), daemon=True).start()

    def _pump(self, source, sink, delay):
        try:
            while data := source.recv(65536):
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
