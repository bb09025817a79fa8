"""The docs site builds with ``mkdocs build --strict`` and reads right in a real browser.

The build needs the ``docs`` extra (``pip install -e '.[docs]'``); without it these tests
are skipped, saying so, unless ``MMSTORE_DOCS_REQUIRED=1`` (as ``.ci/run`` sets), where a
missing tool is a failure. The browser check serves the built site on 127.0.0.1, loads the
front page and one guide in headless Chromium driven over the DevTools protocol (through a
pipe, no extra package), asserts that nothing was logged as an error (console, uncaught
exceptions, failed requests), that the navigation and the search box are there and that
the search finds a page, and writes a screenshot of each page to
``build/docs-screenshots/``.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import select
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHOTS = os.path.join(ROOT, "build", "docs-screenshots")
REQUIRED = os.environ.get("MMSTORE_DOCS_REQUIRED") == "1"
PAGES = {"front": "", "guide": "guides/imagefolder/"}


def _missing(what: str) -> None:
    if REQUIRED:
        pytest.fail(f"{what} (MMSTORE_DOCS_REQUIRED=1)")
    pytest.skip(what)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    for mod in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            _missing(f"{mod} is not installed: pip install -e '.[docs]' to build the docs")
    out = str(tmp_path_factory.mktemp("site") / "site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", out], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return out


def _read(site: str, page: str) -> str:
    with open(os.path.join(site, page, "index.html"), encoding="utf-8") as fh:
        return fh.read()


def test_the_generated_pages_hold_what_the_code_says(site):
    from mmstore import cli

    # the CLI reference: every command the parser has, with its own help
    text = _read(site, "reference/cli")
    for name in cli.COMMANDS:
        assert f'id="mmstore-{name}"' in text, name
    assert "--classes-from" in text and "--resize" in text
    # the store on disk: the format module's docstring, its sections as headings
    import mmstore.format

    spec = _read(site, "concepts/format")
    titles = re.findall(r"^(\S[^\n]*)\n[=-]{3,}$", mmstore.format.__doc__ or "", re.MULTILINE)
    assert len(titles) > 8
    for title in titles:
        assert title.replace('"', "&quot;") in spec or title in spec, title
    # resize, crop and decode: the decode module's docstring, its sections as headings
    import mmstore.decode

    rules = _read(site, "concepts/decoding")
    decode_titles = re.findall(r"^(\S[^\n]*)\n-{3,}$", mmstore.decode.__doc__ or "", re.MULTILINE)
    assert len(decode_titles) >= 8
    for title in decode_titles:
        shown = re.sub(r"``(.+?)``", r"<code>\1</code>", title)
        assert shown.replace('"', "&quot;") in rules or shown in rules, title
    assert "INTER_AREA" in rules and "RUN_DEFAULTS" not in _read(site, "reference/mmstore")
    # the API reference rendered from the docstrings
    assert "OrderSpec" in _read(site, "reference/order") and "load_state_dict" in _read(site, "reference/torch")
    # the benchmark plots were drawn, and each run names its command, machine and date
    bench = _read(site, "benchmarks/reads")
    assert bench.count(">command<") >= 3 and bench.count(">machine<") >= 3 and bench.count(">date<") >= 3
    plots = os.listdir(os.path.join(site, "benchmarks", "plots"))
    assert "loader-vs-jpeg.svg" in plots and all(p.endswith(".svg") for p in plots)
    assert os.path.getsize(os.path.join(site, "concepts", "orders.svg")) > 10_000
    # the site's search index covers the guides
    with open(os.path.join(site, "search", "search_index.json"), encoding="utf-8") as fh:
        locations = {d["location"].split("#")[0] for d in json.load(fh)["docs"]}
    assert "guides/resume/" in locations and "guides/coco/" in locations


# ---------------------------------------------------------------------------
# the browser


class DevTools:
    """Chromium's DevTools protocol over ``--remote-debugging-pipe``: JSON messages ended by NUL."""

    def __init__(self, chromium: str, profile: str) -> None:
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        args = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--window-size=1280,900", f"--user-data-dir={profile}",
                "about:blank"]
        script = 'exec "$@" 3<&' + str(cmd_r) + " 4>&" + str(resp_w)
        self.proc = subprocess.Popen(["bash", "-c", script, "chromium", *args], pass_fds=(cmd_r, resp_w),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(resp_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._resp_r], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._resp_r, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30):
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            m = self._message(deadline)
            if m.get("id") == self._id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_event(self, method: str, session: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        for i, m in enumerate(self.events):
            if m.get("method") == method and m.get("sessionId") == session:
                return self.events.pop(i)
        while True:
            m = self._message(deadline)
            if m.get("method") == method and m.get("sessionId") == session:
                return m
            self.events.append(m)

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._message(deadline))
        except TimeoutError:
            pass

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError, EOFError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._resp_r)


def _errors(events: list[dict], session: str) -> list[str]:
    found = []
    for m in events:
        if m.get("sessionId") != session:
            continue
        p = m.get("params", {})
        if m.get("method") == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            found.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m.get("method") == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            found.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif m.get("method") == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            found.append(f"log ({e.get('source')}): {e.get('text')} {e.get('url', '')}")
    return found


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on 127.0.0.1 (a free port), stopped by its pid afterwards."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                             "--directory", site], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        m = re.search(r"port (\d+)", line)
        assert m, f"http.server did not say where it listens: {line!r}"
        yield f"http://127.0.0.1:{m.group(1)}/"
    finally:
        os.kill(proc.pid, 15)
        proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


@pytest.fixture(scope="module")
def browser(served, tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        _missing("no chromium on PATH: apt-get install chromium to check the site in a browser")
    tools = DevTools(chromium, str(tmp_path_factory.mktemp("chromium-profile")))
    try:
        yield tools
    finally:
        tools.close()


@pytest.mark.parametrize("name", sorted(PAGES))
def test_page_renders_in_a_browser(name, served, browser):
    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        browser.send(f"{domain}.enable", session=session)
    browser.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 900, "deviceScaleFactor": 1,
                                                        "mobile": False}, session=session)
    browser.send("Page.navigate", {"url": served + PAGES[name]}, session=session)
    browser.wait_event("Page.loadEventFired", session)
    browser.drain(1.0)  # scripts run after the load event (the search worker, the theme)

    def js(expr: str):
        r = browser.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True},
                         session=session)
        assert "exceptionDetails" not in r, r
        return r["result"].get("value")

    title = js("document.title")
    assert "mmstore" in title
    assert js("document.querySelectorAll('nav.md-nav--primary a.md-nav__link').length") > 20
    assert js("!!document.querySelector('input.md-search__input')")
    # the search finds a guide: type a query as a reader would, wait for the results
    hits = js("""new Promise(done => {
        const box = document.querySelector('input.md-search__input');
        box.focus(); box.value = 'block shuffle';
        box.dispatchEvent(new Event('input', {bubbles: true}));
        box.dispatchEvent(new KeyboardEvent('keyup', {bubbles: true, key: 'e'}));
        let tries = 0;
        const look = () => {
            const n = document.querySelectorAll('.md-search-result__item').length;
            if (n > 0 || ++tries > 50) { done(n); } else { setTimeout(look, 100); }
        };
        look();
    })""")
    assert hits > 0, "the search box found nothing for 'block shuffle'"
    js("document.querySelector('input.md-search__input').value = ''; document.activeElement.blur(); "
       "document.querySelector('[data-md-toggle=search]').checked = false")
    browser.drain(0.3)
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
    os.makedirs(SHOTS, exist_ok=True)
    path = os.path.join(SHOTS, f"{name}.png")
    with open(path, "wb") as fh:
        fh.write(base64.b64decode(shot))
    assert os.path.getsize(path) > 20_000
    errors = _errors(browser.events, session)
    browser.send("Target.closeTarget", {"targetId": target})
    assert not errors, "\n".join(errors)
